"""Reference computations the distributed results are checked against: what a collaborative run must equal.

:func:`replay_reference` replays a run's global steps in one process with the product's own
:class:`~crowdtrain.volunteer.trainer.Trainer`; :func:`weighted_mean` is the all-reduce's part reducer in
plain numpy. They live here, beside the tests, because nothing in the product calls them: they are the
strongest check this field has (the distributed step equals one large batch), not a feature.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from crowdtrain.protocol.messages import OptimizerSpec, ScheduleSpec
from crowdtrain.volunteer.models.recipe import Recipe
from crowdtrain.volunteer.models.registry import get_recipe
from crowdtrain.volunteer.trainer import Trainer

REPLAY_STRAYS = 8  # see assert_replayed


def weighted_mean(grads: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``Σ (w_i / Σ w) · g_i`` in float32, accumulated in the given order (zeros when all weights are 0).

    The same arithmetic as the all-reduce's part reducer (``volunteer/averaging/reducer.py``)."""
    out = np.zeros_like(np.asarray(grads[0], dtype=np.float32))
    total = math.fsum(weights)
    if total <= 0:
        return out
    for g, w in zip(grads, weights, strict=True):
        if w > 0:
            out += np.float32(w / total) * np.asarray(g, dtype=np.float32)
    return out


def assert_replayed(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """A distributed run's parameters equal a single-process replay's: every value within 1e-5, but for at most
    ``REPLAY_STRAYS`` values, which must be within 1e-4.

    The run sums float32 contributions in another order than the replay (groups, phases, parts), and Adam
    divides each gradient by its own magnitude: where a gradient is near zero (~1e-9, a rare token's
    embedding), a last-bit difference in the sum moves that one value's update by ~1e-5 (seen in CI, one value
    of 29,888; on a loaded machine, 5 values by at most 1.7e-5 after the fifth round of local steps, whose
    samples per volunteer follow the timing). A wrong rule moves most values (a learning rate keyed one step
    off: 82 % of them, by up to 4e-2), so this still tells the rule apart."""
    diff = np.abs(np.asarray(actual, dtype=np.float64) - np.asarray(expected, dtype=np.float64))
    strays = np.flatnonzero(~(diff <= 1e-5))  # (NaN counts as a stray)
    assert strays.size <= REPLAY_STRAYS and bool((diff[strays] <= 1e-4).all()), (
        f"{what}: {strays.size} of {diff.size} values differ by more than 1e-5 from the replay (at most "
        f"{REPLAY_STRAYS} may, by at most 1e-4); the largest difference is {np.nanmax(diff):.3g} at "
        f"{int(np.nanargmax(diff))}"
    )


def mean_gradient(trainer: Trainer) -> np.ndarray:
    """The trainer's mean gradient over what it accumulated, as a new array, through the product's own hand-over
    (:meth:`Trainer.take_grad`, which also starts a new accumulation)."""
    return trainer.take_grad(np.empty(trainer.numel, dtype=np.float32))


def mean_loss(trainer: Trainer, x: Any, y: Any) -> float:
    """The mean loss of one batch, through the product's held-out evaluation in one micro-batch (it leaves the
    accumulation alone)."""
    return trainer.evaluate_with_metrics(x, y, micro=int(x.shape[0]))[0]


def replay_reference(
    recipe: Recipe | str,
    args: Mapping[str, Any],
    optimizer_spec: OptimizerSpec,
    schedule_spec: ScheduleSpec,
    steps: Sequence[Sequence[Any]],
    *,
    start_step: int = 0,
    initial_params: np.ndarray | None = None,
    by_volunteer: bool = False,
    combine: Callable[[Sequence[np.ndarray], Sequence[float]], np.ndarray] = weighted_mean,
    device: str = "cpu",
    delay: int = 0,
) -> list[np.ndarray]:
    """Single-process reference: the flat parameters after each global step.

    ``steps[i]`` holds the micro-batches ``(x, y)`` that all volunteers used for global step
    ``start_step + i``; each step is one large batch: ``mean grad = Σ n_b g_b / Σ n_b``, clipped, applied
    with the learning rate of that global step. With ``by_volunteer=True``, ``steps[i]`` is instead a list
    of per-volunteer lists of micro-batches, and the step combines each volunteer's own mean gradient with
    weights = its samples through ``combine(grads, weights)`` (default :func:`weighted_mean`). That is the
    same value up to rounding; pass the all-reduce's own reduction to reproduce the collaborative step
    bit for bit. Rounding matters with AdamW, which divides by ``sqrt(v) + eps``: a coordinate whose true
    gradient is 0 but whose computed one is rounding noise moves by up to ~lr·|noise|/eps per step in an
    order-dependent direction (why ``tiny-gpt`` has no attention key bias), and coordinates with tiny
    gradients differ by ~1e-6 between a flat and a per-volunteer replay.
    A step with no samples applies a zero gradient.
    The model starts from ``recipe.build(args)`` (or ``initial_params``).

    With ``delay=1`` (delayed parameter updates), step ``k``'s gradients are computed on the parameters
    after step ``k - 2``'s update: step ``k - 1``'s average is applied only after step ``k``'s gradients
    are taken. Element ``i`` of the result is still the parameters after step ``i``'s update.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    trainer = Trainer(recipe, recipe.build(dict(args)), optimizer_spec, schedule_spec, device=device)
    if initial_params is not None:
        trainer.set_flat_params(initial_params)
    out: list[np.ndarray] = []
    pending: np.ndarray | None = None  # delay 1: the average not applied yet
    for i, batches in enumerate(steps):
        if by_volunteer:
            grads, weights = [], []
            for volunteer in batches:
                for x, y in volunteer:
                    trainer.accumulate(x, y)
                weights.append(float(trainer.samples))
                grads.append(mean_gradient(trainer))
            mean = combine(grads, weights) if grads else np.zeros(trainer.numel, dtype=np.float32)
        else:
            for x, y in batches:
                trainer.accumulate(x, y)
            mean = mean_gradient(trainer)
        if delay:
            if pending is not None:
                trainer.apply(pending, start_step + i - 1)
                out.append(trainer.flat_params())
            pending = mean
            continue
        trainer.apply(mean, start_step + i)
        out.append(trainer.flat_params())
    if pending is not None:
        trainer.apply(pending, start_step + len(steps) - 1)
        out.append(trainer.flat_params())
    return out
