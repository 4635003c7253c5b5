"""When a step's average is applied, as one volunteer follows it: the run's ``averaging.delay``, in one place.

:class:`Cadence` (delay 0): a step's average is applied as the step closes, before the next step's compute; the
peers average their parameters right after it (every ``average_state_every`` steps), and each keeps the step's
average for peers that missed it, who replay it on their own state.

:class:`Overlapped` (delay 1, delayed parameter updates): a peer done with its share takes its gradient early
and computes the next step's on the same parameters while its round runs in the background; the average is
applied when the next step closes. The parameters averaged in a round are those its gradient was computed on,
set before that gradient is applied. A state a peer fetches lacks the average of its own step (the round was
under way when it was written): that one is replayed when the current step closes.

The parts that differ ask the run's cadence (``JoinedRun.cadence``); none of them reads the delay.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np

from crowdtrain.protocol.messages import AveragingSpec

AverageParams = Callable[[], Awaitable[np.ndarray | None]]
SetParams = Callable[[np.ndarray], None]
ApplyGrad = Callable[[np.ndarray, int], float]
T = TypeVar("T")


class Cadence:
    """Delay 0: each step's average applied as the step closes."""

    lag = 0  # steps between a round's close and its average's application
    replays_own_state = (
        True  # one that slept through a few steps can replay their averages, fetched, on its own
    )

    async def begin(self, now: Callable[[], Awaitable[T]], later: Callable[[], None]) -> T | None:
        """A step's round: averaged ``now`` (its result returned), or started to run while the next step is
        computed (``later``; None)."""
        return await now()

    def averages_needed(self, state_step: int, step: int) -> range:
        """The steps whose averages a peer at ``step`` must hold (kept as a member with weight 0) to switch to
        the state of ``state_step``, which holds the averages of the steps below it: those up to its step (a
        newer state: none; the peer moves to its step)."""
        return range(state_step, step)

    def pending(self, step: int) -> int | None:
        """The step whose average a peer that switched to a state at ``step`` applies when ``step`` closes."""
        return None

    def own_grad_buffer(self, device_type: str) -> bool:
        """Whether the gradient handed to the all-reduce goes to a buffer of its own (on a CPU the
        accumulation buffer itself is handed over: no copy)."""
        return device_type != "cpu"

    def mean_in_place(self, tag: str) -> bool:
        """Whether a phase's mean of ``tag`` overwrites the vector it is made of (the gradient: nothing reads it
        again, and no buffer of the model's size is needed)."""
        return tag == "grad"

    def keeps_averages(self) -> bool:
        """Whether each applied average is kept for peers that miss the step (they replay it)."""
        return True

    async def params_in_round(self, averages_params: bool, average: AverageParams) -> np.ndarray | None:
        """The parameters averaged within a round, after its gradient (none: they come after the step)."""
        return None

    async def params_after_step(self, averages_params: bool, average: AverageParams) -> np.ndarray | None:
        """The parameters averaged once the step's average is applied."""
        return await average() if averages_params else None

    def apply(
        self, grad: np.ndarray, step: int, params: np.ndarray | None, apply: ApplyGrad, set_params: SetParams
    ) -> float:
        """Apply a step's average ``grad`` and its averaged ``params`` (if any), in the cadence's order; returns
        the learning rate. Blocking: call it in a thread."""
        lr = apply(grad, step)
        if params is not None:
            set_params(params)
        return lr


class Overlapped(Cadence):
    """Delay 1: the round runs while the next step is computed; its average is applied when that step closes."""

    lag = 1
    replays_own_state = False  # (the averages a state lacks are not all kept by peers: it fetches the state)

    async def begin(self, now: Callable[[], Awaitable[T]], later: Callable[[], None]) -> T | None:
        later()
        return None

    def averages_needed(self, state_step: int, step: int) -> range:
        """Up to the one applied when its step closes, and at least ``state_step``'s own: the peers that wrote
        that snapshot had its round under way (a snapshot is written as its step closes), and apply its average
        at the next close, as this peer must; a state of this peer's step or newer is of no use until a newer
        one comes."""
        return range(state_step, max(step, state_step + 1))

    def pending(self, step: int) -> int | None:
        return step - 1 if step > 0 else None

    def own_grad_buffer(self, device_type: str) -> bool:
        return True  # (the next step accumulates while the round reads this one)

    def mean_in_place(self, tag: str) -> bool:
        return False

    def keeps_averages(self) -> bool:
        return False

    async def params_in_round(self, averages_params: bool, average: AverageParams) -> np.ndarray | None:
        """The parameters the round's gradient was computed on, averaged within it."""
        return await average() if averages_params else None

    async def params_after_step(self, averages_params: bool, average: AverageParams) -> np.ndarray | None:
        return None

    def apply(
        self, grad: np.ndarray, step: int, params: np.ndarray | None, apply: ApplyGrad, set_params: SetParams
    ) -> float:
        if params is not None:
            set_params(params)
        return apply(grad, step)


_CADENCES = {0: Cadence(), 1: Overlapped()}


def cadence_of(averaging: AveragingSpec) -> Cadence:
    """The cadence a run's averaging asks for (its delay is 0 or 1: protocol/runcheck.py)."""
    return _CADENCES[averaging.delay]
