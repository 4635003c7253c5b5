"""Catch-up: a volunteer that is new, or fell behind, fetches the run's newest state from several peers
while it keeps taking part in its group's rounds with weight 0; the averages it receives meanwhile are kept
(:class:`Replay`) and replayed once the fetched state is loaded, so it ends exactly where the others are.

One that missed only a few steps (asleep when they closed: a lid closed, SIGSTOP) holds the state
of the step it missed: with delay 0 it fetches the averages of the steps since from peers, each from two
that agree (:mod:`crowdtrain.volunteer.averaging.averages`), and replays them on its own state instead of
fetching the whole state; where peers no longer keep one of them, it fetches the state.

When the peers serving the run's state disagree (no state is listed) it loads nothing on a guess: it waits,
computing nothing and taking no place in rounds, says so once, and asks again every few seconds.

When no peer serves the run's state it resumes without one (:mod:`~crowdtrain.volunteer.resume`): from its
own kept state, the publisher's checkpoint, or the initial parameters while the run has taken no step;
failing all it waits and says why: a run that has taken steps never restarts from the initial parameters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Container
from pathlib import Path

import numpy as np

from crowdtrain.protocol.errors import DonorsDisagree, ProtocolError, StateSyncError, TrackerError
from crowdtrain.protocol.messages import DonorList, replace
from crowdtrain.volunteer.averaging.averages import KEEP_STEPS, fetch_average
from crowdtrain.volunteer.joined import JoinedRun
from crowdtrain.volunteer.link import TrackerLink
from crowdtrain.volunteer.resume import Landed, resume_alone
from crowdtrain.volunteer.rounds import Round, Rounds
from crowdtrain.volunteer.snapshotter import Snapshotter
from crowdtrain.volunteer.state.fetch import fetch_state
from crowdtrain.volunteer.state.snapshot import SnapshotHeader, read_snapshot_header

# A state holds the model's tensors and its optimizers' (AdamW: two per parameter; local steps: the outer
# anchor and momentum too): at most this many times the model's own bytes, plus the header's JSON
STATE_PER_MODEL_BYTE = 8
STATE_HEADER_BYTES = 64 << 20


def state_bound(model, ceiling: int) -> int:  # model: torch.nn.Module
    """The most bytes a state of ``model``'s run can take (never above ``ceiling``): a donor offering more
    is refused before anything is read, whatever its manifest says (a newcomer accepted 16 GiB
    whatever the model)."""
    own = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return min(ceiling, STATE_PER_MODEL_BYTE * own + STATE_HEADER_BYTES)


# An average two peers do not keep yet (its round is still under way there) is asked for again ABSENT_TRIES
# times, ABSENT_WAIT_S apart.
ABSENT_TRIES = 20
ABSENT_WAIT_S = 0.1
AVERAGES_WAIT_S = 15.0  # fetching the averages of missed steps takes at most this long (then: the state)
# A peer waiting for a newer state asks the tracker's donor list at least this often (seconds).
STATE_POLL_S = 5.0
WAIT_STATE_S = 2.0  # no peer serves the run's state: ask again this often
# Waiting for a state newer than the donors', with the run's step unmoved this long (or 3 steps' time, if
# longer): nobody steps, so none will come; the newest agreed state is taken without the averages after it.
STALL_S = 30.0


class OwnState:
    """What a catch-up fetched when it is to replay on this peer's own state (the averages are in the replay)."""


class Replay:
    """The averages a catching-up peer receives, kept in files until the fetched state is loaded: a fetch
    may take several steps, and each held in memory would cost a vector of the model's size."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._steps: dict[int, bool] = {}  # step -> whether averaged parameters came with it

    def __contains__(self, step: object) -> bool:
        return step in self._steps

    @property
    def first(self) -> int | None:
        """The earliest step held (None when empty)."""
        return min(self._steps, default=None)

    def _path(self, step: int, what: str) -> Path:
        return self.folder / f"replay-{step}-{what}.f32"

    def put(self, step: int, mean: np.ndarray, params: np.ndarray | None) -> None:
        """Blocking (writes files): call it in a thread."""
        mean.tofile(self._path(step, "grad"))
        if params is not None:
            params.tofile(self._path(step, "params"))
        self._steps[step] = params is not None

    def take(self, step: int, into: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The average (read into ``into`` when given: no vector of the model's size is allocated for it)
        and the parameters kept for ``step``. Blocking (reads files): call it in a thread."""
        has_params = self._steps.pop(step)
        mean = self._read(self._path(step, "grad"), into)
        params = self._read(self._path(step, "params"), None) if has_params else None
        return mean, params

    @staticmethod
    def _read(path: Path, into: np.ndarray | None) -> np.ndarray:
        with open(path, "rb") as f:
            if into is None:
                values = np.fromfile(f, dtype=np.float32)
            elif f.readinto(into.data.cast("B")) == into.nbytes and not f.read(1):
                values = into
            else:
                raise StateSyncError(f"replay file {path.name} does not hold {into.size} values")
        path.unlink()
        return values

    def clear(self) -> None:
        for step, has_params in self._steps.items():
            self._path(step, "grad").unlink(missing_ok=True)
            if has_params:
                self._path(step, "params").unlink(missing_ok=True)
        self._steps.clear()


