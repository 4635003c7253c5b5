"""Model recipes: deterministic builds, the parameter-schema hash and its refusal, the registry, learning."""

from __future__ import annotations

import textwrap

import pytest
import torch

from crowdtrain.protocol.errors import RecipeError
from crowdtrain.protocol.messages import OptimizerSpec, ScheduleSpec
from crowdtrain.volunteer.models import (
    MLP,
    TINY_GPT,
    Recipe,
    check_param_hash,
    get_recipe,
    known_recipes,
    param_hash,
    param_schema,
)
from crowdtrain.volunteer.trainer import Trainer
from tests.oracles import mean_loss


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny-gpt", "mlp"])
def test_two_builds_have_the_same_hash_and_the_same_initial_parameters(name):
    recipe = get_recipe(name)
    assert isinstance(recipe, Recipe)
    a, b = recipe.build({}), recipe.build(dict(recipe.default_args))
    assert param_hash(a) == param_hash(b)
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key
    assert all(torch.isfinite(p).all() for p in pa.values())


def test_build_neither_reads_nor_moves_the_global_rng():
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = params_of(TINY_GPT.build({}))
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(999)  # a different global state must not change the initial parameters
    second = params_of(TINY_GPT.build({}))
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_seed_changes_values_but_not_the_hash():
    a, b = TINY_GPT.build({"seed": 0}), TINY_GPT.build({"seed": 1})
    assert param_hash(a) == param_hash(b)
    assert not torch.equal(a.wte.weight, b.wte.weight)


def test_hash_depends_on_shapes():
    assert param_hash(TINY_GPT.build({})) != param_hash(TINY_GPT.build({"d_model": 32}))
    assert param_hash(MLP.build({})) != param_hash(MLP.build({"n_layer": 3}))


def test_param_schema_lists_sorted_names_shapes_and_dtypes():
    schema = param_schema(MLP.build({"in_features": 3, "hidden": 5, "n_layer": 1, "out_features": 2}))
    assert schema == [
        "head.bias 2 float32",
        "head.weight 2,5 float32",
        "layers.0.bias 5 float32",
        "layers.0.weight 5,3 float32",
    ]


def test_tiny_gpt_defaults_are_ci_sized():
    model = TINY_GPT.build({})
    n = sum(p.numel() for p in model.parameters())
    assert 50_000 < n < 200_000
    assert TINY_GPT.default_args == {
        "d_model": 64,
        "n_layer": 2,
        "n_head": 4,
        "seq_len": 64,
        "vocab": 256,
        "seed": 0,
    }


def test_matching_hash_passes():
    model = TINY_GPT.build({})
    check_param_hash(model, param_hash(model))
    check_param_hash(model, param_hash(model).upper())


def test_hash_mismatch_says_which_recipe_args_and_hashes():
    spec_hash = param_hash(TINY_GPT.build({"d_model": 32}))
    model = TINY_GPT.build({})
    with pytest.raises(RecipeError) as info:
        check_param_hash(model, spec_hash)
    text = str(info.value)
    assert "'tiny-gpt'" in text
    assert "d_model=64" in text
    assert param_hash(model)[:16] in text
    assert spec_hash[:16] in text
    assert "Install the same crowdtrain version" in text


def test_missing_spec_hash_is_refused_with_a_sentence():
    with pytest.raises(RecipeError, match="has no parameter hash"):
        check_param_hash(MLP.build({}), "")


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(RecipeError) as info:
        get_recipe("gpt-17")
    text = str(info.value)
    assert "'gpt-17'" in text
    assert "tiny-gpt" in text
    assert "mlp" in text
    assert known_recipes()[:2] == ["tiny-gpt", "mlp"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"d_modle": 64}, "has no argument 'd_modle'"),
        ({"d_model": "64"}, "'d_model' must be a int"),
        ({"n_layer": True}, "'n_layer' must be a int"),
        ({"n_head": 5}, "n_head \\(5\\) must divide d_model \\(64\\)"),
        ({"seq_len": 1}, "'seq_len' must be ≥ 2"),
    ],
)
def test_bad_tiny_gpt_args_are_sentences(args, match):
    with pytest.raises(RecipeError, match=match):
        TINY_GPT.build(args)


