"""The volunteer's own figures: compute rate, loss, and the share of its time that counted.

The compute rate a peer reports (the tracker shares each step out by it) is samples ÷ seconds over its last
RATE_WINDOW micro-batches, not a smoothing that weighs the last few most: where peers share cores, the last to
finish a step computes alone and fast for a moment, and a rate taken there would allot it more of the next
step, which it then finishes last again while the others wait. Nor does a stall count: a micro-batch that took
more than STALL_FACTOR × the window's median time per sample (the process was stopped, a lid closed, another
program took the machine for a moment) is left out of the rate, so one pause does not make the tracker allot
this peer less for the next RATE_WINDOW micro-batches while the others wait for it to finish its share of a
step (the pause itself is the tracker's straggler rules' to handle: ``docs/tracker.md``, item 9).
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from crowdtrain.volunteer import events as ev

RATE_WINDOW = 16
LOCAL_REPORT_S = 1.0  # a LocalTraining event at most this often
# a micro-batch slower than this × the window's median time per sample is a stall, not the peer's rate
STALL_FACTOR = 3.0


class Meter:
    """Rate, loss and compute share of one volunteer, fed by its training loop and its applied steps."""

    def __init__(self) -> None:
        self._window: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)  # (samples, seconds)
        self.loss_ema: float | None = None
        self._step_loss = (0.0, 0)  # Σ loss × samples and samples of the micro-batches toward this step
        self._step_compute_s = 0.0  # behind the gradient accumulated for the current step
        # compute share: seconds computing gradients that entered an average, since the first micro-batch
        self._t0: float | None = None
        self._useful_s = 0.0
        self._micro_batches = 0
        self._last_report = 0.0
        self.averaging_s: float | None = (
            None  # its last step's averaging: gradient handed over → mean in hand
        )

    def start(self, started: float) -> None:
        """A micro-batch starts (monotonic seconds): the compute share counts from the first."""
        if self._t0 is None:
            self._t0 = started

    def computed(self, samples: int, loss: float, started: float, now: float) -> None:
        """One micro-batch of ``samples`` computed from ``started`` to ``now`` (monotonic seconds)."""
        self._step_compute_s += now - started
        self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
        self._step_loss = (self._step_loss[0] + loss * samples, self._step_loss[1] + samples)
        self._window.append((samples, now - started))
        self._micro_batches += 1

    def local_report(
        self, loss: float, samples: int, inner_steps: int | None, inner_lr: float | None, now: float
    ) -> ev.LocalTraining | None:
        """What the view is told of the training between steps, once every LOCAL_REPORT_S."""
        if now - self._last_report < LOCAL_REPORT_S:
            return None
        self._last_report = now
        return ev.LocalTraining(
            loss=loss,
            samples=samples,
            samples_per_s=self.samples_per_s,
            micro_batches=self._micro_batches,
            inner_steps=inner_steps,
            inner_lr=inner_lr,
            compute_share=self.compute_share(pending=True),
        )

    @property
    def samples_per_s(self) -> float:
        """Compute throughput (not counting waits) over the last RATE_WINDOW micro-batches, stalls left out
        (0 before the first): what this peer's share of a step is made of."""
        if not self._window:
            return 0.0
        typical = statistics.median(s / max(n, 1) for n, s in self._window)
        kept = [(n, s) for n, s in self._window if s <= STALL_FACTOR * typical * max(n, 1)]
        return sum(n for n, _ in kept) / max(sum(s for _, s in kept), 1e-6)

    def take_step(self) -> tuple[float | None, float]:
        """The mean loss and compute seconds of the step's micro-batches, which start afresh."""
        (loss_sum, loss_n), compute_s = self._step_loss, self._step_compute_s
        self.drop_step()
        return (loss_sum / loss_n if loss_n else None), compute_s

    def drop_step(self) -> None:
        self._step_loss = (0.0, 0)
        self._step_compute_s = 0.0

    def averaged(self, seconds: float) -> None:
        """A step's averaging took ``seconds`` (reported to the tracker: ``inner_steps = "auto"``)."""
        self.averaging_s = seconds

    def counted(self, compute_s: float) -> None:
        """``compute_s`` seconds of compute entered an applied average."""
        self._useful_s += compute_s

    def compute_share(self, *, pending: bool = False) -> float | None:
        """Share of the wall time since the first micro-batch spent computing gradients that entered an
        average (a step applied with this peer's samples in it); ``pending``: and those of the step under way."""
        if self._t0 is None:
            return None
        elapsed = time.monotonic() - self._t0
        useful = self._useful_s + (self._step_compute_s if pending else 0.0)
        return min(1.0, useful / elapsed) if elapsed > 0 else None
