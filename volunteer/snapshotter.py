"""State snapshots, written beside training: after an optimizer step a snapshot is written in the background,
straight from the tensors to a file (:func:`~crowdtrain.volunteer.state.snapshot.save_snapshot`), served
once complete and declared to the tracker; the previous one is served meanwhile. Training never waits for
it, except that the next optimizer step waits for a write still in progress (it reads the live tensors).

Snapshots are written every K steps (a power of two, see SNAPSHOT_SPACING), so that writing them takes at most
a fifth of the wall time and peers' snapshots fall on the same steps. On leaving, the state this peer holds is
kept in its data folder (:meth:`Snapshotter.keep`), so the run's state outlives its volunteers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from crowdtrain.protocol.errors import ProtocolError, TrackerError
from crowdtrain.protocol.messages import StateDeclare
from crowdtrain.volunteer.joined import JoinedRun
from crowdtrain.volunteer.state.snapshot import (
    LoadedState,
    SnapshotHeader,
    load_snapshot,
    read_snapshot_header,
    save_snapshot,
)

# Writing snapshots takes at most 1/SNAPSHOT_SPACING of the time: every K steps, K the smallest power of
# two (times ``snapshot_every``) with K × step time ≥ SNAPSHOT_SPACING × write time. Powers of two keep the
# peers' snapshots on the same steps (those of a slower writer are a subset), so a newcomer finds several
# donors of one version.
SNAPSHOT_SPACING = 4.0


class Snapshotter:
    """Writes, serves and declares this peer's snapshots; loads a fetched or kept one; keeps one on leaving."""

    def __init__(self, run: JoinedRun) -> None:
        self.run = run
        self._task: asyncio.Task | None = None
        self._writing: asyncio.Future | None = None  # the write itself (it reads live tensors)
        self._every = run.config.snapshot_every  # K (see SNAPSHOT_SPACING), adapted after each write
        self._last_applied_at: float | None = None
        self.step_s = 0.0  # smoothed time between two applied steps
        self._stepping = False  # an optimizer step is being applied (a thread changes the tensors)
        # the state this peer held when it last left the run: outlives the run's volunteers (see keep)
        self.kept = run.config.data_dir / "crowdtrain-kept" / f"{run.config.run_id}.safetensors"

    def applied(self) -> None:
        """A step was just applied: start writing its snapshot when one is due (every K steps; one at a
        time). The previous snapshot is served until the new one is complete."""
        now = time.monotonic()
        if self._last_applied_at is not None:
            took = now - self._last_applied_at
            self.step_s = took if not self.step_s else 0.8 * self.step_s + 0.2 * took
        self._last_applied_at = now
        if self.run.pos.applied % self._every:
            return
        self.serve_now()

    def serve_now(self) -> None:
        """Write, serve and declare a snapshot of the state now held (unless one is being written)."""
        run = self.run
        if run.config.client_mode or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(
            self._snapshot(run.pos.applied, run.trainer.live_state())
        )

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def written(self) -> None:
        """Wait until a snapshot write in progress has read the tensors (before they change)."""
        if self._writing is not None:
            await asyncio.wait({self._writing})

    @contextlib.asynccontextmanager
    async def stepping(self) -> AsyncIterator[None]:
        """Around a change of the tensors: after any write in progress read them; no state kept meanwhile.
        Interrupted inside, it stays set: the thread changing the tensors may still run, so none is kept."""
        await self.written()
        self._stepping = True
        yield
        self._stepping = False

    def _write(self, path: Path, step: int, model_state: dict):
        """Write this peer's state (``model_state`` and the optimizer's) as the snapshot of ``step`` to
        ``path`` (blocking: call it in a thread)."""
        run = self.run
        return save_snapshot(
            path,
            run_id=run.spec.run_id,
            step=step,
            recipe=run.spec.model.recipe,
            args=dict(run.spec.model.args),
            model_state=model_state,
            optimizer_state=run.trainer.optimizer.state_dict(),
            scheduler_state=None,
            range_bytes=run.config.state.range_bytes,
        )

    async def load(self, path: Path) -> LoadedState:
        """Load a snapshot file into the model and optimizer: the model's tensors are read in place, the
        optimizer's into fresh ones it keeps (no copy)."""
        trainer = self.run.trainer
        async with self.stepping():
            loaded = await asyncio.to_thread(load_snapshot, path, into=trainer.model.state_dict())
            await asyncio.to_thread(
                trainer.load_state, loaded.model_state, loaded.optimizer_state, owned=True, step=loaded.step
            )
        return loaded

    async def _snapshot(self, step: int, model_state: dict) -> None:
        """Write, serve and declare the snapshot of ``step``; ``model_state`` is ``Trainer.live_state``,
        taken right after the step was applied (live parameters: no copy; the buffers copied)."""
        run = self.run
        started = time.monotonic()
        path = run.state_dir / f"state-{step}.safetensors"
        write = asyncio.ensure_future(asyncio.to_thread(self._write, path, step, model_state))
        self._writing = write
        try:
            snapshot = await asyncio.shield(write)
        except OSError as exc:
            run.note(logging.WARNING, "could not write the state snapshot of step %d (%s)", step, exc)
            return
        finally:
            self._writing = None
            k, cost = run.config.snapshot_every, time.monotonic() - started
            while self.step_s > 0 and k * self.step_s < SNAPSHOT_SPACING * cost and k < 1 << 20:
                k *= 2
            self._every = k
        run.state_server.publish(snapshot)
        try:
            # the older snapshots still served are declared too: a peer a little behind in writing the same
            # step's snapshot still backs one version with this one (see the tracker's donor rule)
            older = [v for v in run.state_server.versions if v != snapshot.version]
            await run.tracker.declare_state(
                run.config.run_id,
                StateDeclare(peer_id=run.peer_id, state=snapshot.version, older=older),
                run.key,
                run.credential,
            )
        except TrackerError as exc:
            run.note_tracker_failure("could not declare state version %d to the tracker (%s)", exc, step, exc)

    # ------------------------------------------------------------------ the state kept between joins

    def kept_header(self) -> SnapshotHeader | None:
        """The header of the state this peer kept when it last left this run, if it is one of this run's
        recipe and arguments (else it is set aside: not this run's state)."""
        run = self.run
        if not self.kept.is_file():
            return None
        try:
            header = read_snapshot_header(self.kept)
        except (ProtocolError, OSError, ValueError) as exc:
            run.note(logging.WARNING, "the kept state %s cannot be read (%s); not using it", self.kept, exc)
            return None
        model = (run.spec.model.recipe, dict(run.spec.model.args))
        if header.run_id != run.spec.run_id or (header.recipe, header.args) != model:
            run.note(logging.WARNING, "the kept state %s is not of this run's model; not using it", self.kept)
            return None
        return header

    async def keep(self) -> None:
        """On leaving: keep the state this peer holds (the run's, at the step it applied last) in its data
        folder, so the run's state outlives its volunteers. A later join of this run resumes from it when no
        peer serves the run's state. The caller knows it holds the run's state; not mid-step (a thread is
        changing the tensors) nor before the run's first step."""
        run = self.run
        await self.written()  # a thread: let it finish its file
        applied = run.pos.applied
        if self._stepping or applied == 0:
            return
        try:
            self.kept.parent.mkdir(parents=True, exist_ok=True)
            # (the state of the step applied last: in local-steps mode not the parameters the round moved)
            kept = await asyncio.to_thread(self._write, self.kept, applied, run.trainer.live_state())
        except OSError as exc:
            run.note(logging.WARNING, "could not keep the state of step %d (%s)", applied, exc)
            return
        run.me.kept_state(
            kept.version
        )  # told with the leave: the tracker vouches for it, so it serves it again
        run.note(
            logging.INFO,
            "kept the run's state of step %d in %s: joining again resumes from it if no peer serves a newer one",
            applied,
            self.kept,
        )
