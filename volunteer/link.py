"""The volunteer's link to the tracker: heartbeats, the step watch, its allotment, and asking for a group.

A step's close reaches the volunteer within a round trip: :meth:`TrackerLink.watch` long-polls for it. What the
tracker last said of the step (:attr:`TrackerLink.news`, from the watch or a heartbeat's reply, whichever came
last; announced by :attr:`TrackerLink.changed`) is what the training loop acts on. The watch also answers when
samples of the open step were freed or spares opened (:attr:`TrackerLink.freed`): the peer heartbeats at once,
so one at its allotment gets a share of them and one still computing shows it is alive. So a peer waiting at its allotment costs the tracker nothing (a long-poll), and heartbeats keep
their interval. The tracker's share of each step for this peer arrives in heartbeat and ready replies and is
kept in one :class:`Allotment`. Ready calls start in one place, :meth:`TrackerLink.ask_ready`; a call for a step
already asked is the same call, and one can be made the moment a step's close is heard
(:meth:`TrackerLink.ready_on_close`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from crowdtrain.protocol.aio import wait_at_most
from crowdtrain.protocol.credentials import verify_assignment
from crowdtrain.protocol.errors import AveragingError, TrackerError
from crowdtrain.protocol.messages import (
    GroupAssignment,
    Heartbeat,
    HeartbeatReply,
    ReadyReply,
    ReadyRequest,
    SpotCheck,
)
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.joined import JoinedRun

if TYPE_CHECKING:
    from crowdtrain.volunteer.data import DataFeed
    from crowdtrain.volunteer.meter import Meter
    from crowdtrain.volunteer.rounds import Taken

WATCH_S = 20.0  # long-poll for a step's close (the tracker may cap it)


@dataclass(slots=True)
class Allotment:
    """This peer's share of a step, as the tracker last said it (a heartbeat's reply for the current step, a
    ready reply for the next): every peer stops at its allotment and reports at once, and the allotments never
    sum above the target (but for the tracker's spares: a peer done with the step may be allotted the rest of
    one behind it, which is then allotted what it holds), so the step closes on its target."""

    step: int = -1
    samples: int | None = None
    # its share of a step by rate (it moves with the rates): how much to compute ahead for the next step
    ahead: int | None = None
    since: float = field(default_factory=time.monotonic)  # when the last allotment arrived

    def heard(self, step: int, samples: int) -> None:
        self.step, self.samples, self.since = step, samples, time.monotonic()

    def quota(self, step: int, *, accumulated: int, early: int | None, silent_s: float) -> int | None:
        """How many samples to accumulate for ``step``, ``accumulated`` so far (``early``: the share of it
        already taken, computing ahead for the next step); None: as many as it can, because the tracker has
        said nothing for ``silent_s``."""
        if early is not None:
            return self.ahead_cap(early)
        if self.step == step and self.samples is not None:
            return self.samples
        # a new step: wait (a round trip) for the allotment, unless the tracker is silent
        return None if time.monotonic() - self.since > silent_s else accumulated

    def heard_ahead(self, ahead: int | None) -> None:
        """The tracker's word on how much to compute ahead (None: half of each step's share)."""
        self.ahead = ahead

    def ahead_cap(self, quota: int) -> int:
        """How many samples to compute ahead for the next step once this one's ``quota`` is computed: this
        peer's share of a step by rate, as the tracker last said (it leaves room for the others, newcomers
        too), or half the allotment from a tracker that does not say."""
        return self.ahead if self.ahead is not None else quota // 2


@dataclass(frozen=True, slots=True)
class StepNews:
    """What the tracker last said of the run's step: its global step, and whether that step closed."""

    global_step: int
    step_closed: bool


@dataclass(slots=True)
class Group:
    """The tracker's answer to a ready call: this peer's group in each phase (``group``), ``missed`` (the step
    closed without it; ``global_step`` says where the run is), or nothing to average (``open``/``none``)."""

    status: str
    phases: list[GroupAssignment]
    global_step: int
    check: SpotCheck | None = None  # a member's gradient of this step to recompute (tracker/spotchecks.py)


