"""The learning rate as a pure function of the *global* step (nanoGPT's ``get_lr``).

Every volunteer computes the same rate for the same global step, whenever it joined, so a schedule needs
no state of its own in snapshots.

- warm-up: for ``step < warmup_steps`` the rate rises linearly, ``lr · (step + 1) / warmup_steps``;
- then, with ``progress = (step − warmup_steps) / (total_steps − warmup_steps)`` clamped to [0, 1] and
  ``min_lr = lr · min_lr_ratio``:
  ``constant``: ``lr``; ``linear``: ``lr + (min_lr − lr) · progress``;
  ``cosine``: ``min_lr + ½ (1 + cos(π · progress)) (lr − min_lr)``.
  Past ``total_steps`` a decaying schedule stays at ``min_lr``.
"""

from __future__ import annotations

import math

from crowdtrain.protocol.messages import OptimizerSpec, ScheduleSpec
from crowdtrain.protocol.runcheck import check_optimizer, check_schedule


def learning_rate(step: int, spec: OptimizerSpec, schedule: ScheduleSpec) -> float:
    """The learning rate of global step ``step`` (0-based). The spec's fields are checked as the tracker
    checks them (:mod:`crowdtrain.protocol.runcheck`)."""
    check_optimizer(spec)
    check_schedule(schedule)
    if step < 0:
        raise ValueError(f"the global step must be ≥ 0, got {step}")
    lr = spec.lr
    if step < schedule.warmup_steps:
        return lr * (step + 1) / schedule.warmup_steps
    if schedule.kind == "constant":
        return lr
    span = schedule.total_steps - schedule.warmup_steps
    progress = 1.0 if span <= 0 else min(1.0, (step - schedule.warmup_steps) / span)
    min_lr = lr * schedule.min_lr_ratio
    if schedule.kind == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
