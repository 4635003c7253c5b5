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
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from crowdtrain.protocol.errors import RecipeError

Kind = Literal["tokens", "arrays"]
ArgValue = int | float | str | bool

# torch's global RNG is one for the whole process: a wrapped build holds it from its seed to its last draw,
# or two builds in threads at once (two volunteers of one process) interleave their draws
_GLOBAL_RNG = threading.Lock()


@runtime_checkable
class Recipe(Protocol):
    """A model recipe. Third-party recipes registered under ``crowdtrain.models`` provide these members.

    ``build`` and ``validate_args`` take the run spec's args (missing keys take ``default_args``);
    ``loss(model, x, y)`` returns the *mean* loss over the micro-batch's samples (a 0-d tensor). A recipe
    may also have ``metrics(model, x, y) -> dict[str, float]`` (means over the batch, e.g. accuracy), which
    volunteers report on the run's held-out split (docs/recipes.md).
    """

    # read-only here, so that a frozen dataclass or a plain class attribute provides them
    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> Kind:  # the data-set kind the recipe trains on
        ...

    @property
    def default_args(self) -> dict[str, ArgValue]: ...

    def validate_args(self, args: Mapping[str, Any]) -> dict[str, ArgValue]: ...

    def build(self, args: Mapping[str, Any]) -> torch.nn.Module: ...

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Arg:
    """One typed recipe argument with its default and its allowed range or choices."""

    type: type[ArgValue]
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
        if isinstance(value, int | float) and self.min is not None and value < self.min:
            raise RecipeError(f"Recipe {recipe!r}: argument {name!r} must be ≥ {self.min:g}, got {value!r}.")
        if isinstance(value, int | float) and self.max is not None and value > self.max:
            raise RecipeError(f"Recipe {recipe!r}: argument {name!r} must be ≤ {self.max:g}, got {value!r}.")
        if self.choices and value not in self.choices:
            raise RecipeError(
                f"Recipe {recipe!r}: argument {name!r} must be one of {', '.join(self.choices)}, got {value!r}."
            )
        return value


def check_table(recipe: str, table: Mapping[str, Arg], args: Mapping[str, Any]) -> dict[str, ArgValue]:
    """``args`` checked against ``table``: no unknown names, each value of its type and range, defaults filled."""
    unknown = sorted(set(args) - set(table))
    if unknown:
        raise RecipeError(
            f"Recipe {recipe!r} has no argument {', '.join(map(repr, unknown))}; its arguments are {', '.join(table)}."
        )
    return {k: a.check(recipe, k, args.get(k, a.default)) for k, a in table.items()}


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
        out = check_table(self.name, self.table, args)
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
        _label(model, self.name, full)
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

    def metrics(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Metrics beside the loss on a held-out batch (``{}``: none); see :func:`accuracy`."""
        return {}


LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
MetricsFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], Mapping[str, float]]
SEED = Arg(int, 0, "seed of the initial parameters", min=0, max=2**63 - 1)


def _label(model: torch.nn.Module, recipe: str, args: dict[str, ArgValue]) -> None:
    """Name the recipe and args that built ``model``, for :func:`check_param_hash`'s message."""
    # torch's stub allows tensors and modules only; nn.Module keeps any other value as a plain attribute
    model.crowdtrain_recipe = recipe  # type: ignore[assignment]
    model.crowdtrain_args = args  # type: ignore[assignment]


def cross_entropy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model(x)`` against class ids ``y``: logits ``(B, C)`` with ``y`` of shape
    ``(B,)``, or per-token logits ``(B, T, V)`` with ``y`` of shape ``(B, T)``."""
    logits = model(x)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1).long()
    )


def mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of ``model(x)`` against ``y`` (cast to float32, shaped like the output)."""
    out = model(x).float()
    return torch.nn.functional.mse_loss(out, y.float().reshape(out.shape))


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """``{"accuracy": share of argmax predictions equal to y}`` (per sample, or per token)."""
    logits = model(x)
    hits = logits.reshape(-1, logits.shape[-1]).argmax(-1) == y.reshape(-1).long()
    return {"accuracy": float(hits.float().mean())}


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}
METRICS: dict[str, MetricsFn] = {"accuracy": accuracy}


