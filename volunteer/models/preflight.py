"""A recipe's pre-flight: what ``run create`` checks before any volunteer sees a run, and what every volunteer
checks again before it computes.

Each check ends in one :class:`RecipeError` sentence naming the recipe and what to change, never in the
recipe's traceback: a recipe of another kind than the data set, arguments its own code refuses, a token
recipe without a ``seq_len`` (the sampler cuts windows of ``seq_len + 1`` tokens), token ids beyond its
``vocab``, a build whose initial values differ from one build to the next, and a micro-batch of the data set
that its ``loss`` cannot take (or that gives no finite 0-d loss, or no gradient).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from crowdtrain.protocol.errors import CrowdtrainError, RecipeError
from crowdtrain.volunteer.models.recipe import ArgValue, Recipe


def resolved_args(recipe: Recipe, args: Mapping[str, Any]) -> dict[str, ArgValue]:
    """The recipe's whole argument set: ``args`` with its defaults filled in, as the recipe validates them."""
    try:
        return dict(recipe.validate_args(dict(args)))
    except CrowdtrainError:
        raise
    except Exception as exc:  # the recipe's own code: its error, said in one sentence
        raise RecipeError(f"recipe {recipe.name!r} refuses the arguments {dict(args)}: {exc}") from None


def check_kind(recipe: Recipe, dataset_kind: str) -> None:
    if recipe.kind != dataset_kind:
        raise RecipeError(
            f"recipe {recipe.name!r} trains on {recipe.kind} data sets, but this run's data set holds "
            f"{dataset_kind}; choose a recipe of that kind or another data set"
        )


def window(recipe: Recipe, args: Mapping[str, Any]) -> int | None:
    """Tokens per training window (the ``seq_len`` argument) for a token recipe; None for an arrays one."""
    if recipe.kind != "tokens":
        return None
    seq_len = args.get("seq_len")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise RecipeError(
            f"recipe {recipe.name!r} trains on tokens but has no whole-number argument 'seq_len' ≥ 1 "
            f"(got {seq_len!r}); a token recipe names its context length seq_len, as the sampler cuts windows "
            "of seq_len + 1 tokens from it"
        )
    return seq_len


def vocab_of(recipe: Recipe, args: Mapping[str, Any]) -> int | None:
    """A token recipe's vocabulary size (its ``vocab`` argument), which every token id must stay below."""
    vocab = args.get("vocab")
    if recipe.kind == "tokens" and isinstance(vocab, int) and not isinstance(vocab, bool):
        return vocab
    return None


def check_token_ids(recipe: Recipe, args: Mapping[str, Any], max_id: int, where: str) -> None:
    vocab = vocab_of(recipe, args)
    if vocab is not None and max_id >= vocab:
        raise RecipeError(
            f"{where} holds token id {max_id}, but recipe {recipe.name!r} has vocab = {vocab} (ids 0 to "
            f"{vocab - 1}); set model.args.vocab to at least {max_id + 1} or remake the data set with a "
            "smaller vocabulary"
        )


def build(recipe: Recipe, args: Mapping[str, Any]) -> torch.nn.Module:
    try:
        return recipe.build(dict(args))
    except CrowdtrainError:
        raise
    except Exception as exc:  # the recipe's own code: its error, said in one sentence
        raise RecipeError(
            f"recipe {recipe.name!r} cannot build a model with the arguments {dict(args)}: {exc}"
        ) from None


def initial_hash(model: torch.nn.Module) -> str:
    """sha256 hex of the model's initial values: every parameter and buffer, by sorted name, with its dtype
    and shape. Pinned in the run spec (``model.init_hash``) so a volunteer whose recipe (or torch) builds other
    values than the publisher's is told before it trains a different model."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def check_initial_hash(recipe: Recipe, model: torch.nn.Module, expected: str) -> None:
    """A volunteer's check of its build against the spec's ``init_hash`` ("" in specs made before it)."""
    if expected and initial_hash(model) != expected:
        raise RecipeError(
            f"the local recipe {recipe.name!r} builds other initial values than the publisher's (the run's "
            f"init_hash is {expected[:16]}…), so this machine would train another model; install the same "
            f"version of the package providing {recipe.name!r} (and of torch) as the publisher and join again"
        )


def check_deterministic(recipe: Recipe, args: Mapping[str, Any], model: torch.nn.Module) -> None:
    """Build again and compare every value: a build that draws from the global RNG (or the clock) would give
    each volunteer a different model."""
    first, second = model.state_dict(), build(recipe, args).state_dict()
    differ = [k for k in first if k not in second or not torch.equal(first[k], second[k])]
    if differ:
        raise RecipeError(
            f"recipe {recipe.name!r} builds different initial values each time ({differ[0]} differs between two "
            "builds), so every volunteer would train a different model; draw them from a generator seeded by "
            "the arguments (or use crowdtrain.volunteer.models.wrap, which seeds the build)"
        )


def check_micro_batch(recipe: Recipe, model: torch.nn.Module, x: np.ndarray, y: np.ndarray | None) -> float:
    """One micro-batch of the data set through the recipe's ``loss`` and a backward pass; returns the loss.

    The gradients it leaves are cleared. The model is the caller's: build a copy for this if it must stay
    untouched (its buffers, e.g. BatchNorm's running statistics, move by one forward pass)."""
    shown = f"x {x.dtype} {tuple(x.shape)}" + (
        f", y {y.dtype} {tuple(y.shape)}" if y is not None else ", no y"
    )
    if y is None:
        raise RecipeError(
            f"recipe {recipe.name!r} needs labelled samples (x, y), but this data set has no labels; use a "
            "recipe for unlabelled data or a data set made with labels"
        )
    model.train()
    try:
        loss = recipe.loss(
            model, torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
        )
    except CrowdtrainError:
        raise
    except Exception as exc:  # the recipe's own code on the data set's samples
        raise RecipeError(
            f"recipe {recipe.name!r} fails on a micro-batch of this data set ({shown}): {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise RecipeError(
            f"recipe {recipe.name!r}'s loss must return the mean loss of the micro-batch as a 0-d float tensor, "
            f"got {got} ({shown})"
        )
    if not torch.isfinite(loss):
        raise RecipeError(
            f"recipe {recipe.name!r}'s loss is {float(loss.detach())} on a micro-batch of this data set ({shown})"
        )
    if not loss.requires_grad:
        raise RecipeError(
            f"recipe {recipe.name!r}'s loss does not depend on the model's parameters (no gradient flows), so "
            "training would change nothing"
        )
    try:
        loss.backward()
    except Exception as exc:
        raise RecipeError(
            f"recipe {recipe.name!r}'s loss cannot be differentiated: {type(exc).__name__}: {exc}"
        ) from None
    if all(p.grad is None for p in model.parameters()):
        raise RecipeError(
            f"recipe {recipe.name!r}'s loss gives no parameter a gradient; training would change nothing"
        )
    model.zero_grad(set_to_none=True)
    return float(loss.detach())
