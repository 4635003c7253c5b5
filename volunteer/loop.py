"""The training loop of a joined run, as one state machine.

Each turn the loop decides what it does (:class:`State`, in :meth:`Training.state`, the one place a state is
chosen) from what its parts say; each state has one handler; a state entered anew (or anew in a step) has its
entry action in :meth:`Training.enter`. The parts (tracker link, data, rounds, snapshots, catch-up, meter)
answer and act on their own fields only: the loop alone moves this peer's position in the run.

A global step, as this peer sees it (DeDLOC):

1. accumulate micro-batches from verified chunks up to this peer's share of the step (``COMPUTING``), while
   heartbeats report the count; at its share, report it and wait for the close (``AT_ALLOTMENT``);
2. when the tracker says the step's target is reached, long-poll ``ready`` with the accumulated sample count
   as weight; the signed group all-reduces the mean gradient, every member applies it with the same
   optimizer and moves to the next step (:meth:`Training.average_and_step`). With ``averaging.delay = 1`` a
   peer at its share takes its gradient early (``TAKING_EARLY``) and computes the next step's micro-batches
   on the same parameters while its round runs in the background; its average is applied at the next close;
3. a step that closed without this peer drops its accumulation (no gradient outlives its parameters) and the
   peer fetches the run's state, taking part with weight 0 meanwhile (``IDLE`` once its rate is known, or
   ``WAITING_FOR_STATE`` while no peer serves one).
"""

from __future__ import annotations

import asyncio
import enum
import time

from crowdtrain.protocol.aio import wait_at_most
from crowdtrain.protocol.messages import Heartbeat, HeartbeatReply
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.catchup import CatchUp
from crowdtrain.volunteer.data import DataFeed
from crowdtrain.volunteer.joined import JoinedRun
from crowdtrain.volunteer.link import TrackerLink, progress_report
from crowdtrain.volunteer.meter import Meter
from crowdtrain.volunteer.resume import Landed
from crowdtrain.volunteer.rounds import Round, Rounds
from crowdtrain.volunteer.snapshotter import Snapshotter

IDLE_POLL_S = 0.2  # at its share of the step: how often the loop looks around (asking the tracker nothing)


class State(enum.Enum):
    """What the training loop does this turn."""

    WAITING_FOR_STATE = "waiting-for-state"  # catching up, and no peer serves the run's state: nothing counts
    IDLE = "idle"  # no chunk yet, a backbone, or catching up at a known rate: it only takes part in rounds
    COMPUTING = "computing"  # a micro-batch toward its share of the step (or of the next, computing ahead)
    TAKING_EARLY = "taking-early"  # delay 1, its share computed: the step's gradient is taken now
    AT_ALLOTMENT = "at-allotment"  # its share computed: report it, wait for the close or a larger share


