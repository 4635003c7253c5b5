"""`run create` refuses, each in one sentence, what would otherwise crash or split every volunteer later
(issue 25): a recipe of the wrong kind for the data set, arguments the recipe's own code refuses, and a build
whose initial values differ from one build to the next."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from crowdtrain.commands.run import load_spec
from crowdtrain.datasets.make import make_dataset
from crowdtrain.protocol.errors import RecipeError
from crowdtrain.publisher import param_hash_of
from crowdtrain.volunteer.models import registry
from tests.faults import subprocess_env


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data") / "tokens"
    make_dataset(
        "builtin:stdlib", folder, chunk_bytes=64 * 1024, name="t", announce_url=None, max_bytes=128 * 1024
    )
    return folder


def test_run_create_refuses_a_recipe_of_another_kind_than_the_data_set_in_one_sentence(tokens_dir):
    spec = tokens_dir.parent / "run.toml"
    spec.write_text(
        'name = "wrong kind"\ntarget_batch_size = 64\nmicro_batch_size = 8\n'
        '[model]\nrecipe = "mlp"\n[dataset]\ndir = "tokens"\n'
    )
    with pytest.raises(RecipeError, match=r"recipe 'mlp' trains on arrays data sets, but .* holds tokens"):
        load_spec(spec)
    # and the command says it in one line, exit 1, no traceback
    done = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "run", "create", str(spec), "--tracker", "http://127.0.0.1:9",
         "--admin-token", "x"],
        capture_output=True, text=True, env=subprocess_env(), timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "trains on arrays data sets" in done.stderr


@dataclass(frozen=True)
class _Foreign:
    """A third-party recipe (as an installed package would register it) with the faults under test."""

    name: str
    fault: str
    kind: str = "tokens"
    default_args: ClassVar[dict] = {}

    def validate_args(self, args):
        if self.fault == "value-error":
            raise ValueError("width must be a multiple of 8")
        return dict(args)

    def build(self, args):
        self.validate_args(args)
        model = torch.nn.Linear(4, 4)  # drawn from the global RNG: different at each build
        if self.fault != "random":
            with torch.no_grad():
                model.weight.fill_(0.5)
                model.bias.zero_()
        return model

    def loss(self, model, x, y):
        return model(x).mean()


@pytest.mark.parametrize(
    ("fault", "sentence"),
    [
        (
            "value-error",
            r"recipe 'foreign' cannot build a model with the arguments \{\}: width must be a multiple",
        ),
        ("random", r"recipe 'foreign' builds different initial values each time \(weight differs"),
    ],
)
def test_run_create_refuses_a_recipes_own_error_and_a_non_deterministic_build(monkeypatch, fault, sentence):
    monkeypatch.setitem(registry.BUILTINS, "foreign", _Foreign("foreign", fault))
    with pytest.raises(RecipeError, match=sentence):
        param_hash_of({"recipe": "foreign", "args": {}}, "tokens")


def test_a_deterministic_recipe_of_the_right_kind_passes(monkeypatch):
    monkeypatch.setitem(registry.BUILTINS, "foreign", _Foreign("foreign", "none"))
    assert len(param_hash_of({"recipe": "foreign", "args": {}}, "tokens")) == 64
