"""The local-steps rule (``[averaging] inner_steps = H``) in one process, written apart from the product's
:class:`~crowdtrain.volunteer.local.LocalTrainer`: what a distributed run in that mode must equal.

Each volunteer keeps a model of its own and an inner optimizer of its own (the run's optimizer, built by the
product's ``make_optimizer``: the run's definition of it) for the whole run. A round: every volunteer starts
from the anchor, takes an inner step every ``inner_batch`` samples of its micro-batches and one for what is
left, at the learning rate ``schedule(B + j)`` for its ``j``-th, where ``B`` is the inner steps of the rounds before
the anchor (``anchor_step × H``; with ``inner_steps = "auto"`` the sum of the H the tracker chose for each); its pseudo-gradient is the
anchor minus its parameters; the mean of those (weighted by samples) takes one Nesterov SGD step from the
anchor, which gives the next anchor. With ``delay=1`` a round's mean is applied after the next round's
pseudo-gradients were taken, and each volunteer starts a round from the anchor of the time moved by the outer
step its own pseudo-gradient of the round before (none before its first) would make as the mean, and
measures its next one from there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from crowdtrain.protocol.messages import RunSpec
from crowdtrain.volunteer.models.registry import get_recipe
from crowdtrain.volunteer.schedule import learning_rate
from crowdtrain.volunteer.trainer import make_optimizer
from tests.oracles import weighted_mean

Batches = Sequence[tuple[Any, Any]]


class _Model:
    """A model, its parameters sorted by name and a flat gradient buffer the parameters' .grad view."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        named = sorted(((n, p) for n, p in model.named_parameters() if p.requires_grad), key=lambda i: i[0])
        self.named = named
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        self.grad = torch.zeros(self.numel)
        offset = 0
        for p in self.params:
            p.grad = self.grad[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def local_replay_reference(
    spec: RunSpec,
    rounds: Sequence[Sequence[Batches]],
    *,
    combine: Callable[[Sequence[np.ndarray], Sequence[float]], np.ndarray] = weighted_mean,
    delay: int = 0,
    args: Mapping[str, Any] | None = None,
    inner_steps: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """The anchor after each round. ``rounds[k][v]`` holds volunteer ``v``'s micro-batches ``(x, y)`` of
    round ``k`` (the same volunteer at the same index in every round); ``inner_steps[k]``: round ``k``'s H
    (the step history's, with ``inner_steps = "auto"``; None: the spec's for every round)."""
    fixed = spec.averaging.inner_steps

    def before(step: int) -> int:
        if inner_steps is None:
            assert isinstance(fixed, int)
            return step * fixed
        return sum(inner_steps[:step])

    recipe = get_recipe(spec.model.recipe)
    avg = spec.averaging
    inner_batch = avg.inner_batch_size or spec.micro_batch_size
    reference = _Model(recipe.build(dict(args if args is not None else spec.model.args)))
    assert not [b for b in reference.model.buffers() if b.dtype.is_floating_point], (
        "buffers: not modelled here"
    )
    outer = torch.optim.SGD(
        reference.params, lr=avg.outer_lr, momentum=avg.outer_momentum, nesterov=avg.outer_momentum > 0
    )
    anchor, anchor_step = reference.flat(), 0
    workers: list[tuple[_Model, torch.optim.Optimizer]] = []
    out: list[np.ndarray] = []
    pending: np.ndarray | None = None
    own: dict[int, torch.Tensor] = {}  # delay 1: each volunteer's last pseudo-gradient

    def preview(mine: torch.Tensor) -> torch.Tensor:
        """The anchor after the outer step with ``mine`` as the mean (torch's Nesterov SGD, written out)."""
        mu, step = avg.outer_momentum, mine
        if mu > 0:
            bufs = [outer.state.get(p, {}).get("momentum_buffer") for p in reference.params]
            held = None if bufs[0] is None else torch.cat([b.reshape(-1) for b in bufs])
            step = mine.add(mine.clone() if held is None else held.mul(mu).add_(mine), alpha=mu)
        return anchor.add(step, alpha=-avg.outer_lr)

    def outer_step(mean: np.ndarray, step: int) -> None:
        nonlocal anchor, anchor_step
        reference.load(anchor)
        reference.grad.copy_(torch.from_numpy(mean))
        outer.step()
        anchor, anchor_step = reference.flat(), step + 1
        out.append(anchor.numpy().copy())

    for k, per_volunteer in enumerate(rounds):
        while len(workers) < len(per_volunteer):
            mine = _Model(copy.deepcopy(reference.model))
            workers.append((mine, make_optimizer(mine.named, spec.optimizer)))
        deltas, weights = [], []
        for v, ((mine, inner), batches) in enumerate(zip(workers, per_volunteer, strict=False)):
            start = preview(own.get(v, torch.zeros_like(anchor))) if delay else anchor
            mine.load(start)
            weights.append(float(_inner_steps(mine, inner, batches, spec, inner_batch, before(anchor_step))))
            delta = start - mine.flat()
            own[v] = delta
            deltas.append(delta.numpy())
        mean = combine(deltas, weights)
        if delay:
            if pending is not None:
                outer_step(pending, k - 1)
            pending = mean
        else:
            outer_step(mean, k)
    if pending is not None:
        outer_step(pending, len(rounds) - 1)
    return out


def _inner_steps(
    mine: _Model,
    inner: torch.optim.Optimizer,
    batches: Batches,
    spec: RunSpec,
    inner_batch: int,
    base: int,
) -> int:
    """One volunteer's round: its inner steps over ``batches``; returns its samples."""
    recipe = get_recipe(spec.model.recipe)
    total, pending, taken = 0, 0, 0

    def step() -> None:
        nonlocal pending, taken
        with torch.no_grad():
            mine.grad.div_(pending)
            clip = spec.optimizer.grad_clip
            if clip > 0:
                mine.grad.mul_(torch.clamp(clip / (torch.linalg.vector_norm(mine.grad) + 1e-6), max=1.0))
        lr = learning_rate(base + taken, spec.optimizer, spec.schedule)
        for group in inner.param_groups:
            group["lr"] = lr
        inner.step()
        mine.grad.zero_()
        pending, taken = 0, taken + 1

    mine.model.train()
    for x, y in batches:
        n = int(x.shape[0])
        loss = recipe.loss(
            mine.model, torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
        )
        (loss * n).backward()
        pending, total = pending + n, total + n
        if pending >= inner_batch:
            step()
    if pending:
        step()
    return total