@dataclass(frozen=True, slots=True)
class ModuleRecipe:
    """A recipe around an existing ``nn.Module`` class or factory (what :func:`wrap` returns).

    ``build`` calls ``make(**args)`` (every argument but ``seed``) inside a forked global RNG seeded by
    ``seed``, so the module's own default initialisation gives every volunteer the same values; the model is
    float32 on the CPU. Builds in one process take turns (the global RNG is the process's); other code that
    draws from it meanwhile (a model with dropout training in another thread) would still change the values,
    which the volunteer's ``init_hash`` check then refuses.
    """

    name: str
    kind: Kind
    make: Callable[..., torch.nn.Module]
    loss_fn: LossFn
    table: Mapping[str, Arg]
    metrics_fn: MetricsFn | None = None

    @property
    def default_args(self) -> dict[str, ArgValue]:
        return {k: a.default for k, a in self.table.items()}

    def validate_args(self, args: Mapping[str, Any]) -> dict[str, ArgValue]:
        return check_table(self.name, self.table, args)

    def build(self, args: Mapping[str, Any]) -> torch.nn.Module:
        full = self.validate_args(args)
        kwargs = {k: v for k, v in full.items() if k != "seed"}
        with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):  # the caller's RNG is left as it was
            torch.manual_seed(int(full["seed"]))
            model = self.make(**kwargs)
        if not isinstance(model, torch.nn.Module):
            raise RecipeError(
                f"Recipe {self.name!r}: make(**args) returned {type(model).__name__}, not an nn.Module."
            )
        model = model.to(device="cpu", dtype=torch.float32)
        _label(model, self.name, full)
        return model

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(model, x, y)

    def metrics(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        return dict(self.metrics_fn(model, x, y)) if self.metrics_fn is not None else {}


def wrap(
    name: str,
    kind: Kind,
    make: Callable[..., torch.nn.Module],
    *,
    loss: str | LossFn = "cross_entropy",
    args: Mapping[str, ArgValue | Arg] | None = None,
    metrics: str | MetricsFn | None = None,
) -> ModuleRecipe:
    """A recipe for an existing module: ``wrap("my-cnn", "arrays", MyCNN, args={"width": 32})``.

    ``make`` is the module class (or any function returning a module), called with the run spec's arguments
    as keywords. ``args`` maps each argument to its default (its type is the default's type) or to an
    :class:`Arg` with a range; a ``seed`` argument is added when absent. ``loss`` is ``"cross_entropy"``
    (logits against class or token ids), ``"mse"``, or a function ``loss(model, x, y)`` returning the mean loss.
    ``metrics`` is ``"accuracy"`` or a function ``metrics(model, x, y)`` returning ``{name: float}``, reported
    on the run's held-out split.
    """
    if kind not in ("tokens", "arrays"):
        raise RecipeError(f"Recipe {name!r}: kind must be 'tokens' or 'arrays', got {kind!r}.")
    table: dict[str, Arg] = {}
    for key, value in (args or {}).items():
        if isinstance(value, Arg):
            table[key] = value
        elif isinstance(value, bool | int | float | str):
            table[key] = Arg(type(value), value, f"argument of {getattr(make, '__name__', 'make')}")
        else:
            raise RecipeError(
                f"Recipe {name!r}: the default of argument {key!r} must be a bool, int, float or str."
            )
    table.setdefault("seed", SEED)
    loss_fn = LOSSES.get(loss) if isinstance(loss, str) else loss
    if loss_fn is None:
        raise RecipeError(
            f"Recipe {name!r}: loss {loss!r} is not one of {', '.join(LOSSES)} (or a function)."
        )
    metrics_fn = METRICS.get(metrics) if isinstance(metrics, str) else metrics
    if isinstance(metrics, str) and metrics_fn is None:
        raise RecipeError(
            f"Recipe {name!r}: metrics {metrics!r} is not one of {', '.join(METRICS)} (or a function)."
        )
    return ModuleRecipe(name=name, kind=kind, make=make, loss_fn=loss_fn, table=table, metrics_fn=metrics_fn)


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
