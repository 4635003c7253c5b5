"""The volunteer engine: join a run, train on the chunks it has, average with its group, step, repeat.

The engine emits :mod:`crowdtrain.volunteer.events` and never imports rich. One :class:`Volunteer` lives in
one ``asyncio.run``; its long-lived tasks (torrent, heartbeats, step watch, statistics, training) share a
TaskGroup. This module holds the wiring and the training loop; each part it wires holds one job: joining and
leaving (:mod:`~crowdtrain.volunteer.joined`, whose joined run every part is given), the tracker link
(:mod:`~crowdtrain.volunteer.link`: heartbeats, step watch, allotment, ready calls), the data
(:mod:`~crowdtrain.volunteer.data`), a step's rounds (:mod:`~crowdtrain.volunteer.rounds`), snapshots
(:mod:`~crowdtrain.volunteer.snapshotter`), catch-up (:mod:`~crowdtrain.volunteer.catchup`) and the volunteer's
figures (:mod:`~crowdtrain.volunteer.meter`).

A global step, as this peer sees it (DeDLOC):

1. accumulate micro-batches from verified chunks (gradients weighted by samples) while heartbeats report
   the count to the tracker, up to this peer's allotment of the step;
2. when the tracker says the step's target is reached, stop accumulating and long-poll ``ready`` with the
   accumulated sample count as weight;
3. the tracker answers with a signed group (and this peer's allotment of the next step); the group
   all-reduces the mean gradient; every member applies the same averaged gradient with the same optimizer
   and moves to the next step; every ``average_state_every`` steps the group also averages parameters.
   With the run's ``averaging.delay = 1`` the all-reduce runs in the background while the next step's
   gradients are computed on the same parameters, and its average is applied when that next step closes;
4. a step that closed without this peer (``missed``) drops its accumulation (no gradient outlives its
   parameters) and the peer fetches the current state from peers, taking part with weight 0 meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time

from crowdtrain.protocol.aio import wait_at_most
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.messages import Heartbeat, HeartbeatReply, RunSpec
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.catchup import CatchUp
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.data import DataFeed
from crowdtrain.volunteer.joined import JoinedRun, Summary, Volunteering, join_run, load_checkpoint
from crowdtrain.volunteer.link import TrackerLink
from crowdtrain.volunteer.meter import Meter
from crowdtrain.volunteer.rounds import Round, Rounds
from crowdtrain.volunteer.snapshotter import Snapshotter
from crowdtrain.volunteer.trainer import Trainer

__all__ = ["Summary", "Volunteer", "load_checkpoint"]

LOCAL_REPORT_S = 1.0
IDLE_POLL_S = 0.2  # at its share of the step: how often the loop looks around (asking the tracker nothing)


class Volunteer:
    """One volunteer. ``emit`` receives its events (for the view, the JSON lines).

    ``record`` is for tests: a callable that receives :class:`~crowdtrain.volunteer.events.BatchComputed`
    (each micro-batch's provenance, by the step its gradient was accumulated toward) and
    :class:`~crowdtrain.volunteer.events.ParamsAfterStep` (a copy of the flat parameters after each applied
    step, and after a catch-up). It is given at construction, never changed, and kept apart from ``emit``:
    a copy of the model's size is taken only when a ``record`` was given, right after the step is applied and
    before training goes on (it holds that step's parameters). Without one (the CLI), no copy is made.
    """

    def __init__(
        self, config: VolunteerConfig, emit: ev.Emit = ev.no_emit, record: ev.Record | None = None
    ) -> None:
        self.config = config
        self.summary = Summary()
        # (its data folder's key replaces this one when it joins: volunteer/folder.py)
        self._me = Volunteering(config, SigningKey(), self.summary, asyncio.Event(), emit, record)
        self._run: JoinedRun | None = None  # once joined
        self._training: Training | None = None

    # what a caller may read of it while it runs (None / 0 / "" until it joined)

    @property
    def peer_id(self) -> str:
        return self.summary.peer_id

    @property
    def step(self) -> int:
        """The global step this peer accumulates for."""
        return self._run.pos.step if self._run is not None else self.summary.first_step

    @property
    def spec(self) -> RunSpec | None:
        return self._run.spec if self._run is not None else None

    @property
    def trainer(self) -> Trainer | None:
        return self._run.trainer if self._run is not None else None

    @property
    def samples_per_s(self) -> float:
        return self._training.meter.samples_per_s if self._training is not None else 0.0

    def stop(self) -> None:
        """Ask the engine to leave after the current micro-batch or round."""
        self._me.stop.set()

    async def run(self) -> Summary:
        """Join, train until the run ends, ``max_steps`` or :meth:`stop`, and leave; Ctrl-C (cancellation)
        leaves too, in order, and is raised again."""
        reason = "finished"
        try:
            async with join_run(self._me) as run:
                self._run = run
                self._training = Training(run)
                await self._training.go()
        except asyncio.CancelledError:
            reason = "interrupted"
            raise
        finally:
            if self.summary.peer_id:  # it joined: it left
                self.summary.last_step = self.step
                if self._training is not None:
                    self.summary.compute_share = self._training.meter.compute_share()
                self._me.emit(ev.Left(reason="run closed" if self.summary.ended else reason))
        return self.summary


class Training:
    """A joined run, trained: the parts wired together, and the training loop that drives them."""

    def __init__(self, run: JoinedRun) -> None:
        self.run = run
        self.meter = Meter()
        self.data = DataFeed(run)
        self.rounds = Rounds(run, self.meter)
        self.snaps = Snapshotter(run)
        self.catchup = CatchUp(run, self.rounds, self.snaps, self._drop_accumulation)
        self.link = TrackerLink(run, self._heartbeat, self._on_reply)
        self._at_quota = False  # stopped at its share of the step, waiting for the close
        self._shown = ""  # the phase the view was told last
        self._micro_batches = 0
        self._last_report = 0.0

    async def go(self) -> None:
        run = self.run
        run.announce()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.data.stream())
                tg.create_task(self.link.heartbeats())
                watch = tg.create_task(self.link.watch())
                tg.create_task(self.data.stats())
                tg.create_task(run.me.sleeps.watch(run.me.stop))
                await tg.create_task(self.train())
                run.me.stop.set()
                watch.cancel()  # its long-poll would hold the exit for up to WATCH_S
        finally:
            run.me.stop.set()
            run.phase("leaving")
            self.catchup.cancel()
            self.link.cancel_ready()
            self.rounds.cancel()
            self.snaps.cancel()
            await self.snaps.written()  # a thread: let it finish its file
            # (catching up or waiting, it does not hold the run's state)
            if not self.catchup.active and self.catchup.waiting is None:
                await self.snaps.keep()

    # ------------------------------------------------------------------ the training loop

    async def train(self) -> None:
        run = self.run
        cfg = run.config
        if run.pos.step > 0 and cfg.catch_up:
            self.catchup.start()
        while not run.stopping:
            if self.data.error is not None:
                raise self.data.error
            if cfg.max_steps is not None and run.pos.step >= cfg.max_steps:
                break
            if self.catchup.fetched and self.rounds.settled():
                await self.catchup.switch(self._conclude)
            if self.catchup.waiting is not None and self.catchup.active:
                # no peer serves the run's state: nothing computed here would count (or be the run's)
                self._show("waiting-for-state")
                await wait_at_most(run.me.stop, 0.5)
                continue
            if self.catchup.active:
                self._show("catching-up")
            elif not self.data.sampler.ready:
                self._show("downloading")
            else:  # (a backbone computes nothing: it waits for each step's round)
                self._show("waiting-for-step" if self._at_quota or cfg.backbone else "training")
            if await self._work():
                await self._follow()
        # delay 1: the last step's average is still under way; its group counts on this peer's part
        if self.rounds.under_way:
            await self._conclude(await self.rounds.take_round())

    def _show(self, phase: str) -> None:
        if phase != self._shown:
            self._shown = phase
            self.run.phase(phase)

    async def _work(self) -> bool:
        """Compute a micro-batch, or wait at this peer's share of the step; False: look at nothing else
        this turn (the step's gradient was just taken early)."""
        quota = self._quota_now()
        trainer, link = self.run.trainer, self.link
        # No chunk yet, a backbone, or catching up once its rate is known (computed on parameters that are not
        # the run's, nothing counts): it only takes part in its group's rounds, with weight 0.
        idle = self.catchup.active and self.meter.samples_per_s > 0
        if not self.data.sampler.ready or self.run.config.backbone or idle:
            if self.catchup.fetched:  # (delay 1: switch once the round under way ends, before the next close)
                return await self.rounds.settle()
            await wait_at_most(link.changed, 0.1)
            link.changed.clear()
        elif quota is None or trainer.samples < quota:
            self._at_quota = False
            await self._compute(quota)
        elif self.rounds.may_take_early(quota, self.link, self.catchup.active):
            # delay 1: its share is computed; take it, apply the previous step's average and compute the
            # next step's micro-batches on those parameters while the others finish this step
            early = await self.rounds.hand_over(False, self._conclude)
            self.rounds.early = None if self.catchup.active else early  # (the previous round failed)
            if self.rounds.early is not None:  # say "ready" the moment the close is heard, mid-micro-batch
                link.ready_on_close(early.step, early.weight, self._computed_ahead)
            link.poke()  # tell the tracker it is done with this step
            self._shown = ""  # (the step's hand-over showed "stepping")
            return False
        else:
            # its share of the step is computed: report it, then wait for the close, or a larger share if
            # samples were freed; the step watch (a long-poll) tells both: waiting asks the tracker nothing
            if not self._at_quota:
                self._at_quota = True
                link.freed = False  # (the report's reply carries its share of what is free now)
                link.poke()
            await wait_at_most(link.changed, IDLE_POLL_S)
            link.changed.clear()
            if link.freed:  # ask for a share of them
                link.freed = False
                link.poke()
        return True

    async def _compute(self, quota: int | None) -> None:
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
        self._micro_batches += 1
        if now - self._last_report >= LOCAL_REPORT_S:
            self._last_report = now
            run.emit(
                ev.LocalTraining(
                    loss=loss,
                    samples=trainer.samples,
                    samples_per_s=self.meter.samples_per_s,
                    micro_batches=self._micro_batches,
                    inner_steps=trainer.inner_taken,
                    compute_share=self.meter.compute_share(),
                )
            )

    async def _follow(self) -> None:
        """Act on the tracker's newest word: the step closed (average and step) or moved on (missed)."""
        news, pos = self.link.news, self.run.pos
        if news is None:
            return
        # its ready call for this step went out already (computing ahead): the round may have formed, so a
        # reply with a later global step is no sign of a missed step
        asked = self.link.asked(pos.step)
        if news.global_step > pos.step and not asked:
            self._fell_behind(news.global_step)
        elif asked or (news.global_step == pos.step and news.step_closed):
            await self._average_and_step()
            self.link.news = None  # wait for a fresh view of the new step
            self._at_quota = False
            self._shown = ""
        else:
            return
        self.link.poke()  # it began its new step: say so (its share is timed from then; docs/tracker.md, 9)

    # ------------------------------------------------------------------ the allotment

    def _quota_now(self) -> int | None:
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

    def _computed_ahead(self) -> int:
        """What a ready call says it computed for the next step (while computing ahead)."""
        return self.run.trainer.samples if self.rounds.early is not None else 0

    # ------------------------------------------------------------------ the tracker's word

    def _heartbeat(self) -> Heartbeat:
        run = self.run
        # while catching up its gradients are computed on parameters that are not the run's: none count
        catching_up = self.catchup.active
        early = self.rounds.early
        return Heartbeat(
            peer_id=run.peer_id,
            step=run.pos.step,
            samples=0 if catching_up else early.weight if early else run.trainer.samples,
            # what it computes counts: not catching up, holding a chunk, not a backbone (with its share
            # taken early, it computes for the next step: done with this one)
            computing=not (catching_up or run.config.backbone) and self.data.sampler.ready and early is None,
            backbone=run.config.backbone,
            samples_per_s=self.meter.samples_per_s,
            address=run.declared,
            chunks_held=self.data.chunks_held,
            # (computed while catching up, on parameters that are not the run's: not the run's loss)
            loss=None if catching_up else self.meter.loss_ema,
            bt_port=self.data.bt_port(),
            compute_share=self.meter.compute_share(),
            eval=self.data.heldout.report,
            upload_bps=run.averager.upload_bps,
        )

    def _on_reply(self, reply: HeartbeatReply) -> None:
        """Computing ahead, and the step closed: say "ready" now, not after the micro-batch in flight."""
        early = self.rounds.early
        if early is not None and reply.step_closed and reply.global_step == early.step:
            self.link.ask_ready(early.step, early.weight, self._computed_ahead)

    # ------------------------------------------------------------------ a step

    def _drop_accumulation(self) -> int:
        early, self.rounds.early = self.rounds.early, None
        self.link.cancel_ready()
        dropped = self.run.trainer.samples + (early.weight if early else 0)
        self.run.trainer.reset_accumulation()
        self.run.averager.samples.dropped(self.run.pos.step)
        self.meter.drop_step()
        return dropped

    def _fell_behind(self, global_step: int) -> None:
        """The run moved on without this peer. Its accumulated gradients were computed on parameters the
        others have left behind: they are dropped (no gradient outlives its parameters), and the peer
        fetches the current state, taking part with weight 0 meanwhile."""
        run = self.run
        if not self.catchup.active:
            dropped = self._drop_accumulation()
            run.emit(ev.StepMissed(step=run.pos.step, now_step=global_step, dropped_samples=dropped))
            run.summary.steps_missed += 1
            if run.config.catch_up:
                self.catchup.start()
        run.pos.step = global_step

    async def _average_and_step(self) -> None:
        """One collaborative step: get this step's group, average the gradient, apply it (delay 0), or apply
        the previous step's average and leave this one averaging in the background (delay 1). While
        catching up, take part with weight 0 and keep the averages for the replay once the fetched state is
        loaded, so the newcomer ends exactly where the others are."""
        run, pos = self.run, self.run.pos
        step = pos.step
        catching_up = self.catchup.active
        taken = self.rounds.early
        weight = taken.weight if taken else 0 if catching_up else run.trainer.samples
        run.phase("waiting-for-group")
        # (with the samples it computed for the next step so far: its allotment of it is never below them)
        group = await self.link.group(step, weight, self._computed_ahead if taken is not None else None)
        if group.status == "missed":
            self._fell_behind(group.global_step)
        if not group.phases:
            run.phase("catching-up" if catching_up else "training")
            return
        if taken is None:
            taken = await self.rounds.hand_over(catching_up, self._conclude)
        self.rounds.early = None
        rnd = Round(
            step, group.phases, taken.weight, catching_up, taken.compute_s, taken.loss, time.monotonic()
        )
        rnd.check = group.check
        if run.delay:
            pos.step = step + 1
            self.rounds.start(rnd, taken.grad)
        else:
            run.phase("averaging")
            await self._conclude(await self.rounds.average(rnd, taken.grad))
            pos.step = step + 1
        run.phase("catching-up" if self.catchup.active else "training")

    async def _conclude(self, rnd: Round | None) -> None:
        """Apply a finished round's average (or keep it for the replay while catching up)."""
        run = self.run
        if rnd is None:
            return
        if rnd.mean is None:
            failed = (
                f"averaging round of step {rnd.step} failed ({rnd.error}); this peer will fetch the state"
            )
            run.note(logging.WARNING, failed)
            self.catchup.round_failed()
            return
        if self.catchup.active:
            await self.catchup.keep(rnd, rnd.mean)
            return
        run.phase("stepping")
        lr = await self.rounds.apply(rnd, rnd.mean, self.snaps.stepping)
        run.pos.applied = rnd.step + 1
        run.summary.steps_done += 1
        if rnd.weight > 0:
            self.meter.counted(rnd.compute_s)
        if rnd.loss is not None:
            run.summary.losses.append(rnd.loss)
        await run.record_params()
        run.emit(
            ev.StepDone(
                step=rnd.step,
                lr=lr,
                contributed_samples=rnd.weight,
                group_samples=rnd.group_samples,
                step_time_s=time.monotonic() - rnd.started,
                loss=rnd.loss,
                compute_s=rnd.compute_s,
                compute_share=self.meter.compute_share(),
                delayed=bool(run.delay),
            )
        )
        self.snaps.applied()
        heldout = self.data.heldout
        if heldout.due(run.pos.applied) and await heldout.evaluate(run.pos.applied):
            self.link.poke()
