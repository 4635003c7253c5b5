"""The local trainer: micro-batches in, one accumulated gradient out, the averaged gradient applied.

Accumulation convention (what makes the collaborative step exact)
-----------------------------------------------------------------
A recipe's loss is the *mean* over a micro-batch of ``n`` samples. :meth:`Trainer.accumulate` back-propagates
``n · loss`` (the *sum* of the per-sample losses), so the gradient buffer holds ``S = Σ_b n_b · g_b`` over the
micro-batches ``b`` seen since the last step, and ``samples = N = Σ_b n_b``. :meth:`Trainer.take_grad` hands
out ``S / N``, the exact mean gradient over every sample seen. Peers average these with weights ``N_i``:
``Σ_i N_i (S_i / N_i) / Σ_i N_i = Σ_all n_b g_b / Σ_all n_b`` — the mean gradient of one large batch made of
all the peers' samples, which the suite's reference replay (``tests/oracles.py``) computes in one process.

Layout: all trainable parameters, sorted by name (the order the parameter hash is computed in), are
concatenated into one flat float32 vector. Each parameter's ``.grad`` is a view into one flat buffer, so
backward accumulates straight into it and :meth:`take_grad` / :meth:`apply` need no gather or scatter.

Every method is synchronous and may take a while; the engine calls them through ``asyncio.to_thread``,
one at a time. CPU–GPU synchronisation points are marked ``# sync:``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from crowdtrain.protocol.codecs import INT8_BLOCK
from crowdtrain.protocol.errors import (
    AveragingError,
    ConfigError,
    CrowdtrainError,
    RecipeError,
    StateSyncError,
)
from crowdtrain.protocol.messages import InnerSteps, OptimizerSpec, ScheduleSpec
from crowdtrain.protocol.runcheck import check_optimizer, check_schedule
from crowdtrain.volunteer.models.recipe import Recipe
from crowdtrain.volunteer.schedule import learning_rate

Batch = tuple[Any, Any]  # (x, y): torch tensors or numpy arrays, first dimension = samples


def resolve_device(device: str) -> torch.device:
    """``auto`` → CUDA when present, else CPU; ``cuda`` without a GPU is a :class:`ConfigError`."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError("device", f"must be auto, cpu or cuda[:N], got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device", "CUDA was asked for but this torch build sees no GPU; use --device cpu or auto"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("device", f"must be auto, cpu or cuda[:N], got {device!r}")
    return dev


_FINITE_CHUNK = 1 << 20  # values checked at a time by all_finite


def all_finite(values: np.ndarray) -> bool:
    """True when no value is NaN or infinite. A chunk at a time: ``np.isfinite(values).all()`` would make a
    boolean temporary of the whole vector (a byte per parameter, at the peak of a step)."""
    flat = values.reshape(-1)
    n = _FINITE_CHUNK
    return all(np.isfinite(flat[a : a + n]).all() for a in range(0, flat.size, n))


def make_optimizer(
    named: Sequence[tuple[str, torch.nn.Parameter]], spec: OptimizerSpec
) -> torch.optim.Optimizer:
    """AdamW or SGD (momentum) from the spec. Weight decay applies to matrices and embeddings (dim ≥ 2)
    only, not to biases and norm gains (nanoGPT's grouping)."""
    check_optimizer(spec)
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if spec.name == "adamw":
        # fused: one kernel over every tensor (about a third quicker than foreach on a CPU); every peer and
        # the replay build the same optimizer, so they round alike
        return torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps, fused=True)
    return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum)


