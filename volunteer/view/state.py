"""What the view shows, as one frozen snapshot, and :func:`apply`, which folds one event into it.

The snapshot holds figures only (no rich, no clocks): :func:`~crowdtrain.volunteer.view.render.render`
draws it, the demo turns it into a row. Unknown event types only move ``last_t``, so the engine may grow
new events before the view learns them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.view.lines import describe

LOSS_POINTS = 60  # loss values kept for the sparkline
RECENT_STEPS = 10  # steps over which step time and contribution share are averaged
LOG_LINES = 6  # log lines kept for the panel
BANNED_KEPT = 8  # banned donors remembered


@dataclass(frozen=True, slots=True)
class RecentStep:
    step: int
    contributed: int
    group: int
    step_time_s: float


@dataclass(frozen=True, slots=True)
class LogEntry:
    t: float
    level: str
    message: str


@dataclass(frozen=True, slots=True)
class ViewState:
    # header
    run_id: str = ""
    run_name: str = ""
    tracker: str = ""
    peer_id: str = ""
    device: str = ""
    address: str | None = None
    recipe: str = ""
    codec: str = ""
    joined_at: float | None = None
    last_t: float | None = None  # time of the newest event seen
    phase: str = "starting"
    left_reason: str | None = None
    # collaboration
    global_step: int | None = None
    samples: int = 0
    target: int = 0
    peers_online: int = 0
    run_samples_per_s: float = 0.0
    eta_s: float | None = None
    reachable: bool | None = None
    reach_text: str | None = None  # the Reachability sentence
    reach_level: str = "info"
    notice: str | None = None  # a run-wide problem reported by the tracker
    recent_steps: tuple[RecentStep, ...] = ()
    steps_done: int = 0
    steps_missed: int = 0
    samples_dropped: int = 0  # accumulated on parameters of a missed step, never averaged
    # local training
    local_step: int | None = None
    lr: float | None = None
    loss: float | None = None
    loss_history: tuple[float, ...] = ()
    # the newest held-out evaluation (the run's eval split): (step, loss, metrics)
    held_out: tuple[int, float, dict[str, float]] | None = None
    local_samples: int = 0
    local_samples_per_s: float = 0.0
    micro_batches: int = 0
    # share of wall time since the first micro-batch spent computing gradients that entered an average;
    # the newest known figure (an event that does not know it keeps the last one)
    compute_share: float | None = None
    # data set
    chunks_held: int = 0
    chunks_total: int = 0
    last_chunk: str | None = None
    download_rate: float = 0.0
    upload_rate: float = 0.0
    swarm_peers: int = 0
    swarm_seeds: int = 0
    downloaded: int = 0
    uploaded: int = 0
    # averaging
    last_round: ev.RoundDone | None = None
    rounds_done: int = 0
    rounds_failed: int = 0
    last_failure: str | None = None
    bytes_sent_total: int = 0
    raw_bytes_total: int = 0
    # state sync
    state_step: int | None = None
    state_hash: str | None = None
    syncing: bool = False
    sync_step: int | None = None
    sync_hash: str | None = None
    sync_done_bytes: int = 0
    sync_total_bytes: int = 0
    sync_rate: float = 0.0
    sync_eta_s: float | None = None
    sync_donors: tuple[str, ...] = ()
    donors_active: int = 0
    donors_banned: tuple[tuple[str, str], ...] = ()  # (donor, reason), newest last
    last_sync_s: float | None = None
    served_step: int | None = None
    served_size: int = 0
    served_hash: str | None = None
    # log tail
    log: tuple[LogEntry, ...] = ()

    # ------------------------------------------------------------ derived figures

    @property
    def lag(self) -> int | None:
        """Steps this machine is behind the collaboration (global − local), when both are known."""
        if self.global_step is None or self.local_step is None:
            return None
        return max(0, self.global_step - self.local_step)

    @property
    def step_time_s(self) -> float | None:
        """Mean wall time of the recent steps."""
        if not self.recent_steps:
            return None
        return sum(s.step_time_s for s in self.recent_steps) / len(self.recent_steps)

    @property
    def contribution_share(self) -> float | None:
        """My samples / the group's samples over the recent steps."""
        group = sum(s.group for s in self.recent_steps)
        if not group:
            return None
        return sum(s.contributed for s in self.recent_steps) / group

    @property
    def seeding_ratio(self) -> float | None:
        """Uploaded / downloaded payload bytes."""
        return self.uploaded / self.downloaded if self.downloaded else None

    @property
    def target_fraction(self) -> float | None:
        return min(1.0, self.samples / self.target) if self.target else None

    @property
    def chunks_fraction(self) -> float | None:
        return self.chunks_held / self.chunks_total if self.chunks_total else None

    @property
    def sync_fraction(self) -> float | None:
        return self.sync_done_bytes / self.sync_total_bytes if self.sync_total_bytes else None

    @property
    def overall_compression(self) -> float | None:
        return self.raw_bytes_total / self.bytes_sent_total if self.bytes_sent_total else None

    def uptime(self, now: float | None) -> float | None:
        if self.joined_at is None or now is None:
            return None
        return max(0.0, now - self.joined_at)


