"""Finding a recipe by name: the built-ins first, then the ``crowdtrain.models`` entry-point group.

A package adds a recipe by declaring, in its own ``pyproject.toml``::

    [project.entry-points."crowdtrain.models"]
    my-model = "my_package.recipes:MY_RECIPE"

where ``MY_RECIPE`` is a :class:`~crowdtrain.volunteer.models.recipe.Recipe` (or a class or function
returning one). The entry point's name is the recipe's name in run specs. A built-in name cannot be
taken over by an installed package: the built-ins are looked up first.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points

from crowdtrain.protocol.errors import RecipeError
from crowdtrain.volunteer.models.gpt import TINY_GPT
from crowdtrain.volunteer.models.mlp import MLP
from crowdtrain.volunteer.models.recipe import Recipe

GROUP = "crowdtrain.models"
BUILTINS: dict[str, Recipe] = {TINY_GPT.name: TINY_GPT, MLP.name: MLP}

_REQUIRED = ("name", "kind", "default_args", "validate_args", "build", "loss")


def known_recipes() -> list[str]:
    """Names of the built-in recipes and of those installed through the entry-point group."""
    names = list(BUILTINS)
    names += sorted({ep.name for ep in entry_points(group=GROUP)} - set(BUILTINS))
    return names


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; :class:`RecipeError` if none is installed or it does not load."""
    if name in BUILTINS:
        return BUILTINS[name]
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            return _load(ep)
    raise RecipeError(
        f"No model recipe named {name!r} is installed; known recipes: {', '.join(known_recipes())}. "
        f"Install the package that provides {name!r} (it registers in the {GROUP!r} entry-point group)."
    )


@dataclass(frozen=True, slots=True)
class RecipeSource:
    """Where an installed recipe comes from: crowdtrain itself, or an entry point of an installed package."""

    name: str
    builtin: bool
    distribution: str | None = None  # the installed package providing it, e.g. "crowdtrain-example-recipes"
    version: str | None = None  # that package's version
    entry_point: str | None = None  # "module:attribute"

    def __str__(self) -> str:
        if self.builtin:
            return "built-in"
        if self.distribution:
            return f"{self.distribution} {self.version}" if self.version else self.distribution
        return f"entry point {self.entry_point}"


def recipe_source(name: str) -> RecipeSource:
    """Where the recipe :func:`get_recipe` would load for ``name`` comes from (without loading it)."""
    if name in BUILTINS:
        return RecipeSource(name, builtin=True)
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            dist = getattr(ep, "dist", None)  # None for an entry point not read from installed metadata
            return RecipeSource(
                name,
                builtin=False,
                distribution=dist.name if dist is not None else None,
                version=dist.version if dist is not None else None,
                entry_point=ep.value,
            )
    raise RecipeError(
        f"No model recipe named {name!r} is installed; known recipes: {', '.join(known_recipes())}."
    )


def _load(ep) -> Recipe:
    where = f"{ep.value} (entry point {ep.name!r} in group {GROUP!r})"
    try:
        obj = ep.load()
        recipe = obj() if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "build")) else obj
    except Exception as exc:  # foreign code: translate whatever it raises at the edge
        raise RecipeError(f"The model recipe {ep.name!r} failed to load from {where}: {exc!r}.") from exc
    missing = [attr for attr in _REQUIRED if not hasattr(recipe, attr)]
    if missing:
        raise RecipeError(
            f"The model recipe {ep.name!r} from {where} is not a recipe: it lacks {', '.join(missing)}."
        )
    if recipe.name != ep.name:
        raise RecipeError(
            f"The model recipe loaded from {where} calls itself {recipe.name!r}, not {ep.name!r}; "
            "the entry point's name and the recipe's name must be equal."
        )
    if recipe.kind not in ("tokens", "arrays"):
        raise RecipeError(
            f"The model recipe {ep.name!r} declares data-set kind {recipe.kind!r}; it must be 'tokens' or 'arrays'."
        )
    return recipe
