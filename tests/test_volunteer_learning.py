"""Three volunteers on the built-in corpus with tiny-gpt and the int8 codec learn: held-out loss falls."""

from __future__ import annotations

import asyncio
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.models import get_recipe
from crowdtrain.volunteer.trainer import Trainer
from tests.harness import Recorder, published_run, volunteers
from tests.oracles import mean_loss

ARGS = {"d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 64}
STEPS = 40


def held_out_batch(seq_len: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of a stdlib file far from the head of the sorted list the data set was cut from."""
    text = Path(zipfile.__file__).read_bytes()
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    starts = np.linspace(0, len(tokens) - seq_len - 2, n).astype(int)
    windows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
    return torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])


def held_out_loss(spec, params: np.ndarray | None) -> float:
    recipe = get_recipe("tiny-gpt")
    trainer = Trainer(recipe, recipe.build(dict(spec.model.args)), spec.optimizer, spec.schedule)
    if params is not None:
        trainer.set_flat_params(params)
    x, y = held_out_batch(spec.model.args["seq_len"])
    return mean_loss(trainer, x, y)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_three_volunteers_with_int8_gradients_cut_held_out_loss_by_a_third(tmp_path):
    rounds: list[ev.RoundDone] = []
    recs = [Recorder() for _ in range(3)]
    async with published_run(
        tmp_path,
        model={"recipe": "tiny-gpt", "args": ARGS},
        averaging={"codec": "int8", "average_state_every": 10},
        optimizer={"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        target_batch_size=64,
        micro_batch_size=8,
        max_bytes=1 << 20,
    ) as run:
        vols = volunteers(
            run,
            tmp_path,
            3,
            emit=lambda e: rounds.append(e) if isinstance(e, ev.RoundDone) else None,
            record=recs,
            max_steps=STEPS,
        )
        await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 500)
    before = held_out_loss(run.spec, None)
    after = held_out_loss(run.spec, recs[0].params[STEPS])
    assert after <= 0.7 * before, (before, after)
    # int8 + zstd really is on the wire: a few times fewer bytes than fp32.
    sent = sum(r.bytes_sent for r in rounds if r.kind == "grad")
    raw = sum(r.raw_bytes for r in rounds if r.kind == "grad")
    assert 0 < sent < raw / 3
    # The group stayed in lock-step: everyone holds the same parameters at the end.
    for rec in recs[1:]:
        np.testing.assert_array_equal(rec.params[STEPS], recs[0].params[STEPS])
