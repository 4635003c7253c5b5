"""Model recipes: the built-ins ``tiny-gpt`` and ``mlp``, and the ``crowdtrain.models`` entry-point group.

``get_recipe(name)`` finds a recipe; ``recipe.build(args)`` makes its model with deterministic initial
parameters; ``param_hash(model)`` is the parameter-schema hash pinned in the run spec and
``check_param_hash(model, expected)`` refuses a mismatch with a sentence saying what differs. ``wrap(name,
kind, make, ...)`` makes a recipe of an existing ``nn.Module`` class (see docs/recipes.md).
"""

from __future__ import annotations

from crowdtrain.protocol.errors import RecipeError
from crowdtrain.volunteer.models.gpt import TINY_GPT, TinyGPT
from crowdtrain.volunteer.models.mlp import MLP, MLPModel
from crowdtrain.volunteer.models.recipe import (
    Arg,
    ModuleRecipe,
    Recipe,
    TableRecipe,
    check_param_hash,
    param_hash,
    param_schema,
    wrap,
)
from crowdtrain.volunteer.models.registry import BUILTINS, GROUP, get_recipe, known_recipes

__all__ = [
    "BUILTINS",
    "GROUP",
    "MLP",
    "TINY_GPT",
    "Arg",
    "MLPModel",
    "ModuleRecipe",
    "Recipe",
    "RecipeError",
    "TableRecipe",
    "TinyGPT",
    "check_param_hash",
    "get_recipe",
    "known_recipes",
    "param_hash",
    "param_schema",
    "wrap",
]