def _tail(items: tuple, item: object, keep: int) -> tuple:
    return (*items[-(keep - 1) :], item) if keep > 1 else (item,)


def _logged(state: ViewState, event: ev.Event) -> tuple[LogEntry, ...]:
    level, text = describe(event)
    return _tail(state.log, LogEntry(event.t, level, text), LOG_LINES)


def _max_step(current: int | None, candidate: int) -> int:
    return candidate if current is None else max(current, candidate)


def _joined(s: ViewState, e: ev.Joined) -> ViewState:
    return replace(
        s,
        run_id=e.run_id,
        run_name=e.run_name,
        tracker=e.tracker,
        peer_id=e.peer_id,
        device=e.device,
        address=e.address,
        recipe=e.recipe,
        codec=e.codec,
        joined_at=e.t,
        global_step=_max_step(s.global_step, e.global_step),
        target=e.target_batch_size,
        # A run at step 0 starts from the recipe's initial weights: nothing to catch up.
        local_step=0 if e.global_step == 0 and s.local_step is None else s.local_step,
        left_reason=None,
        log=_logged(s, e),
    )


def _progress(s: ViewState, e: ev.Progress) -> ViewState:
    return replace(
        s,
        global_step=e.global_step,
        samples=e.samples,
        target=e.target,
        peers_online=e.peers_online,
        run_samples_per_s=e.samples_per_s,
        eta_s=e.eta_s,
        reachable=e.reachable,
    )


def _reachability(s: ViewState, e: ev.Reachability) -> ViewState:
    level, text = describe(e)
    return replace(
        s,
        address=e.address,
        reachable=e.reachable,
        reach_text=text,
        reach_level=level,
        log=_logged(s, e),
    )


def _notice(s: ViewState, e: ev.RunNotice) -> ViewState:
    return replace(s, notice=e.message, log=_logged(s, e))


def _phase(s: ViewState, e: ev.PhaseChanged) -> ViewState:
    return replace(s, phase=e.phase)


def _step_done(s: ViewState, e: ev.StepDone) -> ViewState:
    recent = RecentStep(e.step, e.contributed_samples, e.group_samples, e.step_time_s)
    return replace(
        s,
        recent_steps=_tail(s.recent_steps, recent, RECENT_STEPS),
        steps_done=s.steps_done + 1,
        lr=e.lr,
        compute_share=s.compute_share if e.compute_share is None else e.compute_share,
        local_step=e.step + 1,
        global_step=_max_step(s.global_step, e.step + 1),
        local_samples=0,
    )


def _step_missed(s: ViewState, e: ev.StepMissed) -> ViewState:
    return replace(
        s,
        steps_missed=s.steps_missed + 1,
        global_step=_max_step(s.global_step, e.now_step),
        local_samples=0,
        samples_dropped=s.samples_dropped + e.dropped_samples,
        log=_logged(s, e),
    )


def _local(s: ViewState, e: ev.LocalTraining) -> ViewState:
    return replace(
        s,
        loss=e.loss,
        loss_history=_tail(s.loss_history, e.loss, LOSS_POINTS),
        local_samples=e.samples,
        local_samples_per_s=e.samples_per_s,
        micro_batches=e.micro_batches,
        compute_share=s.compute_share if e.compute_share is None else e.compute_share,
    )


def _log_line(s: ViewState, e: ev.LogLine) -> ViewState:
    return replace(s, log=_logged(s, e))


def _chunk(s: ViewState, e: ev.ChunkVerified) -> ViewState:
    return replace(s, chunks_held=e.held, chunks_total=e.total, last_chunk=e.name)


def _torrent(s: ViewState, e: ev.TorrentStats) -> ViewState:
    return replace(
        s,
        chunks_held=e.chunks_held,
        chunks_total=e.chunks_total,
        download_rate=e.download_rate,
        upload_rate=e.upload_rate,
        swarm_peers=e.peers,
        swarm_seeds=e.seeds,
        downloaded=e.downloaded,
        uploaded=e.uploaded,
    )