def test_bad_mlp_task_is_refused():
    with pytest.raises(RecipeError, match="'task' must be one of classification, regression"):
        MLP.validate_args({"task": "ranking"})


def test_integral_floats_are_accepted_for_int_args():
    assert TINY_GPT.validate_args({"d_model": 32.0})["d_model"] == 32


def test_tiny_gpt_is_causal():
    model = TINY_GPT.build({"seq_len": 16})
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tiny_gpt_refuses_a_sequence_longer_than_its_context():
    model = TINY_GPT.build({"seq_len": 8})
    with pytest.raises(ValueError, match="≤8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def fixed_batch(recipe_name: str, args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    if recipe_name == "tiny-gpt":
        text = b"the quick brown fox jumps over the lazy dog; " * 8
        windows = torch.tensor(list(text[: 4 * 33]), dtype=torch.uint8).view(4, 33)
        return windows[:, :-1], windows[:, 1:]
    x = torch.randn(16, args["in_features"], generator=g)
    if args["task"] == "classification":
        return x, torch.randint(0, args["out_features"], (16,), generator=g)
    return x, torch.randn(16, args["out_features"], generator=g)


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("tiny-gpt", {"seq_len": 32}),
        ("mlp", {"task": "classification"}),
        ("mlp", {"task": "regression", "out_features": 3}),
    ],
)
def test_loss_falls_on_a_fixed_batch(name, args):
    recipe = get_recipe(name)
    full = recipe.validate_args(args)
    trainer = Trainer(recipe, recipe.build(full), OptimizerSpec(lr=1e-2), ScheduleSpec(kind="constant"))
    x, y = fixed_batch(name, full)
    first = mean_loss(trainer, x, y)
    for step in range(25):
        trainer.accumulate(x, y)
        trainer.apply(trainer.take_grad(), step)
    last = mean_loss(trainer, x, y)
    assert last < 0.5 * first, (first, last)


def write_plugin(root, module: str, body: str, entry: str) -> None:
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[crowdtrain.models]\n{entry}\n")


def test_entry_point_recipes_are_found(tmp_path, monkeypatch):
    write_plugin(
        tmp_path,
        "ct_plugin_linear",
        """
        import torch
        from crowdtrain.volunteer.models import Arg, TableRecipe

        class Linear(TableRecipe):
            def _make(self, args):
                return torch.nn.Linear(args["n"], 1)

            def _init(self, name, shape, args, generator):
                return torch.zeros(shape)

            def loss(self, model, x, y):
                return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)

        RECIPE = Linear("linear-probe", "arrays", {"n": Arg(int, 4, "inputs", min=1)})
        """,
        "linear-probe = ct_plugin_linear:RECIPE",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "linear-probe" in known_recipes()
    recipe = get_recipe("linear-probe")
    model = recipe.build({"n": 3})
    assert param_schema(model) == ["bias 1 float32", "weight 1,3 float32"]


def test_an_entry_point_that_is_not_a_recipe_is_refused(tmp_path, monkeypatch):
    write_plugin(tmp_path, "ct_plugin_bad", "RECIPE = 42\n", "not-a-recipe = ct_plugin_bad:RECIPE")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RecipeError, match=r"'not-a-recipe' from ct_plugin_bad:RECIPE .* is not a recipe"):
        get_recipe("not-a-recipe")


def test_an_entry_point_that_fails_to_import_is_a_recipe_error(tmp_path, monkeypatch):
    write_plugin(tmp_path, "ct_plugin_broken", "import no_such_module_xyz\n", "broken = ct_plugin_broken:R")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RecipeError, match="'broken' failed to load"):
        get_recipe("broken")