class TrackerLink:
    """Heartbeats, the step watch and ready calls of one joined volunteer.

    ``progress`` builds each heartbeat from the engine's figures; ``on_reply`` sees each reply first (the
    engine says "ready" at once from there when it computes ahead)."""

    def __init__(
        self,
        run: JoinedRun,
        progress: Callable[[], Heartbeat],
        on_reply: Callable[[HeartbeatReply], None],
    ) -> None:
        self.run = run
        self._progress = progress
        self._on_reply = on_reply
        self.news: StepNews | None = None  # the tracker's newest word on the step (None: wait for one)
        self.changed = asyncio.Event()  # set by each reply
        self.freed = False  # the watch heard that samples of the step were freed (since the last heartbeat)
        self._now = asyncio.Event()  # set: send the next heartbeat now
        self._rate_unknown = False  # the last reply had no ETA: no peer of the open step reported a rate yet
        self.allotment = Allotment()
        self.notice: str | None = None  # the run-wide problem the tracker reports, if any
        self._reachability: tuple | None = None
        self._ready: tuple[int, asyncio.Task[ReadyReply | None]] | None = None
        self._on_close: tuple[int, int, Callable[[], int]] | None = None  # see ready_on_close

    def poke(self) -> None:
        """Send the next heartbeat now."""
        self._now.set()

    def report(self) -> None:
        """At its share of the step: report it now (the reply carries its share of what is free then)."""
        self.freed = False
        self.poke()

    def ask_for_freed(self) -> None:
        """Samples of the step were freed since the last heartbeat: ask for a share of them."""
        if self.freed:
            self.freed = False
            self.poke()

    async def wait(self, at_most: float) -> None:
        """Until the tracker's next reply (or ``at_most`` seconds)."""
        await wait_at_most(self.changed, at_most)
        self.changed.clear()

    def forget_news(self) -> None:
        """The step it was about was taken: wait for a fresh view of the new step."""
        self.news = None

    # ------------------------------------------------------------------ heartbeats

    async def heartbeats(self) -> None:
        """Report progress every interval; a tracker that is down only pauses averaging."""
        run, failures = self.run, 0
        while not run.stopping:
            try:
                await self._heartbeat_once()
                if failures:
                    run.note(logging.INFO, "tracker answers again after %d failed heartbeats", failures)
                failures = 0
            except TrackerError as exc:
                if exc.status == 410:  # the run was closed or deleted by its admin: nothing more to do
                    run.summary.end(str(exc))
                    run.note(logging.WARNING, "%s; leaving", exc)
                    run.me.stop.set()
                    return
                failures += 1
                if failures in (1, 10) or failures % 60 == 0:
                    run.note_tracker_failure(
                        "heartbeat failed (%s); training goes on and will report when it is back", exc, exc
                    )
            await self.sleep_until(self._next_heartbeat_s(), self._now)
            self._now.clear()

    async def _heartbeat_once(self) -> None:
        run = self.run
        hb = self._progress()
        self.freed = False  # (this reply carries its allotment of what is free now)
        reply = await run.tracker.heartbeat(run.config.run_id, hb, run.key, run.credential)
        if reply.global_step == hb.step == run.pos.step and reply.allotment is not None:
            self.allotment.heard(hb.step, reply.allotment)
        self.allotment.heard_ahead(reply.ahead_share)
        if reply.inner is not None:
            run.trainer.heard_inner(reply.inner)
        self._hear(reply.global_step, reply.step_closed)
        self._rate_unknown = reply.eta_s is None and not reply.step_closed and not reply.notice
        self._on_reply(reply)
        self._told_reachability(reply)
        run.emit(
            ev.Progress(
                global_step=reply.global_step,
                samples=reply.samples,
                target=reply.target,
                peers_online=reply.peers_online,
                samples_per_s=reply.samples_per_s,
                eta_s=reply.eta_s,
                reachable=reply.reachable,
            )
        )

    def _next_heartbeat_s(self) -> float:
        """The heartbeat interval: the close and a larger share come on the step watch, so nothing is gained
        by asking more often; but while the run's rate is unknown (its first moments), every 0.25 s, so the
        first allotments (made before any rate was known) are shared out again soon."""
        interval = self.run.heartbeat_interval
        return min(interval, 0.25) if self._rate_unknown else interval

    async def sleep_until(self, seconds: float, event: asyncio.Event) -> None:
        """Sleep ``seconds``, or less if ``event`` or the stop is set."""
        waits = {asyncio.ensure_future(self.run.me.stop.wait()), asyncio.ensure_future(event.wait())}
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _told_reachability(self, reply: HeartbeatReply) -> None:
        """Tell the user where others reach this machine, once the tracker's checks answered, and again
        whenever that changes; and any run-wide problem the tracker reports."""
        run = self.run
        if reply.notice != self.notice:
            self.notice = reply.notice
            run.emit(ev.RunNotice(message=reply.notice))
        settled = run.declared is None or reply.checked
        bt_settled = reply.bt_reachable is not None or reply.bt_address is None
        if not settled or not bt_settled:
            return
        seen = ev.Reachability(
            address=reply.address,
            reachable=reply.reachable if run.declared is not None else None,
            bt_address=reply.bt_address,
            bt_reachable=reply.bt_reachable,
            asked_client_mode=run.config.client_mode,
        )
        key = (seen.address, seen.reachable, seen.bt_address, seen.bt_reachable)
        if key != self._reachability:
            self._reachability = key
            run.emit(seen)

    # ------------------------------------------------------------------ the step's close

    async def watch(self) -> None:
        """Hear of a step's close within a round trip (a long-poll), not at the next heartbeat: the training
        loop acts on it (and a ready call waiting for it goes out at once); hear too that samples of the step
        were freed or spares opened (:attr:`freed`: the peer heartbeats at once)."""
        run = self.run
        while not run.stopping:
            step = run.pos.step
            try:
                watch = await run.tracker.watch_step(run.config.run_id, step, WATCH_S)
            except TrackerError:
                await self.sleep_until(run.heartbeat_interval, run.me.stop)
                continue
            if watch.global_step > step or watch.step_closed:
                self._hear(watch.global_step, watch.step_closed)
                # until this peer moved on from that step (or a heartbeat interval passed): the same answer
                # again would tell nothing new
                deadline = time.monotonic() + run.heartbeat_interval
                while run.pos.step == step and time.monotonic() < deadline and not run.stopping:
                    await self.sleep_until(0.05, run.me.stop)
            elif watch.free:
                self.freed = True
                self.changed.set()
                # report now, mid-micro-batch if need be: a peer at its share asks for its part of what is
                # free; one still computing whose rest the tracker gave others as spares is cut to what it
                # holds (the step closes on its target), and shows it is alive
                self.poke()

    def _hear(self, global_step: int, step_closed: bool) -> None:
        """The tracker's word on the step, from a heartbeat's reply or the watch: kept unless it is older
        than the word already kept (the other way's answer came first), and a ready call waiting for the
        step's close goes out now."""
        news = self.news
        if news is None or (global_step, step_closed) >= (news.global_step, news.step_closed):
            self.news = StepNews(global_step, step_closed)
        on_close = self._on_close
        if on_close is not None and step_closed and global_step == on_close[0]:
            self.ask_ready(*on_close)
        self.changed.set()

    # ------------------------------------------------------------------ groups

    def ready_on_close(self, step: int, weight: int, ahead: Callable[[], int]) -> None:
        """Make the ready call of ``step`` (``weight``; ``ahead``: see :meth:`ask_ready`) the moment its close
        is heard, by the watch or a heartbeat, rather than when the training loop next looks (computing
        ahead, it is in a micro-batch then); at once if the close was heard already."""
        news = self.news
        if news is not None and news.step_closed and news.global_step == step:
            self.ask_ready(step, weight, ahead)
        else:
            self._on_close = (step, weight, ahead)

    def asked(self, step: int) -> bool:
        """Whether the ready call of ``step`` went out already."""
        return self._ready is not None and self._ready[0] == step

    def ask_ready(
        self, step: int, weight: int, ahead: Callable[[], int] | None = None
    ) -> asyncio.Task[ReadyReply | None]:
        """The ready call of ``step`` (made now, or the one already made): the only place one starts.
        ``ahead``: each call says how many samples it computed for the next step by then."""
        self._on_close = None
        if self._ready is not None:
            if self._ready[0] == step:
                return self._ready[1]
            self._ready[1].cancel()
        task = asyncio.get_running_loop().create_task(self._ask(step, weight, ahead))
        self._ready = (step, task)
        return task

    def cancel_ready(self) -> None:
        self._on_close = None
        if self._ready is not None:
            self._ready[1].cancel()
            self._ready = None

    async def _ask(self, step: int, weight: int, ahead: Callable[[], int] | None) -> ReadyReply | None:
        """Long-poll ``ready`` until the tracker answers with a group, ``missed`` or ``open``; None if it
        cannot be asked. ``ahead`` is what was computed for the next step, not promised: a promise would count
        toward that step before it is kept."""
        run = self.run
        while not run.stopping:
            computed = ahead() if ahead is not None else 0
            try:
                reply = await run.tracker.ready(
                    run.config.run_id,
                    ReadyRequest(peer_id=run.peer_id, step=step, weight=weight, ahead=computed),
                    run.key,
                    run.credential,
                )
            except TrackerError as exc:
                if exc.status == 410:  # closed under it: the heartbeats say so and stop the engine
                    run.summary.end(str(exc))
                    run.me.stop.set()
                    return None
                run.note_tracker_failure("could not ask the tracker for a group (%s); training on", exc, exc)
                return None
            if reply.status in ("group", "missed", "open"):
                return reply
            await asyncio.sleep(reply.retry_after_s)
        return None

    async def group(self, step: int, weight: int, ahead: Callable[[], int] | None = None) -> Group:
        """This peer's group of ``step`` in each phase, in order (from the ready call already made, or a new
        one). The reply's allotment of the next step is kept."""
        task = self.ask_ready(step, weight, ahead)
        try:
            reply = await task
        finally:
            if self._ready is not None and self._ready[1] is task:
                self._ready = None
        if reply is None:
            return Group("none", [], step)
        if reply.status == "group" and reply.assignment is not None:
            phases = [reply.assignment, *reply.later_phases]
            for a in phases:
                verify_assignment(a, self.run.spec.tracker_public_key)
                if a.step != step or self.run.peer_id not in (m.peer_id for m in a.members):
                    raise AveragingError(f"the tracker's group for step {step} does not hold this peer")
            if reply.next_allotment is not None and reply.global_step == step + 1:
                self.allotment.heard(step + 1, reply.next_allotment)
            if reply.inner is not None:
                self.run.trainer.heard_inner(reply.inner)
            return Group("group", phases, reply.global_step, reply.spot_check)
        if reply.status == "open":
            # no reachable peer was ready: nothing was averaged; wait for a fresh view of the step
            self.news = None
        return Group(reply.status, [], reply.global_step)


def progress_report(
    run: JoinedRun, data: DataFeed, meter: Meter, catching_up: bool, early: Taken | None
) -> Heartbeat:
    """The heartbeat of a peer: what it computed for the step (its gradient ``early``, if taken), its rate and
    figures. While catching up its gradients are computed on parameters that are not the run's: none count."""
    return Heartbeat(
        peer_id=run.peer_id,
        step=run.pos.step,
        samples=0 if catching_up else early.weight if early else run.trainer.samples,
        # what it computes counts: not catching up, holding a chunk, not a backbone (with its share
        # taken early, it computes for the next step: done with this one)
        computing=not (catching_up or run.config.backbone) and data.sampler.ready and early is None,
        backbone=run.config.backbone,
        samples_per_s=meter.samples_per_s,
        address=run.declared,
        chunks_held=data.chunks_held,
        loss=None if catching_up else meter.loss_ema,  # (computed while catching up: not the run's loss)
        bt_port=data.bt_port(),
        compute_share=meter.compute_share(),
        eval=data.heldout.report,
        upload_bps=run.averager.upload_bps,
        averaging_s=meter.averaging_s,
    )
