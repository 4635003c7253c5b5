"""How many inner steps each round of a local-steps run takes: ``[averaging] inner_steps`` H, fixed, or
``"auto"``, chosen by the tracker for each round (Hemingway's idea: pick the work between communications from
a model of what each costs, not by hand).

The rule (:func:`next_inner_steps`, constants in :class:`~crowdtrain.tracker.policy.StepPolicy`): a round of
H inner steps computes for ``H × target_batch_size / rate`` seconds, where ``rate`` is the run's samples per
second over its peers. With delay 1 a round's averaging runs while the next round computes, so it is hidden
when that compute lasts ``auto_hide_margin`` × the averaging time; with delay 0 the averaging stops the
compute, and H is made large enough for a compute share of ``auto_share``. The averaging time is the median
of what the last round's members reported (``Heartbeat.averaging_s``: from their gradient handed over to the
mean in hand), so one stranger's report moves nothing. The choice is the smallest H that does it (a shorter
round is a fresher outer step), within ``[inner_steps_min, inner_steps_max]``; it moves by at most
``auto_growth`` × and ``auto_shrink`` × a round (the first rounds' averaging shares the uplink with the data
set's download: on 2 Mbit/s uplinks an unbounded rule jumped to H ≈ 40, then took rounds to come back to 6),
and not at all within ``auto_dead_band`` × of it (a round's length moved by a little buys nothing and moves
every peer's ahead share). Nothing measured yet: H stays at the first rounds' (``AUTO_FIRST_INNER_STEPS``, 16,
within the bounds).

Each step's H is recorded in the step history (``StepRecord.inner_steps``); the peers hear it with the inner
steps before it (:class:`~crowdtrain.protocol.messages.InnerSteps`), where their inner learning rates start
on the schedule. A restarted tracker takes them from the history and keeps the last H.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from crowdtrain.protocol.messages import AveragingSpec, InnerSteps
from crowdtrain.tracker.peers import Peer
from crowdtrain.tracker.policy import POLICY


def next_inner_steps(
    h: int,
    bounds: tuple[int, int],
    target_batch: int,
    rate: float,
    averaging_s: float | None,
    computes_ahead: bool,
) -> int:
    """The H of the next round (the module docstring's rule), after a round of ``h``."""
    if averaging_s is None or not rate > 0 or not math.isfinite(averaging_s):
        return h
    lo, hi = bounds
    share = POLICY.auto_share
    hidden_s = averaging_s * (POLICY.auto_hide_margin if computes_ahead else share / (1 - share))
    wanted = math.ceil(hidden_s * rate / target_batch)
    wanted = min(max(wanted, math.ceil(h * POLICY.auto_shrink)), max(h, math.floor(h * POLICY.auto_growth)))
    # (a change of a round's length by a little costs more than it buys: the ahead shares move)
    if h / POLICY.auto_dead_band <= wanted <= h * POLICY.auto_dead_band:
        wanted = h
    return min(hi, max(lo, wanted))


class Horizon:
    """One run's H: of the open step (``h``), the inner steps before it (``before``) and the H of the step
    before it (``previous``); chosen anew at each advance when the run's ``inner_steps`` is "auto"."""

    def __init__(self, avg: AveragingSpec, step: int, stored: tuple[int, int] | None = None) -> None:
        """``stored``: (the sum of the recorded steps' H, the last one's H) for a run at ``step`` (a tracker
        restarted in its middle); None: none recorded."""
        self.auto = avg.auto_inner_steps
        self.bounds = (avg.inner_steps_min, avg.inner_steps_max)
        self.computes_ahead = avg.computes_ahead
        self.step_of = step  # (the global step these figures are of)
        h = avg.first_inner_steps
        if stored is None or not self.auto:
            self.h, self.before, self.previous = h, step * h, h if step else 0
        else:
            self.before, self.previous = stored
            self.h = self.previous or h

    @property
    def inner(self) -> InnerSteps:
        return InnerSteps(step=self.step_of, h=self.h, before=self.before, previous=self.previous)

    def advance(self, step: int, target_batch: int, rate: float, members: Iterable[Peer]) -> int:
        """The open step closed; step ``step`` opens: its H is chosen (auto) from the closed round's ``rate``
        (samples per second) and the averaging times its weighted ``members`` reported. Returns the new H."""
        times = [p.averaging_s for p in members if p.averaging_s is not None]
        measured = statistics.median(times) if times else None
        self.before += self.h
        self.previous = self.h
        if self.auto:
            self.h = next_inner_steps(self.h, self.bounds, target_batch, rate, measured, self.computes_ahead)
        self.step_of = step
        return self.h
