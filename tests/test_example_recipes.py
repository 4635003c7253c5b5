"""A publisher's own model (issue 25): the example recipe package in examples/crowdtrain-example-recipes, installed
with the project (`make test` installs it), is found through its entry points, listed by `crowdtrain recipes`,
trains across volunteers and exports, and passes `run create`'s pre-flight; docs/recipes.md walks through it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from crowdtrain.commands.export import export_state
from crowdtrain.datasets.make import make_dataset
from crowdtrain.protocol.errors import RecipeError, StateSyncError
from crowdtrain.publisher import preflight
from crowdtrain.volunteer.models import ModuleRecipe, get_recipe, known_recipes
from crowdtrain.volunteer.models.registry import recipe_source
from tests.harness import published_run, until, volunteers

try:
    from crowdtrain_example_recipes import data
except ImportError as exc:  # `make test` installs it with the project
    raise ImportError(
        "the example recipes are not installed; `make .venv/.installed` installs them "
        "(pip install -e examples/crowdtrain-example-recipes)"
    ) from exc

pytestmark = pytest.mark.timeout(300)

EXAMPLES = ("example-cnn", "example-lm")
DIST = "crowdtrain-example-recipes"


def test_the_example_entry_points_are_installed_and_build_the_same_model_twice():
    assert set(EXAMPLES) <= set(known_recipes())
    for name in EXAMPLES:
        recipe = get_recipe(name)
        assert isinstance(recipe, ModuleRecipe) and recipe.name == name
        source = recipe_source(name)
        assert (source.builtin, source.distribution) == (False, DIST)
        assert source.entry_point == f"crowdtrain_example_recipes.{name.removeprefix('example-')}:RECIPE"
        rng_before = torch.random.get_rng_state()
        first, second = recipe.build({}), recipe.build({})
        assert torch.equal(torch.random.get_rng_state(), rng_before)  # wrap's build leaves the global RNG be
        for key, value in first.state_dict().items():
            assert torch.equal(value, second.state_dict()[key]), key
    assert get_recipe("example-cnn").kind == "arrays" and get_recipe("example-lm").kind == "tokens"
    assert get_recipe("example-lm").default_args == {"vocab": 256, "seq_len": 64, "d_model": 64, "seed": 0}


def test_recipes_json_lists_the_examples_with_their_arguments_and_distribution(cli_env):
    out = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "--json", "recipes"],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=60,
        check=True,
    )
    listed = {r["name"]: r for r in json.loads(out.stdout)}
    assert list(listed)[:2] == ["tiny-gpt", "mlp"] and listed["mlp"]["source"] == "built-in"
    cnn = listed["example-cnn"]
    assert (cnn["kind"], cnn["distribution"], cnn["error"]) == ("arrays", DIST, None)
    assert cnn["source"] == f"{DIST} {cnn['version']}"
    channels = next(a for a in cnn["args"] if a["name"] == "channels")
    assert channels == {
        "name": "channels",
        "type": "int",
        "default": 16,
        "min": 1,
        "max": 256,
        "choices": [],
        "help": channels["help"],
    }
    assert [a["name"] for a in listed["example-lm"]["args"]] == ["vocab", "seq_len", "d_model", "seed"]
    # one recipe, as text
    one = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "recipes", "example-lm"],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=60,
        check=True,
    )
    assert one.stdout.startswith(f"example-lm: tokens, from {DIST} ")
    assert "seq_len   int   64" in one.stdout and "mlp" not in one.stdout


def test_recipes_lists_a_package_that_does_not_load_with_its_sentence(tmp_path, cli_env):
    (tmp_path / "ct_broken.py").write_text("import no_such_module_xyz\n")
    info = tmp_path / "ct_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ct-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[crowdtrain.models]\nbroken = ct_broken:R\n")
    env = {**cli_env, "PYTHONPATH": str(tmp_path)}
    listing = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "recipes"], capture_output=True, text=True, env=env, timeout=60
    )
    assert listing.returncode == 0 and "Traceback" not in listing.stderr + listing.stdout
    assert "broken: does not load, from ct-broken 0.1 (ct_broken:R)" in listing.stdout
    assert (
        "No module named 'no_such_module_xyz'" in listing.stdout and "example-cnn: arrays" in listing.stdout
    )
    one = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "recipes", "broken", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert one.returncode == 1
    (entry,) = json.loads(one.stdout)
    assert entry["kind"] is None and entry["error"].startswith("The model recipe 'broken' failed to load")


def test_the_example_data_is_the_same_file_every_time(tmp_path, cli_env):
    out = subprocess.run(
        [sys.executable, "-m", "crowdtrain_example_recipes.data", str(tmp_path / "a.npz"), "--samples", "64"],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=60,
        check=True,
    )
    assert "64 samples" in out.stdout
    data.write_digits(tmp_path / "b.npz", samples=64)
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    with np.load(tmp_path / "a.npz") as npz:
        assert (npz["x"].dtype, npz["x"].shape) == (np.float32, (64, 1, 8, 8))
        assert (npz["y"].dtype, npz["y"].shape) == (np.int64, (64,))
        assert set(npz["y"].tolist()) <= set(range(10))


async def test_the_example_cnn_trains_with_two_volunteers_and_exports(tmp_path):
    data.write_digits(tmp_path / "digits.npz", samples=1024)
    async with published_run(
        tmp_path,
        source=tmp_path / "digits.npz",
        model={"recipe": "example-cnn"},
        optimizer={"name": "adamw", "lr": 1e-2},
        target_batch_size=48,
        micro_batch_size=8,
    ) as run:
        assert run.manifest.kind == "arrays" and run.manifest.sample_shape == [1, 8, 8]
        assert run.spec.model.args == {"channels": 16, "classes": 10, "seed": 0}  # pinned, defaults filled in
        vols = volunteers(run, tmp_path, 2)
        tasks = [asyncio.create_task(v.run()) for v in vols]
        await until(
            lambda: min(v.summary.steps_done for v in vols) >= 30,
            150,
            "30 steps",
            every_s=0.05,
            watching=tasks,
        )
        out = tmp_path / "export" / "model.safetensors"
        exported: dict = {}

        async def export() -> bool:
            try:
                exported.update(await export_state(run.spec.run_id, run.tracker.url, out, None, 10.0))
            except StateSyncError:  # the serving peers' snapshots agree on no step yet: ask after the next
                return False
            return True

        await until(export, 60, "an export of the state", every_s=0.2, watching=tasks)
        for v in vols:
            v.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    losses = vols[0].summary.losses
    assert np.mean(losses[-3:]) < 0.75 * np.mean(losses[:3]), losses  # it learns the digits
    assert exported["recipe"] == "example-cnn" and exported["resolved_args"]["channels"] == 16
    model = get_recipe("example-cnn").build({})
    model.load_state_dict(load_file(str(out)), strict=True)  # the whole state: weights and BatchNorm buffers
    assert not torch.allclose(model.features[1].running_mean, torch.zeros(16))


def test_the_example_lm_passes_run_creates_preflight_on_tokens(tmp_path):
    manifest = make_dataset("builtin:stdlib", tmp_path / "stdlib", chunk_bytes=16 * 1024, max_bytes=64 * 1024)
    model = preflight({"recipe": "example-lm", "args": {"seq_len": 32}}, tmp_path / "stdlib", manifest)
    assert model["args"] == {"vocab": 256, "seq_len": 32, "d_model": 64, "seed": 0}
    assert len(model["param_hash"]) == 64 and len(model["init_hash"]) == 64
    with pytest.raises(RecipeError, match=r"recipe 'example-lm' has vocab = 100"):
        preflight({"recipe": "example-lm", "args": {"vocab": 100}}, tmp_path / "stdlib", manifest)
    with pytest.raises(RecipeError, match=r"recipe 'example-cnn' trains on arrays data sets"):
        preflight({"recipe": "example-cnn"}, tmp_path / "stdlib", manifest)


def test_the_example_cnn_preflight_refuses_labels_beyond_its_classes(tmp_path):
    data.write_digits(tmp_path / "digits.npz", samples=256)
    manifest = make_dataset(tmp_path / "digits.npz", tmp_path / "digits", chunk_bytes=16 * 1024)
    assert preflight({"recipe": "example-cnn"}, tmp_path / "digits", manifest)["args"]["classes"] == 10
    with pytest.raises(
        RecipeError, match=r"recipe 'example-cnn' fails on a micro-batch .*x float32 \(8, 1, 8, 8\)"
    ):
        preflight({"recipe": "example-cnn", "args": {"classes": 2}}, tmp_path / "digits", manifest)