class Trainer:
    """One model, its optimizer and its accumulated gradient on one device."""

    # optimizer steps taken since the last global step: none here (the local-steps trainer takes inner ones)
    inner_taken: int | None = None
    inner_lr: float | None = None  # the inner steps' learning rate (local steps), as last taken

    def __init__(
        self,
        recipe: Recipe,
        model: torch.nn.Module,
        optimizer_spec: OptimizerSpec,
        schedule_spec: ScheduleSpec,
        device: str = "cpu",
    ) -> None:
        check_optimizer(optimizer_spec)
        check_schedule(schedule_spec)
        self.recipe = recipe
        self.optimizer_spec = optimizer_spec
        self.schedule_spec = schedule_spec
        self.device = resolve_device(device)
        self.model = model.to(self.device)
        self.named = sorted(
            ((n, p) for n, p in self.model.named_parameters() if p.requires_grad), key=lambda item: item[0]
        )
        wrong = [n for n, p in self.named if p.dtype != torch.float32]
        if wrong:
            raise ConfigError(
                "model", f"parameters must be float32 (master weights); {', '.join(wrong)} are not"
            )
        self.params = [p for _, p in self.named]
        # Buffers kept in the state (BatchNorm's running statistics and count) are state too, so every peer
        # ends a step with the same ones and the peers' state hashes agree. Floating-point buffers travel in
        # the averaged vector after the gradient (each peer takes their weighted mean); whole-number ones
        # (num_batches_tracked) are set to the run's step count at each step. Non-persistent buffers
        # (masks) are not state.
        persistent = set(self.model.state_dict())
        kept = sorted(
            ((n, b) for n, b in self.model.named_buffers() if n in persistent and b.numel()),
            key=lambda item: item[0],
        )
        self.buffers = [(n, b) for n, b in kept if b.dtype.is_floating_point]
        self.counters = [(n, b) for n, b in kept if not b.dtype.is_floating_point]
        self.param_numel = sum(p.numel() for p in self.params)
        # the vector averaged every step: the gradient, then (from a whole int8 block on, so that no block of
        # the lossy codec mixes gradients with values of another scale) the buffers' values
        start = -(-self.param_numel // INT8_BLOCK) * INT8_BLOCK if self.buffers else self.param_numel
        self._buffers_at = start
        self.numel = start + sum(b.numel() for _, b in self.buffers)
        self._grad = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self._views = self._param_views(self._grad)
        self._bind_grads()
        self._samples = 0
        self._consumed = False  # the buffer holds a mean handed out by take_grad: zero it before adding
        self.optimizer = make_optimizer(self.named, optimizer_spec)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def _param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a vector in the flat layout, shaped as the parameter."""
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    # ------------------------------------------------------------------ accumulation

    @property
    def samples(self) -> int:
        """Samples accumulated since the last :meth:`apply` or :meth:`reset_accumulation`."""
        return self._samples

    def _bind_grads(self) -> None:
        # Backward adds into an existing .grad in place, so these views keep receiving the gradient.
        # If someone replaced or dropped a .grad (model.zero_grad()), re-attach our view.
        for p, view in zip(self.params, self._views, strict=True):
            if p.grad is not view:
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda" and torch.cuda.is_bf16_supported():
            # bf16 keeps fp32's range, so no loss scaler is needed; params and grads stay fp32.
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # CPU (and pre-Ampere GPUs): plain fp32

    def _to_device(self, a: Any) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else torch.as_tensor(a)
        return t.to(self.device, non_blocking=True)  # host→device copy, asynchronous for pinned memory

    def accumulate(self, x: Any, y: Any) -> tuple[float, int]:
        """Forward and backward one micro-batch; add ``n · ∇(mean loss)`` to the gradient buffer.

        Returns the micro-batch's mean loss and its number of samples ``n = len(x)``.
        """
        if y is None:
            raise RecipeError(
                f"Recipe {self.recipe.name!r} needs labelled samples (x, y), but this data set has no labels; "
                "use a recipe for unlabelled data or a data set made with labels."
            )
        n = int(x.shape[0])
        if n <= 0:
            raise ValueError("a micro-batch needs at least one sample")
        if int(y.shape[0]) != n:
            raise ValueError(f"x has {n} samples but y has {int(y.shape[0])}")
        self._bind_grads()
        if self._consumed:
            self._grad.zero_()
            self._consumed = False
        self.model.train()
        xt, yt = self._to_device(x), self._to_device(y)
        try:
            with self._autocast():
                loss = self.recipe.loss(self.model, xt, yt)
            (loss * n).backward()  # sum of the per-sample losses: the buffer adds n_b · g_b
        except (CrowdtrainError, torch.OutOfMemoryError):
            raise
        except (
            Exception
        ) as exc:  # the recipe's own code on this run's samples: one sentence, not its traceback
            raise RecipeError(
                f"Recipe {self.recipe.name!r} fails on a micro-batch of this run's data set (x {tuple(x.shape)} "
                f"{x.dtype}, y {tuple(y.shape)} {y.dtype}): {type(exc).__name__}: {exc}; tell the run's publisher."
            ) from None
        self._samples += n
        return float(loss.detach()), n  # sync: .item() waits for the GPU to finish this micro-batch

    def take_grad(self, into: np.ndarray | None = None) -> np.ndarray:
        """Hand out the mean gradient over the accumulated samples (float32, flat) and start a new
        accumulation.

        With ``into`` (a reused host buffer; pinned memory on a GPU makes the copy asynchronous), the mean is
        copied there. Without it, on the CPU, the buffer is divided in place and returned as a view, valid
        until the next :meth:`accumulate`, :meth:`apply` or :meth:`reset_accumulation` (no copy at all).
        """
        self._bind_grads()
        samples = self._samples
        self._samples = 0
        if into is None and self.device.type == "cpu":
            if samples:
                self._grad.div_(samples)
            else:
                self._grad.zero_()
            self._read_buffers(self._grad)
            self._consumed = True
            return self._grad.numpy()
        out = into if into is not None else np.empty(self.numel, dtype=np.float32)
        if out.shape != (self.numel,) or out.dtype != np.float32:
            raise ValueError(f"the gradient buffer must be float32 of shape ({self.numel},)")
        host = torch.from_numpy(out)
        if samples:
            if self.device.type == "cpu":
                torch.div(self._grad, samples, out=host)
            else:
                host.copy_(self._grad / samples, non_blocking=True)  # device→host, queued
                torch.cuda.current_stream(self.device).synchronize()  # sync: waits for this copy only
        else:
            host.zero_()
        self._read_buffers(host)
        self._grad.zero_()
        self._consumed = False
        return out

    @torch.no_grad()
    def _read_buffers(self, vector: torch.Tensor) -> None:
        """Write the buffers' values after the gradient in ``vector`` (float32, on any device)."""
        offset = self._buffers_at
        for _, b in self.buffers:
            vector[offset : offset + b.numel()].copy_(b.reshape(-1))
            offset += b.numel()

    @torch.no_grad()
    def _write_buffers(self, vector: torch.Tensor) -> None:
        """Set the buffers from the values after the gradient in ``vector``."""
        offset = self._buffers_at
        for _, b in self.buffers:
            b.copy_(vector[offset : offset + b.numel()].view_as(b))
            offset += b.numel()

    def mean_buffer(self) -> np.ndarray | None:
        """Where to write a mean gradient that :meth:`apply` then steps with, copying nothing: the
        accumulation buffer itself on the CPU (the accumulation is dropped, and the buffer is zeroed before
        the next one adds to it, as after :meth:`take_grad`), None on a GPU."""
        if self.device.type != "cpu":
            return None
        self._bind_grads()
        self._samples = 0
        self._consumed = True  # (not zeroed here: the caller overwrites every value)
        return self._grad.numpy()

    def heard_inner(self, inner: InnerSteps) -> None:
        """The tracker's word on a local-steps run's inner steps (:class:`~crowdtrain.volunteer.local.LocalTrainer`);
        nothing to an every-step trainer."""

    def reset_accumulation(self) -> None:
        """Forget the accumulated gradient and samples."""
        self._bind_grads()
        self._grad.zero_()
        self._samples = 0
        self._consumed = False

    # ------------------------------------------------------------------ the step

    def apply(self, mean_grad: np.ndarray, step: int) -> float:
        """Take the optimizer step of global step ``step`` with the group's mean gradient.

        Writes ``mean_grad`` into the parameters' ``.grad``, clips it to the spec's global norm, sets the
        learning rate of ``step``, steps, and zeroes the accumulation. Returns the rate used.
        Raises :class:`AveragingError` (and leaves the model untouched) for a wrong length or non-finite values.
        """
        self._receive(mean_grad, step)
        lr = learning_rate(step, self.optimizer_spec, self.schedule_spec)
        self._clip()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self._clear()
        return lr

    def _receive(self, mean_grad: np.ndarray, step: int) -> None:
        """Check the mean of global step ``step`` and put it in ``.grad``; set the buffers from it and the
        counters to the step count. :class:`AveragingError` (nothing changed) for a wrong length or a
        non-finite value."""
        g = np.asarray(mean_grad)
        if g.shape != (self.numel,):
            raise AveragingError(
                f"The averaged gradient has shape {g.shape}, this model has {self.numel} parameters; not stepping."
            )
        if not all_finite(g):
            raise AveragingError("The averaged gradient contains NaN or infinite values; not stepping.")
        self._bind_grads()
        source = torch.from_numpy(np.ascontiguousarray(g, dtype=np.float32))
        if source.data_ptr() != self._grad.data_ptr():  # (a mean handed out by take_grad is in place)
            self._grad.copy_(source)  # host→device copy
        self._write_buffers(self._grad)
        for _, counter in self.counters:
            counter.fill_(step + 1)

    @torch.no_grad()
    def _clip(self) -> None:
        """Scale the gradient in ``.grad`` down to the spec's global norm (torch.nn.utils.clip_grad_norm_'s
        arithmetic, on the flat buffer in one kernel)."""
        clip = self.optimizer_spec.grad_clip
        if clip > 0:
            grad = self._grad[: self.param_numel]
            grad.mul_(torch.clamp(clip / (torch.linalg.vector_norm(grad) + 1e-6), max=1.0))

    def _clear(self) -> None:
        """After a step: no gradient, no samples."""
        self._grad.zero_()
        self._samples = 0
        self._consumed = False

    # ------------------------------------------------------------------ parameters and state

    def flat_params(self) -> np.ndarray:
        """All trainable parameters in the flat layout, then the buffers' values, float32 (a copy)."""
        with torch.no_grad():
            pad = self._buffers_at - self.param_numel
            flat = torch.cat(
                [p.detach().reshape(-1) for p in self.params]
                + [torch.zeros(pad, device=self.device)]
                + [b.detach().reshape(-1).float() for _, b in self.buffers]
            )
        return flat.cpu().numpy()  # sync: device→host copy

    def set_flat_params(self, values: np.ndarray) -> None:
        """Overwrite the trainable parameters from a flat float32 vector (e.g. after parameter averaging)."""
        v = np.asarray(values)
        if v.shape != (self.numel,):
            raise AveragingError(
                f"Parameters of shape {v.shape} do not fit this model's {self.numel} values."
            )
        if not all_finite(v):
            raise AveragingError(
                "The averaged parameters contain NaN or infinite values; keeping the local ones."
            )
        flat = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(self.device)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self._write_buffers(flat)

    def live_state(self) -> dict[str, torch.Tensor]:
        """The model's state for a snapshot written beside training: the live parameters (training does not
        change them between two steps) and copies of the buffers (every forward pass changes those)."""
        state = self.model.state_dict()
        for name, b in self.buffers + self.counters:
            state[name] = b.detach().clone()
        return state

    def load_state(
        self,
        model_state: Mapping[str, Any],
        optimizer_state: Mapping[str, Any],
        *,
        owned: bool = False,
        step: int = 0,
    ) -> None:
        """Load a snapshot's model and optimizer state; :class:`StateSyncError` if it does not fit.

        The optimizer state is copied first, unless ``owned`` (the caller hands its tensors over):
        ``Optimizer.load_state_dict`` keeps tensors of the right dtype and device and steps them in place.
        ``step`` is the global step the state is of (the steps applied to it): a trainer that takes steps of
        its own between global steps (:class:`crowdtrain.volunteer.local.LocalTrainer`) keys them to it.
        """
        try:
            self.model.load_state_dict(model_state, strict=True)  # copies in place: .grad views survive
            self.optimizer.load_state_dict(
                dict(optimizer_state) if owned else _copy_tensors(dict(optimizer_state))
            )
        except (RuntimeError, ValueError, KeyError) as exc:
            raise StateSyncError(f"The fetched state does not fit this model and optimizer: {exc}") from exc
        self._bind_grads()

    @torch.no_grad()
    def evaluate_with_metrics(self, x: Any, y: Any, micro: int) -> tuple[float, dict[str, float]]:
        """Mean loss and the recipe's metrics (its optional ``metrics(model, x, y)``) over a held-out batch,
        ``micro`` samples at a time, each micro-batch weighted by its samples. Metrics a micro-batch does not
        give, or gives as a non-finite number, are left out."""
        self.model.eval()
        metrics_fn = getattr(self.recipe, "metrics", None)
        total, loss_sum = 0, 0.0
        sums: dict[str, float] = {}
        try:
            for start in range(0, int(x.shape[0]), micro):
                xb, yb = self._to_device(x[start : start + micro]), self._to_device(y[start : start + micro])
                n = int(xb.shape[0])
                with self._autocast():
                    loss_sum += float(self.recipe.loss(self.model, xb, yb)) * n
                    got = dict(metrics_fn(self.model, xb, yb)) if metrics_fn is not None else {}
                for name, value in got.items():
                    sums[name] = sums.get(name, 0.0) + float(value) * n
                total += n
        except (CrowdtrainError, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # the recipe's own code on the held-out samples: one sentence
            raise RecipeError(
                f"Recipe {self.recipe.name!r} fails on the run's held-out samples: {type(exc).__name__}: {exc}; "
                "tell the run's publisher."
            ) from None
        finally:
            self.model.train()
        metrics = {k: v / total for k, v in sums.items() if math.isfinite(v)}
        return loss_sum / max(total, 1), metrics


def _copy_tensors(obj: Any) -> Any:
    """A copy of a nested state dict whose tensors are fresh CPU tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copy_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_copy_tensors(v) for v in obj)
    return obj
