"""Hostile volunteers for issue 48: a modified client as one volunteer of four, behind explicit fault seams.

Each role is an ordinary :class:`Volunteer` whose parts are swapped once it has joined (nothing in the CLI
reaches them): its part owner answers with a forged mean (and, for the cleverer roles, a forged receipt), or
its copies pull against the others. :func:`hostile_run` runs three honest volunteers and one role in a real
run (real tracker, seeder, peer servers, HTTP) and measures what the honest ones end with; tests/test_hostile.py
asserts on it and bench/hostile.py prints it beside a clean run.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from crowdtrain.protocol import receipts
from crowdtrain.protocol.messages import AveragingSpec
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.averaging import AveragingConfig
from crowdtrain.volunteer.averaging.reducer import PartReducer
from crowdtrain.volunteer.averaging.wire import Coder
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from tests.harness import Recorder, published_run

ROLES = ("clean", "owner x-10", "owner crafted", "backbone owner x-10", "member x-4.9")
MODES = {  # mode -> (averaging, steps)
    "every-step": ({}, 40),
    "local-steps": ({"inner_steps": 10, "inner_batch_size": 8}, 20),
}


class ScalingCoder(Coder):
    """Encodes every answer multiplied by ``factor``: its receipt then witnesses the forged answer."""

    def __init__(self, config: AveragingConfig, factor: float) -> None:
        super().__init__(config)
        self.factor = factor

    def encode_raw(self, values, residual=None, *, stored=False):
        return super().encode_raw(values * np.float32(self.factor), residual, stored=stored)


class OwnLineForger(PartReducer):
    """Makes ``‖a‖² = Σ g`` hold by its own line whatever the answer (its term then exceeds its bound)."""

    __slots__ = ()

    def receipt(self, members, shared):
        r = super().receipt(members, shared)
        me = members.index(self.owner)
        rest = math.fsum(ln.g for i, ln in enumerate(r.lines) if ln.counted and i != me)
        lines = list(r.lines)
        lines[me] = receipts.Line(lines[me].weight, lines[me].norm, r.answer_norm2 - rest, me)
        return receipts.Receipt(r.part, r.shared, r.answer_norm2, r.answer_digest, tuple(lines))


class LineForger(PartReducer):
    """Rewrites every term so that the receipt holds by itself (each within its bound, ``Σ g = ‖a‖²``): only
    each member's own line shows the lie, which proves nothing to a third party."""

    __slots__ = ()

    def receipt(self, members, shared):
        r = super().receipt(members, shared)
        bounds = [ln.norm * ln.weight if ln.counted else 0.0 for ln in r.lines]
        total = math.fsum(bounds)
        lines = tuple(
            receipts.Line(ln.weight, ln.norm, r.answer_norm2 * b / total, ln.copy) if ln.counted else ln
            for ln, b in zip(r.lines, bounds, strict=True)
        )
        return receipts.Receipt(r.part, r.shared, r.answer_norm2, r.answer_digest, lines)


def forge_answers(averager: Any, factor: float, forger: type[PartReducer] | None = None) -> None:
    """The seam of a hostile part owner: its answers × ``factor``, its receipts rewritten by ``forger``."""
    owner = averager.owner
    owner._coder = ScalingCoder(owner.config, factor)
    if forger is None:
        return
    prepare = owner.prepare

    def forging_prepare(rnd, vector, weight):
        prepare(rnd, vector, weight)
        if rnd.reducer is not None:
            rnd.reducer.__class__ = forger  # (same slots: only its receipt differs)

    owner.prepare = forging_prepare


def pull(averager: Any, factor: float) -> None:
    """The seam of a hostile member: the copy of the step's gradient (pseudo-gradient) it sends × ``factor``
    (it applies the group's answer like everyone)."""
    allreduce = averager.allreduce

    async def pulling(assignment, vector, weight, *, tag="grad", **kw):
        if tag == "grad" and assignment.phase == 0 and weight > 0:
            vector = vector * np.float32(factor)
            kw.pop("out", None)  # (its own vector is left as it was: the answer lands in a new buffer)
        return await allreduce(assignment, vector, weight, tag=tag, **kw)

    averager.allreduce = pulling


class HostileVolunteer(Volunteer):
    """A volunteer that takes ``role`` once it has joined."""

    def __init__(self, config: VolunteerConfig, role: str) -> None:
        self.role = role
        self.events: list[ev.Event] = []
        super().__init__(config, emit=self._event)

    def _event(self, event: ev.Event) -> None:
        self.events.append(event)
        if isinstance(event, ev.Joined):
            assert self._run is not None
            averager = self._run.averager
            if self.role in ("owner x-10", "backbone owner x-10"):
                forge_answers(averager, -10.0)
            elif self.role == "owner crafted":
                forge_answers(averager, -1.0, LineForger)
            elif self.role == "member x-4.9":
                pull(averager, -4.9)


