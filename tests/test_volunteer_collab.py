"""Volunteers collaborating through a real tracker, a real seeder and real peer servers, in one process.

Equivalence: with codec none and no faults, three volunteers in one group hold identical parameters after
every global step, equal to a single process replaying the very samples each of them drew.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from crowdtrain.datasets.sampler import Sampler
from crowdtrain.protocol.client import TrackerClient
from tests.harness import TINY_GPT, Recorder, published_run, volunteers
from tests.oracles import assert_replayed, replay_reference

STEPS = 20


def group_mean(grads, weights):
    """The part owner's arithmetic (members in peer-id order): fp32, one fused pass per member."""
    total = math.fsum(w for w in weights if w > 0)
    out = np.zeros_like(grads[0], dtype=np.float32)
    for g, w in zip(grads, weights, strict=True):
        if w > 0:
            out += np.float32(w / total) * g
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [0, 1])
async def test_three_volunteers_equal_a_single_process_replay_of_their_samples(tmp_path, delay):
    """The README's example: 3 volunteers, a target of 128 samples in micro-batches of 16. With delay 1
    (delayed parameter updates) the replay follows the same delayed rule: each step's gradients computed
    on the parameters before the previous step's update."""
    async with published_run(
        tmp_path,
        target_batch_size=128,
        micro_batch_size=16,
        averaging={"codec": "none", "group_size": 4, "clip_multiple": 0.0, "delay": delay},
    ) as run:
        recs = [Recorder() for _ in range(3)]
        vols = volunteers(run, tmp_path, 3, seed=1000, record=recs, max_steps=STEPS)
        summaries = await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 240)
        async with TrackerClient(run.tracker.url) as client:
            history = (await client.status(run.spec.run_id)).recent_steps  # the last 10
    assert all(s.steps_done == STEPS for s in summaries), [s.steps_done for s in summaries]
    target = run.spec.target_batch_size
    assert history and all(target <= r.samples <= 1.25 * target for r in history), [
        r.samples for r in history
    ]
    assert all(s.steps_missed == 0 for s in summaries)
    # nobody computed toward a step the run (for them) never takes: with delay 1, no computing ahead past
    # the last one
    assert all(max(rec.batches) == STEPS - 1 for rec in recs), [sorted(rec.batches) for rec in recs]
    for step in range(1, STEPS + 1):
        first = recs[0].params[step]
        for rec in recs[1:]:
            np.testing.assert_array_equal(rec.params[step], first, err_msg=f"after step {step}")

    spec = run.spec
    seq_len = spec.model.args["seq_len"]
    steps = []
    for step in range(STEPS):
        per_volunteer = []
        for v, rec in sorted(zip(vols, recs, strict=True), key=lambda vr: vr[0].peer_id):
            batches = [
                Sampler.take(p, run.manifest, v.config.data_dir, seq_len) for p in rec.batches.get(step, [])
            ]
            per_volunteer.append([(b.x, b.y) for b in batches])
        steps.append(per_volunteer)
    assert sum(len(b) for b in steps[0]) > 0
    reference = replay_reference(
        "tiny-gpt",
        TINY_GPT,
        spec.optimizer,
        spec.schedule,
        steps,
        by_volunteer=True,
        combine=group_mean,
        delay=delay,
    )
    assert all(s.compute_share is not None and 0 < s.compute_share <= 1 for s in summaries)
    for step, expected in enumerate(reference, start=1):
        assert_replayed(recs[0].params[step], expected, f"step {step}")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("n", "group_size"), [(8, 2), (16, 4)])
async def test_more_volunteers_than_a_group_step_on_one_mean_equal_to_a_replay(tmp_path, n, group_size):
    """Several groups per step: the phases of the all-reduce (8 in groups of 2: three phases; 16 in groups
    of 4: two) leave every volunteer with the one mean of all, so all hold bit-equal parameters after every
    step, equal to a single process replaying every volunteer's samples; and each step holds the batch
    the run asked for (each volunteer stops at its share of it)."""
    steps, target = 4, 256
    async with published_run(
        tmp_path,
        target_batch_size=target,
        averaging={"codec": "none", "group_size": group_size, "clip_multiple": 0.0},
    ) as run:
        recs = [Recorder() for _ in range(n)]
        vols = volunteers(run, tmp_path, n, seed=1000, record=recs, max_steps=steps)
        summaries = await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 360)
        async with TrackerClient(run.tracker.url) as client:
            history = (await client.status(run.spec.run_id)).recent_steps
    assert all(s.steps_done == steps for s in summaries), [s.steps_done for s in summaries]
    assert sorted(r.step for r in history) == list(range(steps))
    assert all(target <= r.samples <= 1.25 * target for r in history), [r.samples for r in history]
    assert all(r.peers == n and r.groups == n // group_size for r in history)
    for step in range(1, steps + 1):
        first = recs[0].params[step]
        for rec in recs[1:]:
            np.testing.assert_array_equal(rec.params[step], first, err_msg=f"after step {step}")
    seq_len = run.spec.model.args["seq_len"]
    per_step = [
        [
            [
                (b.x, b.y)
                for b in (
                    Sampler.take(p, run.manifest, v.config.data_dir, seq_len)
                    for p in rec.batches.get(step, [])
                )
            ]
            for v, rec in zip(vols, recs, strict=True)
        ]
        for step in range(steps)
    ]
    assert all(sum(len(b) for b in s) > 0 for s in per_step)
    reference = replay_reference(
        "tiny-gpt", TINY_GPT, run.spec.optimizer, run.spec.schedule, per_step, by_volunteer=True
    )
    for step, expected in enumerate(reference, start=1):
        assert_replayed(recs[0].params[step], expected, f"step {step}")


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_micro_batch_longer_than_a_heartbeat_never_closes_a_step_into_an_empty_round(tmp_path):
    """Regression (issue 13): with a model whose micro-batch outlasts a heartbeat interval (0.2 s here), the
    tracker closed steps and formed rounds before the contributors could say "ready": steps with nobody in
    them, and a global step that counted steps no volunteer took. Every step now holds its contributors."""
    model = {"recipe": "tiny-gpt", "args": {"d_model": 256, "n_layer": 4, "n_head": 4, "seq_len": 128}}
    steps = 3
    async with published_run(
        tmp_path, model=model, target_batch_size=16, averaging={"codec": "none", "gather_s": 0.2}
    ) as run:
        vols = volunteers(run, tmp_path, 2, seed=1000, max_steps=steps)
        summaries = await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 240)
        async with TrackerClient(run.tracker.url) as client:
            status = await client.status(run.spec.run_id)
    # the premise: a micro-batch (8 samples) took longer than the 0.2 s heartbeat interval
    assert all(8 / v.samples_per_s > 0.2 for v in vols), [v.samples_per_s for v in vols]
    assert all(s.steps_done == steps and s.steps_missed == 0 for s in summaries), summaries
    assert status.global_step == steps
    assert all(r.samples >= 16 and r.peers == 2 for r in status.recent_steps), status.recent_steps
