"""Local steps (DiLoCo): a global step is one outer round, and only its pseudo-gradient is averaged.

With ``[averaging] inner_steps = H`` (H > 1) a round covers ``H × target_batch_size`` samples over the run,
shared out by rate as a step's samples are. Within it each peer takes *inner* optimizer steps on its own
samples with the run's optimizer (its own state, never averaged), one every ``inner_batch_size`` samples
(the micro-batch size when 0) and one for what is left when the round closes, starting from the round's
*anchor*: the parameters every peer holds after the previous outer step. At the round's close the peer hands
over its pseudo-gradient ``Δ = anchor − parameters`` and goes back to the anchor; the peers all-reduce
``Δ`` weighted by their samples, exactly as they average a gradient in every-step mode, and every peer takes
the same *outer* step from the anchor: Nesterov SGD with ``outer_lr`` and ``outer_momentum`` on the mean
``Δ``. The inner learning rate of a round's ``j``-th inner step is the run's schedule at ``B + j``, where ``B``
is the inner steps of the outer steps before the anchor's global step ``anchor_step``: ``anchor_step × H``,
or with ``inner_steps = "auto"`` the sum of the H the tracker chose for each (:class:`InnerClock`, told by
its heartbeats' and ready calls' replies).

:class:`LocalTrainer` is a :class:`~crowdtrain.volunteer.trainer.Trainer` whose accumulation takes the inner
steps, whose ``take_grad`` hands out ``Δ`` and whose ``apply`` takes the outer step; everything the engine
does with a trainer — rounds, delay 1, catch-up and its replay, snapshots, the kept state — works on it
unchanged. Its snapshots hold the anchor and the outer optimizer's state (the live parameters move between
global steps; the inner state is each peer's own).

With ``delay = 1`` a round's ``Δ`` is applied when the next round closes, so the next round cannot start from
its outer step. It starts where that outer step would land if this peer's own ``Δ`` (its progress, in flight
in the average) were the mean: the anchor moved by the run's momentum and ``own`` (:meth:`_start_into`), and
its pseudo-gradient is measured from there: ``Δ = start − parameters``; when the average arrives, the outer
step moves the anchor and the next start is found the same way from it, the peer's newest ``Δ`` as ``own``.
Every round's gradients are thus computed about where they are applied, not one whole round behind: started
from the stale anchor instead, two rounds in a row push from the same point and the outer step applies both,
which with the outer momentum 0.95 diverged (docs/benchmarks.md). The run's state (the anchor, the outer
optimizer) stays the same bytes on every peer; only the live parameters are each peer's own, as the inner
optimizer's state is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from crowdtrain.protocol.messages import AveragingSpec, InnerSteps, RunSpec
from crowdtrain.volunteer.models.recipe import Recipe
from crowdtrain.volunteer.schedule import learning_rate
from crowdtrain.volunteer.trainer import Trainer

log = logging.getLogger(__name__)

KEPT_STEPS = 64  # the steps whose inner steps before them an InnerClock keeps


class InnerClock:
    """The inner steps of the outer steps before each global step: where a round's inner learning rates start
    on the run's schedule. ``step × H`` for a fixed H; with ``inner_steps = "auto"``, as the tracker tells."""

    def __init__(self, avg: AveragingSpec) -> None:
        self.fixed = None if avg.auto_inner_steps else avg.first_inner_steps
        self.first = avg.first_inner_steps
        self._before: dict[int, int] = {}
        self._guessed: int | None = None  # the last step guessed (logged once)

    def heard(self, inner: InnerSteps) -> None:
        s = inner.step
        self._before[s] = inner.before
        self._before[s + 1] = inner.before + inner.h
        if s > 0 and inner.previous:
            self._before[s - 1] = inner.before - inner.previous
        for old in [k for k in self._before if k < s - KEPT_STEPS]:
            del self._before[old]

    def before(self, step: int) -> int:
        """The inner steps of the outer steps before ``step``."""
        if self.fixed is not None:
            return step * self.fixed
        if step in self._before:
            return self._before[step]
        known = [k for k in self._before if k < step]
        base, last = (max(known), self._before[max(known)]) if known else (0, 0)
        if self._guessed != step:  # (a peer hears its step's figures before its first inner step: not seen)
            self._guessed = step
            log.warning("the inner steps before step %d were not heard; counting from step %d's", step, base)
        return last + (step - base) * self.first


