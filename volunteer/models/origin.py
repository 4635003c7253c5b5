"""Where a recipe comes from: the distribution that installs it, its version, and a hash of its code.

A run spec names the recipe's distribution and version (``model.package``, e.g. ``my-recipes==1.2.0``) and
the sha256 of the recipe's source files (``model.code_hash``). Two versions of a recipe with the same
parameter shapes but another ``forward`` or ``loss`` would otherwise train together undetected; a volunteer
whose installed recipe differs is refused with a sentence saying what to install (:func:`check_origin`).

The code hashed is the source of every module the recipe is made of: the entry point's module, the
recipe's class, and for a :func:`~crowdtrain.volunteer.models.recipe.wrap`-ped module its ``make``,
``loss`` and ``metrics`` (torch's own modules are left out: torch is checked by the initial values' hash).
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from importlib.metadata import entry_points
from pathlib import Path

from crowdtrain import __version__
from crowdtrain.protocol.errors import RecipeError
from crowdtrain.volunteer.models.recipe import Recipe
from crowdtrain.volunteer.models.registry import BUILTINS, GROUP, recipe_source


def package_of(name: str) -> str:
    """``dist==version`` of the distribution that provides recipe ``name`` (``crowdtrain==X`` for a
    built-in; ``""`` when the entry point's distribution is unknown)."""
    source = recipe_source(name)
    if source.builtin:
        return f"crowdtrain=={__version__}"
    return f"{source.distribution}=={source.version}" if source.distribution else ""


def _modules(name: str, recipe: Recipe) -> set[str]:
    modules = {type(recipe).__module__}
    for ep in entry_points(group=GROUP):
        if ep.name == name and name not in BUILTINS:
            modules.add(ep.module)
    for attr in ("make", "loss_fn", "metrics_fn"):
        part = getattr(recipe, attr, None)
        if part is not None and getattr(part, "__module__", None):
            modules.add(part.__module__)
    if type(recipe).__module__.startswith("crowdtrain.") or any(m.startswith("crowdtrain.") for m in modules):
        modules.add("crowdtrain.volunteer.models.recipe")  # TableRecipe and wrap build the model
    return {m for m in modules if m.split(".")[0] not in ("torch", "builtins", "functools")}


def code_hash(name: str, recipe: Recipe) -> str:
    """sha256 hex over the source files of the modules the recipe is made of, by module name."""
    h = hashlib.sha256()
    for module_name in sorted(_modules(name, recipe)):
        module = sys.modules.get(module_name)
        try:
            path = inspect.getsourcefile(module) if module is not None else None
            source = Path(path).read_bytes() if path else b""
        except (OSError, TypeError):
            source = b""  # a module without source (compiled): its name still counts
        h.update(f"{module_name}\n{len(source)}\n".encode())
        h.update(source)
    return h.hexdigest()


def check_origin(name: str, recipe: Recipe, package: str, expected_hash: str) -> None:
    """A volunteer's check of its installed recipe against the spec's ``package`` and ``code_hash`` (both
    ``""`` in specs made before they existed: nothing to check)."""
    if not expected_hash or code_hash(name, recipe) == expected_hash:
        return
    here = package_of(name) or "an unknown distribution"
    wanted = package or "the publisher's version"
    if package and here == package:
        raise RecipeError(
            f"the local recipe {name!r} comes from {here}, as the run's, but its code differs from the "
            f"publisher's (an edited or other build of {here}); reinstall it (pip install --force-reinstall "
            f"{package}) and join again"
        )
    raise RecipeError(
        f"the run trains recipe {name!r} from {wanted}, but this machine has {here}, whose code differs; "
        f"install {wanted} (pip install {package or '…'}) and join again"
    )