async def hostile_run(
    tmp_path: Path,
    role: str,
    mode: str,
    *,
    seed: int = 0,
    steps: int | None = None,
    **averaging_overrides: Any,
) -> dict:
    """Three honest volunteers and ``role`` (or a fourth honest one: ``clean``) in ``mode``; what came of it."""
    averaging, default_steps = MODES[mode]
    steps = steps or default_steps
    async with published_run(
        tmp_path,
        # (the product's defaults: int8, and the clip the harness turns off for its replays)
        averaging={
            "codec": "int8",
            "group_size": 4,
            "gather_s": 2.0,
            "clip_multiple": AveragingSpec().clip_multiple,
            **averaging,
            **averaging_overrides,
        },
        target_batch_size=32,
        optimizer={"name": "adamw", "lr": 3e-3},
    ) as run:
        honest_events: list[list[ev.Event]] = [[] for _ in range(3)]
        recs = [Recorder() for _ in range(3)]

        def config(name: str, s: int, **kw: Any) -> VolunteerConfig:
            return VolunteerConfig(
                run_id=run.spec.run_id,
                tracker_url=run.tracker.url,
                data_dir=tmp_path / name,
                seed=s,
                max_steps=steps,
                **kw,
            )

        honest = [
            Volunteer(config(f"honest-{i}", seed * 10 + i), emit=honest_events[i].append, record=recs[i])
            for i in range(3)
        ]
        fourth = HostileVolunteer(
            config("fourth", seed * 10 + 3, backbone=role.startswith("backbone")),
            "clean" if role == "clean" else role,
        )
        t0 = time.perf_counter()
        runs = [asyncio.ensure_future(v.run()) for v in honest]
        # The fourth starts once the honest three train: a round whose only weighted copy is a stranger's
        # has no other copy to clip it against (docs/security.md, "What it does not stop"), and which of
        # four volunteers started together computes the first round alone is chance.
        await _training(honest_events, runs)
        runs.append(asyncio.ensure_future(fourth.run()))
        results = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 900)
        wall_s = time.perf_counter() - t0
        status = await _status(run)
    for r in results[:3]:
        if isinstance(r, BaseException):
            raise r
    losses = []
    byte_counts = []
    for events in honest_events:
        done = [e for e in events if isinstance(e, ev.StepDone) and e.loss is not None]
        losses.append(statistics.fmean(e.loss for e in done[-5:]) if done else math.nan)
        rounds = [e for e in events if isinstance(e, ev.RoundDone)]
        byte_counts.append(sum(e.bytes_sent + e.bytes_received for e in rounds) / max(1, len(done)))
    refused = [e for events in honest_events for e in events if isinstance(e, ev.AnswerRefused)]
    pulling = [e for events in honest_events for e in events if isinstance(e, ev.MemberPulling)]
    last_params = [max(r.params) if r.params else None for r in recs]
    same = all(
        last_params[0] is not None and k == last_params[0] and np.array_equal(r.params[k], recs[0].params[k])
        for r, k in zip(recs, last_params, strict=True)
    )
    barred = {c.public_key for c in status.credits if c.barred or c.rejected >= 2}
    fourth_result = results[3]
    return {
        "role": role,
        "mode": mode,
        "seed": seed,
        "honest_loss": statistics.fmean(losses),
        "honest_steps": [s.steps_done for s in results[:3]],
        "bytes_per_step": statistics.fmean(byte_counts),
        "wall_s": wall_s,
        "refused_answers": len(refused),
        "refused_proven": sum(e.proven for e in refused),
        "hostile_barred": _key(fourth) in barred,
        "pulls_reported": len(pulling),
        "pulls_of_honest": sorted({e.member for e in pulling if e.member != fourth.peer_id}),
        "hostile_end": repr(fourth_result)[:200],
        "honest_identical": same,
        "accused_honest": [
            c.public_key[:12] for c in status.credits if c.rejected and c.public_key != _key(fourth)
        ],
    }


async def _training(events: list[list[ev.Event]], runs: list[asyncio.Future], limit_s: float = 120.0) -> None:
    """Until every one of ``events`` holds a phase change to training (or a volunteer's run ended)."""
    deadline = time.monotonic() + limit_s
    while not all(any(isinstance(e, ev.PhaseChanged) and e.phase == "training" for e in es) for es in events):
        if any(r.done() for r in runs) or time.monotonic() > deadline:
            return  # (what went wrong shows in the results)
        await asyncio.sleep(0.05)


def _key(v: Volunteer) -> str:
    return v._me.key.public_hex


async def _status(run: Any) -> Any:
    from crowdtrain.protocol.client import TrackerClient

    async with TrackerClient(run.tracker.url) as client:
        return await client.status(run.spec.run_id)