def steps_to_fetch(applied: int, step: int, kept: Container[int]) -> list[int]:
    """The steps from ``applied`` (the first this peer's own state lacks) to ``step`` (the run's) whose
    averages are not ``kept``: every gap, not only those before the first kept one (a peer catching up
    misses a round now and then; replaying across such a gap would restart the catch-up forever)."""
    return [s for s in range(applied, step) if s not in kept]


class CatchUp:
    """Fetching the run's state and replaying the steps that passed meanwhile. It never moves the peer's
    position: :meth:`switch` says where the peer landed (:class:`Landed`) and the training loop moves there."""

    def __init__(self, run: JoinedRun, rounds: Rounds, snaps: Snapshotter, link: TrackerLink) -> None:
        self.run = run
        self.rounds = rounds
        self.snaps = snaps
        self.link = link
        self.replay = Replay(run.state_dir)
        self._pending: asyncio.Task[Path | OwnState | None] | None = None  # the fetch under way
        self.waiting: str | None = None  # why it waits for the run's state (no peer serves it), said once
        self._older_than = 0  # a state below this step arrived of no use: wait for a newer one
        # the run stalled while this peer waited for a newer state (see _newest_donors): load the newest
        # agreed state although the averages after it are lost
        self._stalled = False

    @property
    def active(self) -> bool:
        """Catching up: its parameters are not the run's, and nothing it computes counts."""
        return self._pending is not None

    @property
    def fetched(self) -> bool:
        return self._pending is not None and self._pending.done()

    def start(self, after_s: float = 0.0) -> None:
        old = self._pending
        if old is not None and old.done() and not old.cancelled() and (exc := old.exception()) is not None:
            # (a fetch that failed before this peer switched: replaced, its error said)
            self.run.note(logging.INFO, "the state fetch failed (%s); fetching again", exc)
        if self._pending is None or self._pending.done():
            self.run.phase("waiting-for-state" if self.waiting is not None else "catching-up")
            # averages are kept for the replay from the round of this step on (or from the earliest kept)
            first = self.replay.first
            replay_from = self.run.pos.step if first is None else first
            self._pending = asyncio.get_running_loop().create_task(self._fetch(replay_from, after_s))

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()

    def round_failed(self) -> None:
        """A round failed as a whole: the parameters may differ from the run's; fetch the state."""
        self.replay.clear()
        if self.run.config.catch_up:
            self.start()

    async def keep(self, rnd: Round) -> None:
        """Keep a round that ended while catching up: its average for the replay (delay 0: the parameters are
        averaged after the step, here; a catching-up peer only receives); a failed one starts the fetch anew."""
        if rnd.mean is None:
            self.run.note(
                logging.WARNING,
                "averaging round of step %d failed (%s); this peer will fetch the state",
                rnd.step,
                rnd.error,
            )
            self.round_failed()
            return
        params = rnd.params
        if params is None:  # (delay 0: averaged after the step)
            params = await self.run.cadence.params_after_step(
                rnd.average_params, lambda: self.rounds.average_params(rnd.phases)
            )
        await asyncio.to_thread(self.replay.put, rnd.step, rnd.mean, params)

    # ------------------------------------------------------------------ fetching

    async def _newest_donors(self, replay_from: int) -> DonorList:
        """:func:`newest_donors` for this peer (and whether the run stalled meanwhile)."""
        donors, self._stalled = await newest_donors(
            self.run, max(replay_from, self._older_than), lambda: self.snaps.step_s
        )
        return donors

    async def _fetch_averages(self) -> bool:
        """:meth:`_fetch_missed`, within AVERAGES_WAIT_S (then the state is fetched)."""
        try:
            async with asyncio.timeout(AVERAGES_WAIT_S):
                return await self._fetch_missed()
        except TimeoutError:
            return self._no_averages(f"they did not come within {AVERAGES_WAIT_S:.0f} s")

    async def _fetch_missed(self) -> bool:
        """Delay 0, a peer that took steps: put the averages of the steps from its own state's on that it did
        not keep (as a member with weight 0) into the replay, each from two peers that agree, while peers still
        keep them. False when it cannot (it then fetches the state)."""
        run, replay = self.run, self.replay
        if not run.cadence.replays_own_state or not run.summary.steps_done:
            return False
        size, spec = run.trainer.numel, run.spec.averaging
        for _ in range(2 * KEEP_STEPS):  # (the run moves on meanwhile; each pass fetches what it passed)
            missing = steps_to_fetch(run.pos.applied, run.pos.step, replay)
            if not missing:
                return True
            if missing[0] < run.pos.step - KEEP_STEPS:
                return self._no_averages(
                    f"the average of step {missing[0]} is older than the last {KEEP_STEPS} steps peers keep"
                )
            listed = await run.tracker.donors(run.config.run_id)
            donors = [d for d in [*listed.donors, *listed.peers] if d.peer_id != run.peer_id]
            for s in missing:
                grad = await fetch_average(donors, s, "grad", size, run.key, run.credential)
                for _ in range(ABSENT_TRIES):  # (the round of a step that just formed may be under way there)
                    if not isinstance(grad, str):  # (an average, or None: no two agree; a str is ABSENT)
                        break
                    await asyncio.sleep(ABSENT_WAIT_S)
                    grad = await fetch_average(donors, s, "grad", size, run.key, run.credential)
                if not isinstance(grad, np.ndarray):
                    return self._no_averages(
                        f"no two of {len(donors)} peers sent the same average of step {s}"
                    )
                params: np.ndarray | None = None
                if spec.averages_params(s):
                    # (ABSENT: the step's parameter average was partial, and its members kept their own)
                    got = await fetch_average(donors, s, "params", size, run.key, run.credential)
                    if got is None:
                        return self._no_averages(
                            f"no two of {len(donors)} peers sent the same parameters of step {s}"
                        )
                    params = got if isinstance(got, np.ndarray) else None
                await asyncio.to_thread(replay.put, s, grad, params)
        return self._no_averages("the run kept moving on while they were fetched")

    def _no_averages(self, why: str) -> bool:
        self.run.note(logging.INFO, "fetching the state, not the averages of the steps missed: %s", why)
        return False

    async def _fetch(self, replay_from: int, after_s: float) -> Path | OwnState | None:
        if after_s:
            await asyncio.sleep(after_s)
        if await self._fetch_averages():
            return OwnState()
        donors = await self._newest_donors(replay_from)
        if donors.state is not None and self.waiting is not None:
            # The wait is over (the donors agree again, or one serves the state now): the peer takes part in
            # the rounds again, with weight 0, while it fetches. Kept out of them, its step would stand still
            # and it would keep no average: with delay 1 every state it fetched would lack the average of its
            # own step, and it would fetch a newer one for ever.
            self.waiting = None
        if donors.state is None and donors.serving >= 2:
            raise DonorsDisagree(donors.reason or "the peers serving state agree on none yet")
        if donors.state is None and donors.serving:
            raise StateSyncError(donors.reason or "the one peer serving state serves none of the run's steps")
        if donors.state is None or not donors.donors:
            return None
        if donors.serving >= 2 and len({d.peer_id for d in donors.donors}) < 2 and not self._stalled:
            # never load a state only one peer vouches for when two could (stalled: this peer is the other)
            raise StateSyncError(
                f"the tracker lists one donor of state step {donors.state.step} while {donors.serving} peers "
                "serve state"
            )
        run = self.run
        incoming = run.state_dir / "incoming.safetensors"
        try:
            fetched = await fetch_state(
                donors=donors.donors,
                version=donors.state,
                run_id=run.config.run_id,
                key=run.key,
                credential=run.credential,
                config=dataclasses.replace(
                    run.config.state,
                    max_state_bytes=state_bound(run.trainer.model, run.config.state.max_state_bytes),
                ),
                emit=run.emit,
                into=incoming,  # written as it is verified: never held in memory whole
            )
        except BaseException:
            incoming.unlink(missing_ok=True)
            raise
        # read when the peer switches to it, straight into the model (a copy of the state read now would be
        # held beside the model meanwhile)
        return incoming if isinstance(fetched, Path) else None

    # ------------------------------------------------------------------ switching to the fetched state

    async def switch(self) -> Landed | None:
        """Load the fetched state, then replay the averaged steps received meanwhile (between two steps;
        with delay 1, once no round is under way: :meth:`Rounds.settle`), so this peer holds what the others
        hold. Returns where it landed, or None (still catching up, or waiting)."""
        run, task = self.run, self._pending
        if task is None:  # (called once a fetch is done: there is one)
            return None
        if self.rounds.under_way:  # (delay 1)
            rnd = await self.rounds.take_round()
            if rnd is not None:
                await self.keep(rnd)  # kept for the replay: still catching up
            if self._pending is not task:
                # that round failed: the replay was cleared and a new fetch is under way; this one is stale
                stale = None if task.cancelled() or task.exception() else task.result()
                if isinstance(stale, Path):
                    stale.unlink(missing_ok=True)
                return None
        self._pending = None
        fetched: Path | OwnState | None = None
        try:
            fetched = task.result()
            if isinstance(fetched, OwnState):
                return await self._replay_own()
            header = None if fetched is None else await asyncio.to_thread(read_snapshot_header, fetched)
        except DonorsDisagree as exc:
            self.replay.clear()
            self._disagree(str(exc))
            return None
        except (StateSyncError, TrackerError, ProtocolError) as exc:
            if isinstance(fetched, Path):
                fetched.unlink(missing_ok=True)
            self.replay.clear()
            # Its parameters are not the run's: keep taking part with weight 0 and try again.
            run.note(logging.WARNING, "state catch-up failed (%s); trying again", exc)
            await asyncio.sleep(1.0)
            self.start()
            return None
        if fetched is None or header is None:
            self.replay.clear()
            return await self._no_donor()
        return await self._load(fetched, header)

    def _disagree(self, reason: str) -> None:
        """The peers serving the run's state disagree, so the tracker lists none (honest volunteers hold the
        same bytes: a faulty or modified client). Nothing is loaded on a guess: the peer waits, computing
        nothing and taking no place in rounds (its weight would be 0: no one needs it there), says so once,
        and asks again every STATE_POLL_S."""
        run = self.run
        if self.waiting is None:
            self.waiting = (
                f"the peers serving run {run.config.run_id}'s state disagree on it ({reason}): waiting, "
                "computing nothing, until they agree; the run's status says so too"
            )
            run.note(logging.WARNING, "%s", self.waiting)
        self.start(after_s=STATE_POLL_S)

    async def _load(self, fetched: Path, header: SnapshotHeader) -> Landed | None:
        run, replay = self.run, self.replay
        # The parameters should hold the averages of the steps below ``target``; with delay 1 the average
        # of step ``target`` is applied when the current step closes, as every peer does.
        cadence = run.cadence
        target = max(0, run.pos.step - cadence.lag)
        pending_step = cadence.pending(run.pos.step)
        needed = cadence.averages_needed(header.step, run.pos.step)
        missing = [s for s in needed if s not in replay]
        stalled, self._stalled = self._stalled, False
        if missing and stalled:
            # every peer that waits takes this same state and skips every average after it, kept or not: they
            # then hold the same bytes whatever each kept (those steps' progress is lost)
            missing = list(needed)
            run.note(
                logging.WARNING,
                "the run has not stepped for %.0f s and no peer holds a state newer than step %d: resuming from "
                "it at step %d without the averages of steps %d-%d (their progress is lost)",
                STALL_S,
                header.step,
                target,
                missing[0],
                missing[-1],
            )
        elif missing:
            await asyncio.to_thread(fetched.unlink, True)
            replay.clear()
            run.note(
                logging.INFO,
                "state of step %d arrived but the averages of steps %s are not kept here; fetching a newer one",
                header.step,
                missing,
            )
            self._older_than = header.step + 1
            self.start()
            return None
        try:
            loaded = await self.snaps.load(fetched)
        finally:
            fetched.unlink(missing_ok=True)  # noqa: ASYNC240 (one file; must go even when cancelled)
        self._drop()  # (each step replayed would zero it anyway)
        await self._replay_steps(loaded.step, target, skip=set(missing))
        if loaded.step > target:  # a state newer than this peer's step: move to the step it belongs to
            # (delay 0 only: with delay 1 such a state lacks an average this peer holds no copy of)
            landed = Landed(loaded.step, loaded.step, caught_up=True)
        else:
            landed = Landed(run.pos.step, target, caught_up=True)
            if pending_step is not None and pending_step >= loaded.step and pending_step not in missing:
                grad, params = await asyncio.to_thread(replay.take, pending_step)
                self.rounds.hold(Round.replayed(pending_step, grad, params))  # applied when this step closes
        return self._caught_up(
            landed,
            "loaded the state of step %d and replayed %d steps",
            loaded.step,
            max(0, target - loaded.step),
        )

    def _drop(self) -> None:
        """Drop the accumulated gradient and the ready call that would report it: computed on parameters that
        are not the run's."""
        self.link.cancel_ready()
        self.rounds.drop()

    async def _replay_own(self) -> Landed | None:
        """Replay the fetched and kept averages on this peer's own state (delay 0): it ends where the
        others are; if the run passed a step that is not in the replay, fetch again."""
        run, replay = self.run, self.replay
        first, target = run.pos.applied, run.pos.step
        missing = steps_to_fetch(first, target, replay)
        if missing:
            run.note(
                logging.INFO, "steps %s passed while their averages were fetched; fetching those too", missing
            )
            self.start()
            return None
        self._drop()
        await self._replay_steps(first, target)
        return self._caught_up(
            Landed(target, target, caught_up=True),
            "rejoined at step %d: replayed the averages of %d steps, fetched from peers, on its own state",
            target,
            target - first,
        )

    def _caught_up(self, landed: Landed, message: str, *args: object) -> Landed:
        """The end of a catch-up: the replay is spent, the peer trains again from ``landed``."""
        self.replay.clear()
        self.waiting, self._older_than = None, 0
        self.run.note(logging.INFO, message, *args)
        return landed

    async def _replay_steps(self, first: int, end: int, skip: Container[int] = ()) -> None:
        """Apply the kept averages of steps ``first`` … ``end - 1`` to the loaded state (but those in ``skip``,
        which no peer applied)."""
        run, replay = self.run, self.replay
        trainer = run.trainer
        for s in range(first, end):
            if s in skip:
                continue
            # read into the trainer's own gradient buffer (on a CPU): the replay holds no vector of its own
            grad, params = await asyncio.to_thread(replay.take, s, trainer.mean_buffer())
            await asyncio.to_thread(
                run.cadence.apply, grad, s, params, trainer.apply, trainer.set_flat_params
            )

    # ------------------------------------------------------------------ no peer serves the state

    async def _no_donor(self) -> Landed | None:
        """No peer serves the run's state: resume without one (:func:`resume_alone`), or wait for one,
        computing nothing, saying why once, asking again every WAIT_STATE_S."""
        got = await resume_alone(self.run, self.snaps)
        if isinstance(got, Landed):
            if got.caught_up:  # (its own kept state loaded)
                self._drop()
            self.waiting = None
            return got
        if self.waiting is None:
            self.waiting = got
            self.run.note(logging.WARNING, "%s", got)
        self.start(after_s=WAIT_STATE_S)
        return None


