"""What a model recipe is: the protocol, a table of typed arguments, and the parameter-schema hash.

A recipe turns a run spec's ``model.args`` into a ``torch.nn.Module`` and says how to compute the mean loss
of a micro-batch. Recipes are installed code (the built-ins, or packages registered in the
``crowdtrain.models`` entry-point group); nothing in a run spec is ever executed.

Every volunteer must start from the same parameters, so a recipe's ``build`` initialises them from a local
``torch.Generator`` seeded by the ``seed`` argument, never from the global RNG. The parameter hash
(names, shapes, dtypes; see :func:`param_hash`) is pinned in the run spec; a volunteer whose local recipe
builds something else refuses to join (:func:`check_param_hash`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from crowdtrain.protocol.errors import RecipeError

Kind = Literal["tokens", "arrays"]
ArgValue = int | float | str | bool


@runtime_checkable
class Recipe(Protocol):
    """A model recipe. Third-party recipes registered under ``crowdtrain.models`` provide these members.

    ``build`` and ``validate_args`` take the run spec's args (missing keys take ``default_args``);
    ``loss(model, x, y)`` returns the *mean* loss over the micro-batch's samples (a 0-d tensor).
    """

    name: str
    kind: Kind  # the data-set kind the recipe trains on

    @property
    def default_args(self) -> dict[str, ArgValue]: ...

    def validate_args(self, args: Mapping[str, Any]) -> dict[str, ArgValue]: ...

    def build(self, args: Mapping[str, Any]) -> torch.nn.Module: ...

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Arg:
    """One typed recipe argument with its default and its allowed range or choices."""

    type: type
    default: ArgValue
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()

    def check(self, recipe: str, name: str, value: Any) -> ArgValue:
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if self.type is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if type(value) is not self.type:  # bool is an int subclass: compare exact types
            raise RecipeError(
                f"Recipe {recipe!r}: argument {name!r} must be a {self.type.__name__} ({self.help}), "
                f"got {value!r}; fix model.args in the run spec."
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise RecipeError(f"Recipe {recipe!r}: argument {name!r} must be finite, got {value!r}.")
        if self.min is not None and value < self.min:
            raise RecipeError(f"Recipe {recipe!r}: argument {name!r} must be ≥ {self.min:g}, got {value!r}.")
        if self.max is not None and value > self.max:
            raise RecipeError(f"Recipe {recipe!r}: argument {name!r} must be ≤ {self.max:g}, got {value!r}.")
        if self.choices and value not in self.choices:
            raise RecipeError(
                f"Recipe {recipe!r}: argument {name!r} must be one of {', '.join(self.choices)}, got {value!r}."
            )
        return value


@dataclass(frozen=True, slots=True)
class TableRecipe:
    """A recipe whose arguments are described by a table of :class:`Arg` (what the built-ins use).

    Subclasses provide ``_make(args)`` (the module, built on the meta device so no RNG is touched),
    ``_init(name, shape, args, generator)`` (each parameter's initial value) and ``loss``. Optional
    ``_check(args)`` validates relations between arguments.
    """

    name: str
    kind: Kind
    table: Mapping[str, Arg] = field(default_factory=dict)

    @property
    def default_args(self) -> dict[str, ArgValue]:
        return {k: a.default for k, a in self.table.items()}

    def validate_args(self, args: Mapping[str, Any]) -> dict[str, ArgValue]:
        unknown = sorted(set(args) - set(self.table))
        if unknown:
            raise RecipeError(
                f"Recipe {self.name!r} has no argument {', '.join(map(repr, unknown))}; "
                f"its arguments are {', '.join(self.table)}."
            )
        out = {k: a.check(self.name, k, args.get(k, a.default)) for k, a in self.table.items()}
        self._check(out)
        return out

    def build(self, args: Mapping[str, Any]) -> torch.nn.Module:
        full = self.validate_args(args)
        with torch.device("meta"):  # shapes only: allocating here touches no RNG and costs nothing
            model = self._make(full)
        model = model.to_empty(device="cpu")
        generator = torch.Generator(device="cpu").manual_seed(int(full.get("seed", 0)))
        with torch.no_grad():
            # Sorted names: the initial values depend on the parameter schema only, not on module order.
            for pname, p in sorted(model.named_parameters()):
                p.copy_(self._init(pname, tuple(p.shape), full, generator))
        # Normalisation layers fill their buffers themselves (running statistics: mean 0, variance 1, count 0);
        # any other buffer a meta-device build cannot fill.
        filled = set()
        for prefix, module in model.named_modules():
            if hasattr(module, "reset_running_stats"):
                module.reset_running_stats()
                filled |= {f"{prefix}.{n}" if prefix else n for n, _ in module.named_buffers(recurse=False)}
        if unfilled := [n for n, _ in model.named_buffers() if n not in filled]:
            raise RecipeError(
                f"Recipe {self.name!r} registers buffers ({', '.join(unfilled[:3])}) that a meta-device build "
                "cannot fill; only normalisation layers' running statistics can be"
            )
        model.crowdtrain_recipe = self.name  # read by check_param_hash's message
        model.crowdtrain_args = full
        return model

    def _make(self, args: dict[str, ArgValue]) -> torch.nn.Module:
        raise NotImplementedError

    def _init(
        self, name: str, shape: tuple[int, ...], args: dict[str, ArgValue], generator: torch.Generator
    ) -> torch.Tensor:
        raise NotImplementedError

    def _check(self, args: dict[str, ArgValue]) -> None:
        return None

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def uniform(shape: tuple[int, ...], bound: float, generator: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2.0 - 1.0) * bound


def param_schema(model: torch.nn.Module) -> list[str]:
    """One line per parameter, sorted by name: ``name shape dtype`` (e.g. ``wte.weight 256,64 float32``)."""
    lines = []
    for name, p in sorted(model.named_parameters()):
        dtype = str(p.dtype).removeprefix("torch.")
        lines.append(f"{name} {','.join(str(d) for d in p.shape)} {dtype}")
    return lines


def param_hash(model: torch.nn.Module) -> str:
    """sha256 hex of the parameter schema: sorted names, shapes and dtypes (not the values)."""
    return hashlib.sha256("\n".join(param_schema(model)).encode()).hexdigest()


def check_param_hash(
    model: torch.nn.Module,
    expected: str,
    *,
    recipe: str | None = None,
    args: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`RecipeError` unless ``model``'s parameter hash equals the run spec's ``expected``."""
    recipe = recipe if recipe is not None else getattr(model, "crowdtrain_recipe", type(model).__name__)
    args = args if args is not None else getattr(model, "crowdtrain_args", {})
    shown = ", ".join(f"{k}={v!r}" for k, v in args.items()) or "no args"
    if not expected:
        raise RecipeError(
            f"The run spec has no parameter hash, so the local recipe {recipe!r} ({shown}) cannot be checked "
            "against it; ask the publisher to re-create the run with `crowdtrain run create`."
        )
    actual = param_hash(model)
    if actual != expected.lower():
        n_tensors = sum(1 for _ in model.parameters())
        n_values = sum(p.numel() for p in model.parameters())
        raise RecipeError(
            f"The local recipe {recipe!r} ({shown}) builds parameters with hash {actual[:16]}… "
            f"({n_tensors} tensors, {n_values:,} values), but the run's spec expects {expected[:16]}…; "
            "this machine's recipe differs from the publisher's. Install the same crowdtrain version "
            f"(or the same package that provides {recipe!r}) as the publisher and join again."
        )