class Training:
    """A joined run, trained: the parts wired together, and the loop that drives them."""

    def __init__(self, run: JoinedRun) -> None:
        self.run = run
        self.meter = Meter()
        self.data = DataFeed(run)
        self.rounds = Rounds(run, self.meter)
        self.snaps = Snapshotter(run)
        self.link = TrackerLink(run, self.heartbeat, self.on_reply)
        self.catchup = CatchUp(run, self.rounds, self.snaps, self.link)
        self._entered: tuple[State, int] | None = (
            None  # the state the loop is in, and the step it entered it in
        )

    # ------------------------------------------------------------------ the state machine

    async def train(self) -> None:
        run = self.run
        if run.pos.step > 0 and run.config.catch_up:
            self.catchup.start()
        while not run.stopping:
            if self.data.error is not None:
                raise self.data.error
            if run.config.max_steps is not None and run.pos.step >= run.config.max_steps:
                break
            if self.catchup.fetched and self.rounds.settled():
                landed = await self.catchup.switch()
                if landed is not None:
                    await self.land(landed)
            quota = self.quota()
            state = self.state(quota)
            self.enter(state)
            if await self.act(state, quota):
                await self.follow()
        # delay 1: the last step's average is still under way; its group counts on this peer's part
        if self.rounds.under_way:
            await self.conclude(await self.rounds.take_round())

    def state(self, quota: int | None) -> State:
        """The one place the loop's state is decided."""
        catchup, rounds = self.catchup, self.rounds
        if catchup.active and catchup.waiting is not None:
            return State.WAITING_FOR_STATE
        # computing while catching up only to learn its rate (on parameters that are not the run's, nothing counts)
        idle = catchup.active and self.meter.samples_per_s > 0
        if not self.data.sampler.ready or self.run.config.backbone or idle:
            return State.IDLE
        if quota is None or self.run.trainer.samples < quota:
            return State.COMPUTING
        link = self.link
        if rounds.may_take_early(link.allotment.ahead_cap(quota), bool(link.notice), catchup.active):
            return State.TAKING_EARLY
        return State.AT_ALLOTMENT

    def enter(self, state: State) -> None:
        """Say the phase; a state entered anew in this step runs its entry action."""
        run = self.run
        if self.catchup.active:
            run.phase("waiting-for-state" if state is State.WAITING_FOR_STATE else "catching-up")
        elif not self.data.sampler.ready:
            run.phase("downloading")
        else:  # (a backbone computes nothing: it waits for each step's round)
            waits = state is State.AT_ALLOTMENT or run.config.backbone
            run.phase("waiting-for-step" if waits else "training")
        entered = (state, run.pos.step)
        if entered != self._entered and state is State.AT_ALLOTMENT:
            # its share of the step is computed: report it (the reply carries its share of what is free now)
            self.link.report()
        self._entered = entered

    async def act(self, state: State, quota: int | None) -> bool:
        """This turn's work in ``state``; False: look at nothing else this turn."""
        link = self.link
        match state:
            case State.WAITING_FOR_STATE:
                await wait_at_most(self.run.me.stop, 0.5)
                return False
            case State.IDLE if self.catchup.fetched:  # (delay 1: switch once the round under way ends)
                return await self.rounds.settle()
            case State.IDLE:
                await link.wait(0.1)
            case State.COMPUTING:
                await self.compute(quota)
            case State.TAKING_EARLY:
                await self.take_early()
                return False
            case State.AT_ALLOTMENT:
                # wait for the close, or a larger share if samples were freed; the step watch (a long-poll)
                # tells both: waiting asks the tracker nothing
                await link.wait(IDLE_POLL_S)
                link.ask_for_freed()
        return True

    async def land(self, landed: Landed) -> None:
        """Move to where a switch to a fetched (or kept) state left this peer."""
        run = self.run
        run.pos.move(landed.step, applied=landed.applied)
        if landed.caught_up:
            run.summary.caught_up(run.pos.step)
        await run.record_params()
        run.phase("training")

    # ------------------------------------------------------------------ computing

    def quota(self) -> int | None:
        """How many samples to accumulate for the current step (None: as many as it can: it catches up, or
        the tracker has not answered for this step for two heartbeat intervals)."""
        run, early = self.run, self.rounds.early
        if self.catchup.active:
            return None
        return self.link.allotment.quota(
            run.pos.step,
            accumulated=run.trainer.samples,
            early=early.weight if early is not None else None,
            silent_s=2 * run.heartbeat_interval,
        )

    async def compute(self, quota: int | None) -> None:
        """One micro-batch, at most what is left of this peer's share of the step."""
        run = self.run
        trainer = run.trainer
        micro = min(run.spec.micro_batch_size, run.config.max_batch or run.spec.micro_batch_size)
        n = micro if quota is None else min(micro, quota - trainer.samples)
        batch = self.data.sampler.batch(n)
        started = time.monotonic()
        self.meter.start(started)
        loss, n = await asyncio.to_thread(trainer.accumulate, batch.x, batch.y)
        now = time.monotonic()
        self.meter.computed(n, loss, started, now)
        if not self.catchup.active:  # (computed on parameters that are not the run's: not the run's samples)
            self.rounds.computed(batch.provenance, loss)
        report = self.meter.local_report(loss, trainer.samples, trainer.inner_taken, trainer.inner_lr, now)
        if report is not None:
            run.emit(report)

    async def take_early(self) -> None:
        """Delay 1, its share computed: take the step's gradient, apply the previous step's average and compute
        the next step's micro-batches on those parameters while the others finish this step."""
        early, previous = await self.rounds.hand_over(False)
        await self.conclude(previous)
        if not self.catchup.active:  # (the previous round failed: nothing taken counts)
            self.rounds.keep_early(early)
            # say "ready" the moment the close is heard, mid-micro-batch
            self.link.ready_on_close(early.step, early.weight, self.computed_ahead)
        self.link.poke()  # tell the tracker it is done with this step

    def computed_ahead(self) -> int:
        """What a ready call says it computed for the next step (while computing ahead)."""
        return self.run.trainer.samples if self.rounds.early is not None else 0

    # ------------------------------------------------------------------ the tracker's word

    def heartbeat(self) -> Heartbeat:
        return progress_report(self.run, self.data, self.meter, self.catchup.active, self.rounds.early)

    def on_reply(self, reply: HeartbeatReply) -> None:
        """Computing ahead, and the step closed: say "ready" now, not after the micro-batch in flight."""
        early = self.rounds.early
        if early is not None and reply.step_closed and reply.global_step == early.step:
            self.link.ask_ready(early.step, early.weight, self.computed_ahead)

    async def follow(self) -> None:
        """Act on the tracker's newest word: the step closed (average and step) or moved on (missed)."""
        news, pos = self.link.news, self.run.pos
        if news is None:
            return
        # its ready call for this step went out already (computing ahead): the round may have formed, so a
        # reply with a later global step is no sign of a missed step
        asked = self.link.asked(pos.step)
        if news.global_step > pos.step and not asked:
            self.fell_behind(news.global_step)
        elif asked or (news.global_step == pos.step and news.step_closed):
            await self.average_and_step()
            self.link.forget_news()  # wait for a fresh view of the new step
        else:
            return
        self.link.poke()  # it began its new step: say so (its share is timed from then; docs/tracker.md, 9)

    def fell_behind(self, global_step: int) -> None:
        """The run moved on without this peer. Its accumulated gradients were computed on parameters the
        others have left behind: they are dropped (no gradient outlives its parameters), and the peer
        fetches the current state, taking part with weight 0 meanwhile."""
        run = self.run
        if not self.catchup.active:
            self.link.cancel_ready()
            dropped = self.rounds.drop()
            run.emit(ev.StepMissed(step=run.pos.step, now_step=global_step, dropped_samples=dropped))
            run.summary.missed()
            if run.config.catch_up:
                self.catchup.start()
        run.pos.move(global_step)

    # ------------------------------------------------------------------ a step

    async def average_and_step(self) -> None:
        """One collaborative step: get this step's group, average the gradient, apply it (delay 0), or apply
        the previous step's average and leave this one averaging in the background (delay 1). While
        catching up, take part with weight 0 and keep the averages for the replay once the fetched state is
        loaded, so the newcomer ends exactly where the others are."""
        run, step = self.run, self.run.pos.step
        catching_up = self.catchup.active
        early = self.rounds.early
        weight = early.weight if early else 0 if catching_up else run.trainer.samples
        run.phase("waiting-for-group")
        # Ready means ready to average: with delay 1 its previous round must end first (this round's gradient
        # goes to the buffer that round reads, and that round's average is applied first). Said before, the
        # round's deadline would run while that round is held up (a member of it gone): every member of this
        # one gave it up before it started, and fetched the state.
        await self.rounds.settle()
        # (with the samples it computed for the next step so far: its allotment of it is never below them)
        group = await self.link.group(step, weight, self.computed_ahead if early is not None else None)
        if group.status == "missed":
            self.fell_behind(group.global_step)
        if not group.phases:
            run.phase("catching-up" if catching_up else "training")
            return
        taken = self.rounds.take_early()
        if taken is None:
            taken, previous = await self.rounds.hand_over(catching_up)
            await self.conclude(previous)
        rnd = Round(
            step, group.phases, taken.weight, catching_up, taken.compute_s, taken.loss, time.monotonic()
        )
        rnd.check = group.check
        await self.conclude(
            await self.rounds.begin(rnd, taken.grad)
        )  # (delay 1: under way in the background)
        run.pos.move(step + 1)
        run.phase("catching-up" if self.catchup.active else "training")

    async def conclude(self, rnd: Round | None) -> None:
        """Apply a finished round's average (or keep it for the replay while catching up)."""
        run = self.run
        if rnd is None:
            return
        if self.catchup.active or rnd.mean is None:
            await self.catchup.keep(rnd)  # (a failed round: the peer fetches the state)
            return
        await self.rounds.step(rnd, self.snaps.stepping)
        run.pos.move(run.pos.step, applied=rnd.step + 1)
        await run.record_params()
        self.snaps.applied()
        heldout = self.data.heldout
        if heldout.due(run.pos.applied) and await heldout.evaluate(run.pos.applied):
            self.link.poke()