def make_trainer(
    recipe: Recipe, model: torch.nn.Module, spec: RunSpec, device: str, step: int = 0
) -> Trainer:
    """The trainer of the run's mode: every-step (:class:`Trainer`) or local steps (:class:`LocalTrainer`);
    ``step`` is the global step the model's parameters are of."""
    if not spec.averaging.local:
        return Trainer(recipe, model, spec.optimizer, spec.schedule, device=device)
    return LocalTrainer(recipe, model, spec, device=device, step=step)


class LocalTrainer(Trainer):
    """Inner steps on this peer's samples, the pseudo-gradient handed out, the outer step applied."""

    inner_taken: int = 0  # inner steps taken since the anchor was set

    def __init__(
        self, recipe: Recipe, model: torch.nn.Module, spec: RunSpec, device: str = "cpu", step: int = 0
    ) -> None:
        super().__init__(recipe, model, spec.optimizer, spec.schedule, device=device)
        avg = spec.averaging
        self.clock = InnerClock(avg)
        self.inner_batch = avg.inner_batch_size or spec.micro_batch_size
        self.outer_lr = avg.outer_lr
        self.outer_momentum = avg.outer_momentum
        self.inner = self.optimizer  # the run's optimizer: this peer's own state, never averaged
        # ``optimizer`` is what a snapshot holds and a fetched state loads: the outer one, the same on every peer
        self.optimizer = torch.optim.SGD(
            self.params, lr=avg.outer_lr, momentum=avg.outer_momentum, nesterov=avg.outer_momentum > 0
        )
        # the anchor: the parameters, then the buffers' values, in the flat layout of the averaged vector
        self._anchor = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self._anchor_views = self._param_views(self._anchor)
        self.anchor_step = step
        self._round_samples = 0
        # delay 1: this peer's last Δ, in flight in the average; its rounds start as _start_into says
        self._own = (
            torch.zeros(self.param_numel, dtype=torch.float32, device=self.device) if avg.delay else None
        )
        self._own_views = self._param_views(self._own) if self._own is not None else []
        self._set_anchor(step)

    def heard_inner(self, inner: InnerSteps) -> None:
        self.clock.heard(inner)

    # ------------------------------------------------------------------ the round

    @property
    def samples(self) -> int:
        """Samples computed in this round (over all its inner steps so far)."""
        return self._round_samples

    def accumulate(self, x: Any, y: Any) -> tuple[float, int]:
        loss, n = super().accumulate(x, y)
        self._round_samples += n
        if self._samples >= self.inner_batch:
            self._inner_step()
        return loss, n

    @torch.no_grad()
    def _inner_step(self) -> None:
        """One inner step on the mean gradient of the samples accumulated since the last one (none: no step)."""
        if not self._samples:
            return
        self._bind_grads()
        self._grad[: self.param_numel].div_(self._samples)
        self._clip()
        lr = learning_rate(
            self.clock.before(self.anchor_step) + self.inner_taken, self.optimizer_spec, self.schedule_spec
        )
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner_lr = lr
        self.inner.step()
        self.inner_taken += 1
        self._clear()

    def take_grad(self, into: np.ndarray | None = None) -> np.ndarray:
        """Take the inner step of what is left, hand out the pseudo-gradient ``start − parameters`` (then the
        buffers' values) and go back to the round's start for the next: the anchor, the round's progress
        travelling in the average only; with delay 1, :meth:`_start_into`'s with this round's ``Δ`` as ``own``."""
        self._inner_step()
        with torch.no_grad():
            self._bind_grads()
            if self._own is None:
                for view, anchor, p in zip(self._views, self._anchor_views, self.params, strict=True):
                    torch.sub(anchor, p, out=view)
            else:
                self._start_into(self._views)  # (the round's start, as _restore made it)
                for view, p in zip(self._views, self.params, strict=True):
                    view.sub_(p)
                self._own.copy_(self._grad[: self.param_numel])
        self._samples = 1  # (the pseudo-gradient is whole: the base divides by one)
        out = super().take_grad(into)
        self._restore(keep_own=True)
        return out

    def apply(self, mean_grad: np.ndarray, step: int) -> float:
        """The outer step of global step ``step`` from the anchor, with the peers' mean pseudo-gradient; the
        result is the new anchor. Returns the outer learning rate."""
        self._receive(mean_grad, step)  # (checks first: a refused mean changes nothing)
        with torch.no_grad():
            for p, anchor in zip(self.params, self._anchor_views, strict=True):
                p.copy_(anchor)
        for group in self.optimizer.param_groups:
            group["lr"] = self.outer_lr
        self.optimizer.step()
        self._clear()
        self._set_anchor(step + 1)
        if (
            self._own is not None
        ):  # (delay 1: the next round starts from the new anchor and own; delay 0: here)
            self._restore(keep_own=True)
        return self.outer_lr

    # ------------------------------------------------------------------ the anchor

    @torch.no_grad()
    def _set_anchor(self, step: int) -> None:
        """The parameters and buffers held now are the run's state of ``step``: the next round starts here."""
        for anchor, p in zip(self._anchor_views, self.params, strict=True):
            anchor.copy_(p)
        self._read_buffers(self._anchor)
        self.anchor_step = step
        self.inner_taken = 0
        self._round_samples = 0

    @torch.no_grad()
    def _start_into(self, out: Sequence[torch.Tensor]) -> None:
        """Delay 1: a round's start, into ``out`` (views shaped as the parameters): the anchor moved by the
        outer step the run would take if this peer's ``own`` were the mean (the run's momentum, then own)."""
        mu = self.outer_momentum
        for o, anchor, own, p in zip(out, self._anchor_views, self._own_views, self.params, strict=True):
            step = own
            if mu > 0:  # (torch's Nesterov SGD: buf ← mu·buf + g, the step g + mu·buf; buf starts as g)
                buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
                buf = own.clone() if buf is None else buf.mul(mu).add_(own)
                step = own.add(buf, alpha=mu)
            torch.add(anchor, step, alpha=-self.outer_lr, out=o)

    @torch.no_grad()
    def _restore(self, keep_own: bool = False) -> None:
        """Back to a round's start, no round under way: the anchor's parameters and buffers; with delay 1 the
        anchor moved as :meth:`_start_into` says, by ``own`` when ``keep_own`` (else ``own`` is dropped: a
        fetched or reset state)."""
        if self._own is None:
            for p, anchor in zip(self.params, self._anchor_views, strict=True):
                p.copy_(anchor)
        else:
            if not keep_own:
                self._own.zero_()
            self._start_into(self.params)
        self._write_buffers(self._anchor)
        self.inner_taken = 0
        self._round_samples = 0

    def reset_accumulation(self) -> None:
        """Drop the round: its samples, its accumulated gradient and its inner steps (back to the anchor)."""
        super().reset_accumulation()
        self._restore()

    def mean_buffer(self) -> np.ndarray | None:
        self._restore()
        return super().mean_buffer()

    def set_flat_params(self, values: np.ndarray) -> None:
        super().set_flat_params(values)
        self._set_anchor(self.anchor_step)
        self._restore()

    @torch.no_grad()
    def evaluate_with_metrics(self, x: Any, y: Any, micro: int) -> tuple[float, dict[str, float]]:
        """The held-out loss of the run's state (the anchor), not of this peer's live parameters."""
        if self._own is None:
            return super().evaluate_with_metrics(x, y, micro)
        live = [p.detach().clone() for p in self.params]
        for p, anchor in zip(self.params, self._anchor_views, strict=True):
            p.copy_(anchor)
        try:
            return super().evaluate_with_metrics(x, y, micro)
        finally:
            for p, kept in zip(self.params, live, strict=True):
                p.copy_(kept)

    def flat_params(self) -> np.ndarray:
        """The run's parameters (the anchor), then the buffers' values; not the round's local ones."""
        return self._anchor.cpu().numpy().copy()

    def live_state(self) -> dict[str, torch.Tensor]:
        """The state a snapshot holds: the anchor (unchanged until the next outer step), not the parameters
        the inner steps move."""
        state = self.model.state_dict()
        for (name, _), anchor in zip(self.named, self._anchor_views, strict=True):
            state[name] = anchor
        offset = self._buffers_at
        for name, b in self.buffers:
            state[name] = self._anchor[offset : offset + b.numel()].view_as(b).clone()
            offset += b.numel()
        for name, counter in self.counters:
            state[name] = torch.full_like(counter, self.anchor_step)
        return state

    def load_state(
        self,
        model_state: Any,
        optimizer_state: Any,
        *,
        owned: bool = False,
        step: int = 0,
    ) -> None:
        super().load_state(model_state, optimizer_state, owned=owned, step=step)
        super().reset_accumulation()
        self._set_anchor(step)
        self._restore()  # (delay 1: no round of this peer's is in flight in the state it loaded)
