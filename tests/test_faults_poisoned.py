"""A volunteer whose gradient is poisoned (NaN, scaled ×1e6, or half its length) takes part in a real run:
the honest volunteers reject or clip its contribution, stay equal and finite, and keep learning.

All volunteers run in this process over real servers. The fault is injected through one seam: the poisoned
volunteer's ``trainer.take_grad`` is wrapped once its trainer exists, so everything it sends is built and
signed by the real engine and averager.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.averaging.exchange import part_bounds
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from tests.faults import losses_on_a_fixed_batch, record_outcome
from tests.harness import Recorder, published_run, until

STEPS = 8
POISONS = {
    "nan": lambda g: np.full_like(g, np.nan),
    "x1e6": lambda g: g * np.float32(1e6),
    "half": lambda g: g[: g.size // 2].copy(),  # the wrong length: every part's boundaries move
}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("poison", sorted(POISONS))
async def test_poisoned_gradient_is_rejected_or_clipped_and_the_honest_stay_equal_and_finite(
    tmp_path, poison
):
    seen: list[list[ev.Event]] = [[], [], []]
    recs = [Recorder() for _ in range(3)]
    averaging = {"clip_multiple": 5.0, "round_timeout_s": 5.0}
    async with published_run(tmp_path, target_batch_size=96, averaging=averaging) as run:
        vols = []
        for i in range(3):
            v = Volunteer(
                VolunteerConfig(
                    run_id=run.spec.run_id,
                    tracker_url=run.tracker.url,
                    data_dir=tmp_path / f"volunteer-{i}",
                    seed=400 + i,
                    max_steps=STEPS if i < 2 else None,
                    catch_up=i < 2,
                ),
                emit=seen[i].append,
                record=recs[i],
            )
            vols.append(v)
        tasks = [asyncio.create_task(v.run()) for v in vols]
        bad = vols[2]
        await until(lambda: bad.trainer is not None, 60, "the poisoned volunteer's trainer")
        honest_grad = bad.trainer.take_grad
        poisoned: set[int] = set()  # steps it sent a poisoned copy in

        def poisoned_grad(into=None):
            # it attacks once everyone computes (from step 1: at step 0 a volunteer that got data first may
            # be allotted the whole batch) and when its copy carries weight
            if bad.step == 0 or bad.trainer.samples == 0:
                return honest_grad(into)
            poisoned.add(bad.step)
            return POISONS[poison](honest_grad(into))

        bad.trainer.take_grad = poisoned_grad
        # the norm of each part of what it sent: ×1e6 of a part that is all zeros (embedding rows of bytes its
        # samples did not hold: parts follow upload rates and can be that small) is zeros, which no owner clips
        part_norms: dict[int, list[float]] = {}
        allreduce = bad._run.averager.allreduce

        async def recording(assignment, vector, weight, *, tag="grad", **kw):
            if tag == "grad":
                bounds = part_bounds(vector.size, assignment.parts, assignment.part_weights)
                part_norms[assignment.step] = [float(np.linalg.norm(vector[a:b])) for a, b in bounds]
            return await allreduce(assignment, vector, weight, tag=tag, **kw)

        bad._run.averager.allreduce = recording
        try:
            summaries = await asyncio.wait_for(asyncio.gather(*tasks[:2]), 150)
        finally:
            bad.stop()
            await asyncio.wait_for(asyncio.gather(tasks[2], return_exceptions=True), 60)

    bad_id = bad.peer_id
    # an owner compares a copy with the other weighted copies (clipping needs two): rounds where the honest
    # owner contributed nothing itself (start-up: its share of the step was 0) cannot be judged here
    contributed = [
        {e.step: e.contributed_samples for e in seen[i] if isinstance(e, ev.StepDone)} for i in range(2)
    ]
    rounds = [
        [
            e
            for e in seen[i]
            if isinstance(e, ev.RoundDone) and e.kind == "grad" and contributed[i].get(e.step)
        ]
        for i in range(2)
    ]
    with_bad = [r for rs in rounds for r in rs if bad_id in r.members and r.step in poisoned]
    assert with_bad, "the poisoned volunteer was never grouped with the others"
    # Wherever an honest volunteer owned a part, the poisoned copy was refused or clipped, never averaged in.
    owned = [r for r in with_bad if r.my_part >= 0]
    caught = [r for r in owned if bad_id in r.rejected or bad_id in r.clipped or bad_id in r.dropped]
    zero = [r for r in owned if poison == "x1e6" and part_norms.get(r.step, [1.0] * 8)[r.my_part] == 0]
    missed = [r for r in owned if r not in caught and r not in zero]
    assert owned and not missed, [
        (
            r.step,
            r.my_part,
            r.members,
            r.rejected,
            r.clipped,
            r.dropped,
            r.failed_parts,
            r.duration_s,
            r.bytes_sent,
        )
        for r in missed
    ]
    # The honest two took every step, with equal, finite parameters, and learn.
    assert all(s.steps_done == STEPS for s in summaries), [s.steps_done for s in summaries]
    for step in range(1, STEPS + 1):
        a, b = recs[0].params[step], recs[1].params[step]
        assert np.isfinite(a).all(), f"non-finite parameters after step {step}"
        np.testing.assert_array_equal(a, b, err_msg=f"honest volunteers differ after step {step}")
    first, last = losses_on_a_fixed_batch(vols[0], recs[0].params, run.manifest, [1, STEPS])
    assert last < first
    record_outcome(
        f"poisoned gradient ({poison})",
        rounds_completed=min(s.steps_done for s in summaries),
        rounds_with_the_poisoned_peer=len(with_bad) // 2,
        refused=sum(bad_id in r.rejected for r in owned),
        clipped=sum(bad_id in r.clipped for r in owned),
        honest_params_equal_and_finite=True,
        samples_lost=0,
        loss_first=round(first, 3),
        loss_last=round(last, 3),
    )
