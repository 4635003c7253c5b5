"""A model is more than its parameters (issue 25): a recipe with BatchNorm trains across volunteers, every
volunteer holds the same running statistics after each step (so their state hashes agree), a late volunteer
catches up to that state, and `crowdtrain export` writes it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from crowdtrain.commands.export import export_state
from crowdtrain.volunteer.models import get_recipe
from crowdtrain.volunteer.trainer import Trainer
from tests.harness import Recorder, published_run, until, volunteers

pytestmark = pytest.mark.timeout(300)

ARGS = {"in_features": 16, "hidden": 32, "n_layer": 2, "out_features": 2, "batch_norm": True}


def supervised_npz(path, n: int = 4096) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((n, 16)) * 3 + 1).astype(np.float32)  # far from BatchNorm's initial statistics
    y = (x[:, 0] + x[:, 1] > 2).astype(np.int64)
    np.savez(path, x=x, y=y)


def test_a_trainer_carries_buffers_in_the_averaged_vector_and_counts_steps():
    recipe = get_recipe("mlp")
    model = recipe.build(ARGS)
    trainer = Trainer(recipe, model, *_specs())
    assert [n for n, _ in trainer.buffers] == [
        "norms.0.running_mean", "norms.0.running_var", "norms.1.running_mean", "norms.1.running_var"
    ]  # fmt: skip
    x = torch.randn(8, 16) * 3 + 1
    trainer.accumulate(x, torch.zeros(8, dtype=torch.long))
    grad = trainer.take_grad(np.empty(trainer.numel, dtype=np.float32))
    tail = grad[trainer.numel - 4 * 32 :]
    np.testing.assert_array_equal(tail[:32], model.norms[0].running_mean.numpy())
    assert not np.allclose(tail[:32], 0)  # the forward pass moved the statistics
    # the mean's buffers become every peer's buffers, and the count is the run's step count
    mean = grad.copy()
    mean[trainer.numel - 4 * 32 :] = np.arange(4 * 32, dtype=np.float32)
    trainer.apply(mean, step=6)
    np.testing.assert_array_equal(model.norms[1].running_var.numpy(), np.arange(96, 128, dtype=np.float32))
    assert int(model.norms[0].num_batches_tracked) == 7


def _specs():
    from crowdtrain.protocol.messages import OptimizerSpec, ScheduleSpec

    return OptimizerSpec(name="adamw", lr=1e-2), ScheduleSpec(
        kind="constant", warmup_steps=0, total_steps=100
    )


async def test_a_batchnorm_model_trains_exports_and_is_caught_up_to(tmp_path):
    supervised_npz(tmp_path / "train.npz")
    recs = [Recorder() for _ in range(3)]
    async with published_run(
        tmp_path,
        source=tmp_path / "train.npz",
        model={"recipe": "mlp", "args": ARGS},
        optimizer={"name": "adamw", "lr": 1e-2},
        averaging={"codec": "int8"},  # the README's codec: buffers must survive it too
    ) as run:
        vols = volunteers(run, tmp_path, 3, record=recs)
        first = [asyncio.create_task(v.run()) for v in vols[:2]]
        await until(lambda: vols[0].step >= 4, 120, "step 4", every_s=0.05)
        late = asyncio.create_task(vols[2].run())
        await until(lambda: vols[2].summary.steps_done >= 3, 120, "three steps of the late volunteer")
        # two peers serve the state; they must agree on its hash for the tracker to list it
        out = tmp_path / "export" / "model.safetensors"
        info = await export_state(run.spec.run_id, run.tracker.url, out, None, 10.0)
        for v in vols:
            v.stop()
        await asyncio.wait_for(asyncio.gather(*first, late), 60)

    assert vols[2].summary.caught_up_to is not None  # it loaded a fetched state
    steps = sorted(set(recs[0].params) & set(recs[1].params) & set(recs[2].params))
    assert len(steps) >= 3, steps
    for step in steps:  # parameters and running statistics, bit for bit
        np.testing.assert_array_equal(recs[2].params[step], recs[0].params[step])
        np.testing.assert_array_equal(recs[1].params[step], recs[0].params[step])
    # the export holds the running statistics, and they are the volunteers' (not the initial 0 and 1)
    exported = load_file(str(out))
    model = get_recipe("mlp").build(ARGS)
    model.load_state_dict(exported, strict=True)
    assert not torch.allclose(model.norms[0].running_mean, torch.zeros(32))
    assert int(model.norms[0].num_batches_tracked) == info["step"]
    reference = Trainer(get_recipe("mlp"), get_recipe("mlp").build(ARGS), *_specs())
    reference.set_flat_params(recs[0].params[info["step"]])
    for name, value in reference.model.state_dict().items():
        if "num_batches" not in name:
            torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)
    # and the volunteers learned the task
    losses = vols[0].summary.losses
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