def _round_done(s: ViewState, e: ev.RoundDone) -> ViewState:
    troubled = e.dropped or e.rejected or e.failed_parts
    return replace(
        s,
        last_round=e,
        rounds_done=s.rounds_done + 1,
        bytes_sent_total=s.bytes_sent_total + e.bytes_sent,
        raw_bytes_total=s.raw_bytes_total + e.raw_bytes,
        log=_logged(s, e) if troubled else s.log,
    )


def _round_failed(s: ViewState, e: ev.RoundFailed) -> ViewState:
    return replace(
        s,
        rounds_failed=s.rounds_failed + 1,
        last_failure=f"step {e.step}: {e.reason}",
        log=_logged(s, e),
    )


def _sync_started(s: ViewState, e: ev.StateSyncStarted) -> ViewState:
    return replace(
        s,
        syncing=True,
        sync_step=e.step,
        sync_hash=e.content_hash,
        sync_done_bytes=0,
        sync_total_bytes=e.total_bytes,
        sync_rate=0.0,
        sync_eta_s=None,
        sync_donors=e.donors,
        donors_active=len(e.donors),
        global_step=_max_step(s.global_step, e.step),
        log=_logged(s, e),
    )


def _sync_progress(s: ViewState, e: ev.StateSyncProgress) -> ViewState:
    return replace(
        s,
        syncing=True,
        sync_done_bytes=e.done_bytes,
        sync_total_bytes=e.total_bytes,
        sync_rate=e.rate,
        sync_eta_s=e.eta_s,
        donors_active=e.donors_active,
    )


def _banned(s: ViewState, e: ev.DonorBanned) -> ViewState:
    return replace(
        s, donors_banned=_tail(s.donors_banned, (e.donor, e.reason), BANNED_KEPT), log=_logged(s, e)
    )


def _loaded(s: ViewState, e: ev.StateLoaded) -> ViewState:
    return replace(
        s,
        syncing=False,
        state_step=e.step,
        state_hash=e.content_hash,
        local_step=e.step,
        global_step=_max_step(s.global_step, e.step),
        last_sync_s=e.duration_s,
        sync_done_bytes=s.sync_total_bytes,
        log=_logged(s, e),
    )


def _evaluated(s: ViewState, e: ev.Evaluated) -> ViewState:
    return replace(s, held_out=(e.step, e.loss, dict(e.metrics)), log=_logged(s, e))


def _served(s: ViewState, e: ev.StateServed) -> ViewState:
    return replace(s, served_step=e.step, served_size=e.size, served_hash=e.content_hash)


def _left(s: ViewState, e: ev.Left) -> ViewState:
    return replace(s, left_reason=e.reason, phase="left", log=_logged(s, e))


_HANDLERS: dict[type[ev.Event], Callable[[ViewState, ev.Event], ViewState]] = {
    ev.Joined: _joined,
    ev.Progress: _progress,
    ev.PhaseChanged: _phase,
    ev.Reachability: _reachability,
    ev.RunNotice: _notice,
    ev.StepDone: _step_done,
    ev.StepMissed: _step_missed,
    ev.LocalTraining: _local,
    ev.LogLine: _log_line,
    ev.ChunkVerified: _chunk,
    ev.TorrentStats: _torrent,
    ev.RoundDone: _round_done,
    ev.RoundFailed: _round_failed,
    ev.StateSyncStarted: _sync_started,
    ev.StateSyncProgress: _sync_progress,
    ev.DonorBanned: _banned,
    ev.StateLoaded: _loaded,
    ev.StateServed: _served,
    ev.Evaluated: _evaluated,
    ev.Left: _left,
}  # type: ignore[dict-item]


def apply(state: ViewState, event: ev.Event) -> ViewState:
    """The snapshot after ``event``. Pure: ``state`` is not changed."""
    handler = _HANDLERS.get(type(event))
    if handler is not None:
        state = handler(state, event)
    t = event.t
    if math.isfinite(t) and (state.last_t is None or t > state.last_t):
        state = replace(state, last_t=t)
    return state


def fold(events: Iterable[ev.Event], state: ViewState | None = None) -> ViewState:
    """Apply every event in order, starting from ``state`` (an empty snapshot by default)."""
    state = state if state is not None else ViewState()
    for event in events:
        state = apply(state, event)
    return state


__all__ = ["LogEntry", "RecentStep", "ViewState", "apply", "fold"]
