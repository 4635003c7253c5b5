"""Resuming when no peer serves the run's state, and where a switch to a state leaves a peer.

A peer that took steps of this run keeps its parameters. Otherwise the state is this peer's own kept state of
the run's step (:meth:`Snapshotter.keep`), else the publisher's checkpoint (``--init-from``, the step gap
told), else the initial parameters while the run has taken no step. Failing all, the peer waits, computing
nothing, and says why: a run that has taken steps never restarts from the initial parameters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from crowdtrain.volunteer.joined import JoinedRun
from crowdtrain.volunteer.snapshotter import Snapshotter
from crowdtrain.volunteer.state.snapshot import SnapshotHeader


@dataclass(frozen=True, slots=True)
class Landed:
    """Where a switch to a state left this peer (the training loop moves there): at ``step``, its parameters
    holding the averages of the steps below ``applied``; ``caught_up``: they are the run's state now (loaded,
    or its own kept one), not only its own parameters kept."""

    step: int
    applied: int
    caught_up: bool


async def resume_alone(run: JoinedRun, snaps: Snapshotter) -> Landed | str:
    """No peer serves the run's state: where this peer resumes from, or why it must wait (a sentence)."""
    target = max(0, run.pos.step - run.cadence.lag)
    kept = snaps.kept_header()  # (its JSON header only: small)
    if run.summary.steps_done:
        run.note(logging.WARNING, "no peer serves the run's state; keeping this volunteer's parameters")
    elif kept is not None and target <= kept.step <= run.pos.step:
        return await _load_kept(run, snaps, kept.step)
    elif run.init_step is not None:
        _resume_checkpoint(run, snaps, target, run.init_step)
    elif target == 0:
        run.note(logging.INFO, "the run has taken no step yet; training from the initial parameters")
    else:
        return _why_wait(run, target, kept)
    return Landed(run.pos.step, target, caught_up=False)


def _resume_checkpoint(run: JoinedRun, snaps: Snapshotter, target: int, init_step: int) -> None:
    gap = target - init_step
    run.note(
        logging.WARNING if gap else logging.INFO,
        "no peer serves the run's state; resuming from the checkpoint %s of step %d%s",
        run.config.init_from,
        init_step,
        f": the run is at step {target}, so the {gap} steps since are lost (and the optimizer's moments "
        "start afresh)"
        if gap > 0
        else f", beyond the run's step {target}: its weights are taken as the run's state"
        if gap < 0
        else "",
    )
    snaps.serve_now()


def _why_wait(run: JoinedRun, target: int, kept: SnapshotHeader | None) -> str:
    behind = (
        f"; this volunteer's own kept state is of step {kept.step}, {target - kept.step} steps behind"
        if kept is not None and kept.step < target
        else ""
    )
    run_id = run.config.run_id
    return (
        f"run {run_id} is at step {target} but no peer serves its state{behind}: waiting, "
        "computing nothing, until a volunteer that kept it returns or the publisher restores a "
        f"checkpoint (crowdtrain join {run_id} --init-from FILE)"
    )


async def _load_kept(run: JoinedRun, snaps: Snapshotter, step: int) -> Landed:
    """Resume from this peer's own kept state (of the run's step): load it and serve it to others (the caller
    drops what it accumulated on its parameters before)."""
    await snaps.load(snaps.kept)
    run.note(
        logging.INFO,
        "no peer serves the run's state; resumed from this volunteer's own state of step %d (kept in %s)",
        step,
        snaps.kept,
    )
    snaps.serve_now()
    return Landed(run.pos.step, step, caught_up=True)
