"""``crowdtrain recipes [NAME]``: the model recipes installed on this machine, as text or JSON.

Each recipe with its data-set kind, where it comes from (built in, or the installed package whose entry point
in the ``crowdtrain.models`` group provides it) and its arguments: default, and where the recipe has a table
of :class:`~crowdtrain.volunteer.models.recipe.Arg` (``TableRecipe``, ``wrap``'s ``ModuleRecipe``) their
type, range or choices and help. A recipe that fails to load is listed with its error sentence.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import typer

from crowdtrain.commands.common import wants_json
from crowdtrain.protocol.errors import RecipeError


def describe_args(recipe: Any) -> list[dict[str, Any]]:
    """One dict per argument: name, type, default, min, max, choices, help (None where the recipe has no
    :class:`Arg` table to say them: then the type is the default's)."""
    from crowdtrain.volunteer.models.recipe import Arg

    table = getattr(recipe, "table", None)
    if isinstance(table, Mapping) and all(isinstance(a, Arg) for a in table.values()):
        return [
            {
                "name": name,
                "type": a.type.__name__,
                "default": a.default,
                "min": _whole(a.min, a.type),
                "max": _whole(a.max, a.type),
                "choices": list(a.choices),
                "help": a.help,
            }
            for name, a in table.items()
        ]
    return [
        {"name": name, "type": type(value).__name__, "default": value, "min": None, "max": None,
         "choices": [], "help": None}
        for name, value in dict(recipe.default_args).items()
    ]  # fmt: skip


def _whole(bound: float | None, kind: type) -> float | int | None:
    """A bound as the argument's own type shows it: ``1`` for an int argument, not ``1.0``."""
    if kind is int and isinstance(bound, float) and bound.is_integer():
        return int(bound)
    return bound


def recipe_info(name: str) -> dict[str, Any]:
    """What ``crowdtrain recipes`` says of one installed recipe; ``error`` is its sentence if it fails to load."""
    from crowdtrain.volunteer.models.registry import get_recipe, recipe_source

    source = recipe_source(name)
    info: dict[str, Any] = {
        "name": name,
        "kind": None,
        "source": str(source),
        "builtin": source.builtin,
        "distribution": source.distribution,
        "version": source.version,
        "entry_point": source.entry_point,
        "args": [],
        "error": None,
    }
    try:
        recipe = get_recipe(name)
        info["kind"] = recipe.kind
        info["args"] = describe_args(recipe)
    except RecipeError as exc:
        info["error"] = str(exc)
    except Exception as exc:  # a package's own code (its default_args): said in one sentence
        info["error"] = f"The model recipe {name!r} cannot say its arguments: {type(exc).__name__}: {exc}."
    return info


def _range(arg: dict[str, Any]) -> str:
    if arg["choices"]:
        return "one of " + ", ".join(map(str, arg["choices"]))
    low, high = arg["min"], arg["max"]
    if low is not None and high is not None:
        return f"{low} to {high}"
    if low is not None:
        return f"≥ {low}"
    if high is not None:
        return f"≤ {high}"
    return ""


def format_recipe(info: dict[str, Any]) -> str:
    """The text block of one recipe: a title line, then a table of its arguments (or its error)."""
    where = "built-in" if info["builtin"] else f"from {info['source']} ({info['entry_point']})"
    if info["error"] is not None:
        return f"{info['name']}: does not load, {where}\n  {info['error']}"
    lines = [f"{info['name']}: {info['kind']}, {where}"]
    rows = [("argument", "type", "default", "range", "help")]
    rows += [
        (a["name"], a["type"], json.dumps(a["default"]), _range(a), a["help"] or "") for a in info["args"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        cells = [cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)]
        lines.append(("  " + "  ".join([*cells, row[4]])).rstrip())
    if not info["args"]:
        lines.append("  (no arguments)")
    return "\n".join(lines)


def recipes(
    ctx: typer.Context,
    name: str | None = typer.Argument(None, help="Show only this recipe."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON list (one object per recipe)."),
) -> None:
    """List the model recipes installed here (built-ins and packages' entry points) with their arguments."""
    from crowdtrain.volunteer.models.registry import known_recipes

    names = [name] if name is not None else known_recipes()
    infos = [recipe_info(n) for n in names]  # an unknown NAME: a RecipeError sentence, exit 1
    if wants_json(ctx, json_out):
        typer.echo(json.dumps(infos, indent=2, ensure_ascii=False))
    else:
        typer.echo("\n\n".join(format_recipe(info) for info in infos))
    if name is not None and infos[0]["error"] is not None:
        raise typer.Exit(1)  # asked for one recipe, and it does not load
