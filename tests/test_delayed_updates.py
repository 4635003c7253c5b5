"""Delayed parameter updates (``averaging.delay = 1``) learn as well as immediate ones.

The collaborative engine with delay 1 equals a single-process replay of the delayed rule
(``test_volunteer_collab``); here that rule and the undelayed one train the demo's model on the demo's
corpus, on the very same samples, and reach held-out losses within 5 % of each other at equal steps.

Measured (docs/benchmarks.md): at lr 1e-3 the delayed run is 2.3 % behind at step 60; at the demo's lr 3e-3
it is 10.7 % behind (one step of staleness with AdamW at a high rate; a lower rate does not win it back,
docs/decisions.md), so this test checks the rule at 1e-3 and the docs state the gap at the demo's rate.
"""

from __future__ import annotations

import numpy as np
import pytest

from crowdtrain.datasets.make import make_dataset
from crowdtrain.datasets.sampler import Sampler
from crowdtrain.protocol.messages import OptimizerSpec, ScheduleSpec
from tests.oracles import replay_reference
from tests.test_volunteer_learning import held_out_loss

DEMO_ARGS = {"d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 64}  # crowdtrain demo's model
STEPS, TARGET, MICRO = 60, 96, 16  # the demo's target batch in its micro-batches


class _Spec:
    """What ``held_out_loss`` reads of a run spec."""

    class model:
        args = DEMO_ARGS

    optimizer = OptimizerSpec(name="adamw", lr=1e-3, weight_decay=0.01)
    schedule = ScheduleSpec(kind="cosine", warmup_steps=3, total_steps=STEPS)


@pytest.mark.timeout(300)
def test_delayed_updates_reach_a_held_out_loss_within_5_percent_of_immediate_ones(tmp_path):
    manifest = make_dataset("builtin:stdlib", tmp_path / "data", chunk_bytes=64 << 10, max_bytes=2 << 20)
    sampler = Sampler(manifest, tmp_path / "data", seed=7, seq_len=DEMO_ARGS["seq_len"])
    for index in range(len(manifest.chunks)):
        sampler.add_chunk(index)
    steps = [
        [(b.x, b.y) for b in (sampler.batch(MICRO) for _ in range(TARGET // MICRO))] for _ in range(STEPS)
    ]
    losses = {}
    for delay in (0, 1):
        params = replay_reference("tiny-gpt", DEMO_ARGS, _Spec.optimizer, _Spec.schedule, steps, delay=delay)
        assert len(params) == STEPS
        losses[delay] = held_out_loss(_Spec, params[-1])
    before = held_out_loss(_Spec, None)
    assert losses[0] < 0.85 * before, (before, losses)  # it learned at all
    assert abs(losses[1] - losses[0]) <= 0.05 * losses[0], losses
    # the rules really differ: one step of staleness changes the trajectory
    assert not np.isclose(losses[0], losses[1], rtol=0, atol=1e-7)
