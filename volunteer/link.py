"""The volunteer's link to the tracker: heartbeats, the step watch, its allotment, and asking for a group.

A step's close reaches the volunteer within a round trip: :meth:`TrackerLink.watch` long-polls for it and,
on a close, sends a heartbeat at once; the heartbeat's reply (:attr:`TrackerLink.reply`, announced by
:attr:`TrackerLink.changed`) is what the training loop acts on. The tracker's share of each step for this peer
arrives in both kinds of reply and is kept in one :class:`Allotment`. Ready calls start in one place,
:meth:`TrackerLink.ask_ready`; a call for a step already asked is the same call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from crowdtrain.protocol.credentials import verify_assignment
from crowdtrain.protocol.errors import AveragingError, TrackerError
from crowdtrain.protocol.messages import GroupAssignment, Heartbeat, HeartbeatReply, ReadyReply, ReadyRequest
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.joined import JoinedRun

WATCH_S = 20.0  # long-poll for a step's close (the tracker may cap it)


@dataclass(slots=True)
class Allotment:
    """This peer's share of a step, as the tracker last said it (a heartbeat's reply for the current step, a
    ready reply for the next): every peer stops at its allotment and reports at once, and the allotments never
    sum above the target, so the step closes on exactly its target."""

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

    def ahead_cap(self, quota: int) -> int:
        """How many samples to compute ahead for the next step once this one's ``quota`` is computed: this
        peer's share of a step by rate, as the tracker last said (it leaves room for the others, newcomers
        too), or half the allotment from a tracker that does not say."""
        return self.ahead if self.ahead is not None else quota // 2


@dataclass(slots=True)
class Group:
    """The tracker's answer to a ready call: this peer's group in each phase (``group``), ``missed`` (the step
    closed without it; ``global_step`` says where the run is), or nothing to average (``open``/``none``)."""

    status: str
    phases: list[GroupAssignment]
    global_step: int


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
        self.reply: HeartbeatReply | None = None  # the newest heartbeat reply (None: wait for a fresh one)
        self.changed = asyncio.Event()  # set by each reply
        self._now = asyncio.Event()  # set: send the next heartbeat now
        self.allotment = Allotment()
        self.notice: str | None = None  # the run-wide problem the tracker reports, if any
        self._reachability: tuple | None = None
        self._ready: tuple[int, asyncio.Task[ReadyReply | None]] | None = None

    def poke(self) -> None:
        """Send the next heartbeat now."""
        self._now.set()

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
                    run.summary.ended = str(exc)
                    run.note(logging.WARNING, "%s; leaving", exc)
                    run.me.stop.set()
                    return
                failures += 1
                if failures in (1, 10) or failures % 60 == 0:
                    run.note(
                        logging.WARNING,
                        "heartbeat failed (%s); training goes on and will report when it is back",
                        exc,
                    )
            await self.sleep_until(self._next_heartbeat_s(), self._now)
            self._now.clear()

    async def _heartbeat_once(self) -> None:
        run = self.run
        hb = self._progress()
        reply = await run.tracker.heartbeat(run.config.run_id, hb, run.key, run.credential)
        if reply.global_step == hb.step == run.pos.step and reply.allotment is not None:
            self.allotment.heard(hb.step, reply.allotment)
        self.allotment.ahead = reply.ahead_share
        self.reply = reply
        self.changed.set()
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
        """The heartbeat interval, shorter near the end of a step (half its ETA, at least 0.1 s) and while
        the run's rate is unknown, so shares and the close follow the run closely where it matters."""
        reply, interval = self.reply, self.run.heartbeat_interval
        if reply is None or reply.step_closed or reply.notice:
            return interval
        if reply.eta_s is None:
            return min(interval, 0.25)
        return min(interval, max(0.1, reply.eta_s / 2))

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
        """Hear of a step's close within a round trip (a long-poll), not at the next heartbeat: on a close,
        heartbeat at once; its reply tells the training loop to average."""
        run = self.run
        while not run.stopping:
            step = run.pos.step
            try:
                watch = await run.tracker.watch_step(run.config.run_id, step, WATCH_S)
            except TrackerError:
                await self.sleep_until(run.heartbeat_interval, run.me.stop)
                continue
            if watch.global_step > step or watch.step_closed:
                self.poke()
                # until this peer moved on from that step (or a heartbeat interval passed): the same answer
                # again would only repeat the heartbeat
                deadline = time.monotonic() + run.heartbeat_interval
                while run.pos.step == step and time.monotonic() < deadline and not run.stopping:
                    await self.sleep_until(0.05, run.me.stop)

    # ------------------------------------------------------------------ groups

    def asked(self, step: int) -> bool:
        """Whether the ready call of ``step`` went out already."""
        return self._ready is not None and self._ready[0] == step

    def ask_ready(
        self, step: int, weight: int, ahead: Callable[[], int] | None = None
    ) -> asyncio.Task[ReadyReply | None]:
        """The ready call of ``step`` (made now, or the one already made): the only place one starts.
        ``ahead``: each call says how many samples it computed for the next step by then."""
        if self._ready is not None:
            if self._ready[0] == step:
                return self._ready[1]
            self._ready[1].cancel()
        task = asyncio.get_running_loop().create_task(self._ask(step, weight, ahead))
        self._ready = (step, task)
        return task

    def cancel_ready(self) -> None:
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
                    run.summary.ended = str(exc)
                    run.me.stop.set()
                    return None
                run.note(logging.WARNING, "could not ask the tracker for a group (%s); training on", exc)
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
            return Group("group", phases, reply.global_step)
        if reply.status == "open":
            # no reachable peer was ready: nothing was averaged; wait for a fresh view of the step
            self.reply = None
        return Group(reply.status, [], reply.global_step)
