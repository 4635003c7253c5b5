"""`crowdtrain export` writes weights that reproduce a live volunteer's model, and a run whose volunteers
all left resumes from such a checkpoint with `join --init-from`."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from crowdtrain.commands.export import export_info, export_state
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from crowdtrain.volunteer.models import get_recipe
from crowdtrain.volunteer.trainer import Trainer
from tests.harness import TINY_GPT, Recorder, published_run, until


def model_from_flat(spec, flat: np.ndarray) -> torch.nn.Module:
    recipe = get_recipe(spec.model.recipe)
    trainer = Trainer(recipe, recipe.build(dict(spec.model.args)), spec.optimizer, spec.schedule)
    trainer.set_flat_params(flat)
    return trainer.model.eval()


def test_model_json_holds_the_args_as_written_and_as_the_recipe_resolves_them():
    """Issue 25: model.json held only the spec's args; a reader had to know the recipe's defaults."""
    info = export_info("r-1", 7, "tiny-gpt", dict(TINY_GPT), "ab" * 32)
    defaults = get_recipe("tiny-gpt").default_args
    assert info["args"] == TINY_GPT  # as the run's spec writes them (what `join --init-from` compares)
    assert set(info["resolved_args"]) == set(defaults) > set(TINY_GPT)
    assert info["resolved_args"] == {**defaults, **TINY_GPT}
    assert json.loads(json.dumps(info)) == info
    # a recipe not installed here: the export still holds the weights and the args as written
    elsewhere = export_info("r-1", 7, "someone-elses-recipe", {"width": 3}, "ab" * 32)
    assert elsewhere["resolved_args"] is None and elsewhere["args"] == {"width": 3}


@pytest.mark.timeout(300)
async def test_export_matches_a_live_volunteer_and_a_left_run_resumes_from_it(tmp_path):
    recs = {i: Recorder() for i in range(2)}
    async with published_run(tmp_path) as run:

        def volunteer(i: int, **kw) -> Volunteer:
            return Volunteer(
                VolunteerConfig(
                    run_id=run.spec.run_id,
                    tracker_url=run.tracker.url,
                    data_dir=tmp_path / f"volunteer-{i}",
                    seed=i,
                    **kw,
                ),
                record=recs[i],
            )

        live = volunteer(0)
        task = asyncio.create_task(live.run())
        await until(lambda: live.step >= 5, 120, "the live volunteer's step 5", every_s=0.05)
        out = tmp_path / "export" / "model.safetensors"
        info = await export_state(run.spec.run_id, run.tracker.url, out, None, 10.0)
        live.stop()
        await asyncio.wait_for(task, 60)

        # The file loads into a fresh recipe model and gives the live model's outputs on a fixed input.
        fresh = get_recipe("tiny-gpt").build(dict(run.spec.model.args)).eval()
        fresh.load_state_dict(load_file(str(out)), strict=True)
        reference = model_from_flat(run.spec, recs[0].params[info["step"]])
        x = torch.arange(2 * TINY_GPT["seq_len"]).reshape(2, -1) % 256
        with torch.no_grad():
            torch.testing.assert_close(fresh(x), reference(x), rtol=0, atol=0)
        written = json.loads(out.with_suffix(".json").read_text())
        assert written["recipe"] == "tiny-gpt" and written["args"] == dict(run.spec.model.args)
        assert written["resolved_args"] == get_recipe("tiny-gpt").validate_args(run.spec.model.args)

        # Every volunteer left; the publisher resumes the run from the checkpoint.
        resumed = volunteer(1, init_from=out, max_steps=live.step + 2)
        summary = await asyncio.wait_for(resumed.run(), 120)
    assert summary.first_step == live.step  # the run's global step survived the empty room
    # It started from the exported weights, not from the recipe's initial ones.
    exported = model_from_flat(run.spec, recs[0].params[info["step"]])
    start = model_from_flat(run.spec, recs[1].params[live.step])
    for (name, a), (_, b) in zip(exported.state_dict().items(), start.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert summary.steps_done == 2
