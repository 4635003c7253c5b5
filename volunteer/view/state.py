"""What the view shows, as one frozen snapshot, and :func:`apply`, which folds one event into it.

The snapshot is one record per panel (:mod:`~crowdtrain.volunteer.view.panels`: header, collaboration,
local training, data set, averaging, state sync) and the log tail. :func:`apply` moves each record by its
own table of rules (:mod:`~crowdtrain.volunteer.view.rules`), so an event that touches three panels is
three short rules, each reading only its own record. The snapshot holds figures only (no rich, no
clocks): :func:`~crowdtrain.volunteer.view.render.render` draws it, the demo turns it into a row. Unknown
event types only move ``last_t``, so the engine may grow new events before the view learns them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.view.panels import (
    Averaging,
    Collab,
    DataSet,
    Header,
    LogEntry,
    RecentStep,
    StateSync,
    Training,
)
from crowdtrain.volunteer.view.rules import (
    AVERAGING_RULES,
    COLLAB_RULES,
    DATA_RULES,
    HEADER_RULES,
    LOG_LINES,
    LOSS_POINTS,
    SYNC_RULES,
    TRAINING_RULES,
    logged,
    moved,
)


@dataclass(frozen=True, slots=True)
class ViewState:
    header: Header = field(default_factory=Header)
    collab: Collab = field(default_factory=Collab)
    training: Training = field(default_factory=Training)
    data: DataSet = field(default_factory=DataSet)
    averaging: Averaging = field(default_factory=Averaging)
    sync: StateSync = field(default_factory=StateSync)
    log: tuple[LogEntry, ...] = ()
    last_t: float | None = None  # time of the newest event seen

    @property
    def lag(self) -> int | None:
        """Steps this machine is behind the collaboration (global − local), when both are known."""
        global_step, local_step = self.collab.global_step, self.training.local_step
        if global_step is None or local_step is None:
            return None
        return max(0, global_step - local_step)


def apply(state: ViewState, event: ev.Event) -> ViewState:
    """The snapshot after ``event``. Pure: ``state`` is not changed."""
    t = event.t
    newer = math.isfinite(t) and (state.last_t is None or t > state.last_t)
    return ViewState(
        header=moved(HEADER_RULES, state.header, event),
        collab=moved(COLLAB_RULES, state.collab, event),
        training=moved(TRAINING_RULES, state.training, event),
        data=moved(DATA_RULES, state.data, event),
        averaging=moved(AVERAGING_RULES, state.averaging, event),
        sync=moved(SYNC_RULES, state.sync, event),
        log=logged(state.log, event),
        last_t=t if newer else state.last_t,
    )


def fold(events: Iterable[ev.Event], state: ViewState | None = None) -> ViewState:
    """Apply every event in order, starting from ``state`` (an empty snapshot by default)."""
    state = state if state is not None else ViewState()
    for event in events:
        state = apply(state, event)
    return state


__all__ = ["LOG_LINES", "LOSS_POINTS", "LogEntry", "RecentStep", "ViewState", "apply", "fold"]