async def newest_donors(
    run: JoinedRun, replay_from: int, step_s: Callable[[], float]
) -> tuple[DonorList, bool]:
    """The tracker's donor list, once it lists a state a peer can replay from (of step ≥ ``replay_from``). An
    older one would be fetched for nothing: the averages between its step and ``replay_from`` passed before the
    peer kept them. Donors write snapshots every few steps (the larger the state, the fewer), so a newcomer
    usually waits for the next one. True beside it when the run stalled instead (its step unmoved STALL_S, or
    3 steps' time): nobody steps, so no newer state will come; the newest agreed state is then listed."""
    said = False
    seen, since = run.pos.step, time.monotonic()
    while True:
        # (not counting its own snapshots: they are not the run's state, as it fell behind)
        donors = await run.tracker.donors(run.config.run_id, without=run.peer_id)
        if donors.state is None or donors.state.step >= replay_from:
            return donors, False
        if run.pos.step != seen:
            seen, since = run.pos.step, time.monotonic()
        elif time.monotonic() - since >= max(STALL_S, 3 * (step_s() or 0.0)):
            # Every peer lost the same round (say, a member left in its later phase) and waits, like this
            # one, for a state only a stepping peer would make. The newest agreed state is everyone's way on:
            # each that waits takes it (its own snapshots counted now: all must pick the same one) and skips
            # the same averages.
            everyone = await run.tracker.donors(run.config.run_id)
            others = [d for d in everyone.donors if d.peer_id != run.peer_id]
            return (replace(everyone, donors=others) if others else everyone), True
        if not said:
            run.note(
                logging.INFO,
                "the newest state served is of step %d; waiting for one of step %d or later to fetch",
                donors.state.step,
                replay_from,
            )
            said = True
        wait = step_s()
        await asyncio.sleep(min(STATE_POLL_S, max(0.2, wait / 2)) if wait else 1.0)
