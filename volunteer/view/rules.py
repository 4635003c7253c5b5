"""How each event moves each panel's record: one table of small pure rules per panel, and the log tail's.

A rule takes a panel's record (:mod:`~crowdtrain.volunteer.view.panels`) and one event of its key's type
and returns the record after it; it reads nothing but its own record and the event. An event that moves
three panels (a loaded state moves the collaboration's step, this machine's step and the sync panel) has
a rule in each of the three tables. :func:`~crowdtrain.volunteer.view.state.apply` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

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
from crowdtrain.volunteer.view.sentences import describe, troubled

LOSS_POINTS = 60  # loss values kept for the sparkline
RECENT_STEPS = 10  # steps over which step time and contribution share are averaged
LOG_LINES = 6  # log lines kept for the panel
BANNED_KEPT = 8  # banned donors remembered

P = TypeVar("P")
# A panel's rules: for each event type that moves the panel, the record after that event. Each rule takes
# the event of its key's type, which a dict's type cannot say: hence Any.
Rules = dict[type[ev.Event], Callable[[P, Any], P]]


def _tail(items: tuple, item: object, keep: int) -> tuple:
    return (*items[-(keep - 1) :], item) if keep > 1 else (item,)


def _max_step(current: int | None, candidate: int) -> int:
    return candidate if current is None else max(current, candidate)


def _newest(known: float | None, told: float | None) -> float | None:
    """An event that does not know a figure (``None``) keeps the last one known."""
    return known if told is None else told


# ------------------------------------------------------------ header


def _header_joined(h: Header, e: ev.Joined) -> Header:
    return replace(
        h,
        run_id=e.run_id,
        run_name=e.run_name,
        tracker=e.tracker,
        peer_id=e.peer_id,
        device=e.device,
        address=e.address,
        recipe=e.recipe,
        codec=e.codec,
        joined_at=e.t,
        left_reason=None,
    )


def _header_reachability(h: Header, e: ev.Reachability) -> Header:
    level, text = describe(e)
    return replace(h, address=e.address, reachable=e.reachable, reach_text=text, reach_level=level)


def _header_progress(h: Header, e: ev.Progress) -> Header:
    return replace(h, reachable=e.reachable)


def _header_notice(h: Header, e: ev.RunNotice) -> Header:
    return replace(h, notice=e.message)


def _header_phase(h: Header, e: ev.PhaseChanged) -> Header:
    return replace(h, phase=e.phase)


def _header_left(h: Header, e: ev.Left) -> Header:
    return replace(h, left_reason=e.reason, phase="left")


HEADER_RULES: Rules[Header] = {
    ev.Joined: _header_joined,
    ev.Progress: _header_progress,
    ev.Reachability: _header_reachability,
    ev.RunNotice: _header_notice,
    ev.PhaseChanged: _header_phase,
    ev.Left: _header_left,
}


# ------------------------------------------------------------ collaboration


def _collab_progress(c: Collab, e: ev.Progress) -> Collab:
    return replace(
        c,
        global_step=e.global_step,
        samples=e.samples,
        target=e.target,
        peers_online=e.peers_online,
        run_samples_per_s=e.samples_per_s,
        eta_s=e.eta_s,
    )


def _collab_joined(c: Collab, e: ev.Joined) -> Collab:
    step = _max_step(c.global_step, e.global_step)
    return replace(c, global_step=step, target=e.target_batch_size, total_steps=e.total_steps)


def _collab_step_done(c: Collab, e: ev.StepDone) -> Collab:
    return replace(c, global_step=_max_step(c.global_step, e.step + 1))


def _collab_step_missed(c: Collab, e: ev.StepMissed) -> Collab:
    return replace(c, global_step=_max_step(c.global_step, e.now_step))


def _collab_state_seen(c: Collab, e: ev.StateSyncStarted | ev.StateLoaded) -> Collab:
    """A state of step N exists (being fetched, or loaded): the collaboration is at N at least."""
    return replace(c, global_step=_max_step(c.global_step, e.step))


COLLAB_RULES: Rules[Collab] = {
    ev.Joined: _collab_joined,
    ev.Progress: _collab_progress,
    ev.StepDone: _collab_step_done,
    ev.StepMissed: _collab_step_missed,
    ev.StateSyncStarted: _collab_state_seen,
    ev.StateLoaded: _collab_state_seen,
}


# ------------------------------------------------------------ local training


def _training_joined(t: Training, e: ev.Joined) -> Training:
    # A run at step 0 starts from the recipe's initial weights: nothing to catch up.
    t = replace(t, local=e.inner_steps > 1)
    return replace(t, local_step=0) if e.global_step == 0 and t.local_step is None else t


def _training_step_done(t: Training, e: ev.StepDone) -> Training:
    recent = RecentStep(e.step, e.contributed_samples, e.group_samples, e.step_time_s, e.wall_s)
    return replace(
        t,
        recent_steps=_tail(t.recent_steps, recent, RECENT_STEPS),
        steps_done=t.steps_done + 1,
        lr=e.lr,
        compute_share=_newest(t.compute_share, e.compute_share),
        local_step=e.step + 1,
        local_samples=0,
        inner_steps=None if t.inner_steps is None else 0,  # (a new round: none taken yet)
    )


def _training_step_missed(t: Training, e: ev.StepMissed) -> Training:
    return replace(
        t,
        steps_missed=t.steps_missed + 1,
        local_samples=0,
        samples_dropped=t.samples_dropped + e.dropped_samples,
    )


def _training_local(t: Training, e: ev.LocalTraining) -> Training:
    return replace(
        t,
        loss=e.loss,
        loss_history=_tail(t.loss_history, e.loss, LOSS_POINTS),
        local_samples=e.samples,
        local_samples_per_s=e.samples_per_s,
        micro_batches=e.micro_batches,
        inner_steps=e.inner_steps,
        inner_lr=_newest(t.inner_lr, e.inner_lr),
        compute_share=_newest(t.compute_share, e.compute_share),
    )


def _training_loaded(t: Training, e: ev.StateLoaded) -> Training:
    return replace(t, local_step=e.step)


def _training_evaluated(t: Training, e: ev.Evaluated) -> Training:
    return replace(t, held_out=(e.step, e.loss, dict(e.metrics)))


TRAINING_RULES: Rules[Training] = {
    ev.Joined: _training_joined,
    ev.StepDone: _training_step_done,
    ev.StepMissed: _training_step_missed,
    ev.LocalTraining: _training_local,
    ev.StateLoaded: _training_loaded,
    ev.Evaluated: _training_evaluated,
}


# ------------------------------------------------------------ data set


def _data_torrent(d: DataSet, e: ev.TorrentStats) -> DataSet:
    return replace(
        d,
        chunks_held=e.chunks_held,
        chunks_total=e.chunks_total,
        download_rate=e.download_rate,
        upload_rate=e.upload_rate,
        swarm_peers=e.peers,
        swarm_seeds=e.seeds,
        downloaded=e.downloaded,
        uploaded=e.uploaded,
    )


def _data_chunk(d: DataSet, e: ev.ChunkVerified) -> DataSet:
    return replace(d, chunks_held=e.held, chunks_total=e.total, last_chunk=e.name)


DATA_RULES: Rules[DataSet] = {ev.ChunkVerified: _data_chunk, ev.TorrentStats: _data_torrent}


# ------------------------------------------------------------ averaging


def _averaging_done(a: Averaging, e: ev.RoundDone) -> Averaging:
    return replace(
        a,
        last_round=e,
        rounds_done=a.rounds_done + 1,
        bytes_sent_total=a.bytes_sent_total + e.bytes_sent,
        raw_bytes_total=a.raw_bytes_total + e.raw_bytes,
    )


def _averaging_failed(a: Averaging, e: ev.RoundFailed) -> Averaging:
    return replace(a, rounds_failed=a.rounds_failed + 1, last_failure=f"step {e.step}: {e.reason}")


AVERAGING_RULES: Rules[Averaging] = {ev.RoundDone: _averaging_done, ev.RoundFailed: _averaging_failed}


# ------------------------------------------------------------ state sync


def _sync_started(s: StateSync, e: ev.StateSyncStarted) -> StateSync:
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
    )


def _sync_progress(s: StateSync, e: ev.StateSyncProgress) -> StateSync:
    return replace(
        s,
        syncing=True,
        sync_done_bytes=e.done_bytes,
        sync_total_bytes=e.total_bytes,
        sync_rate=e.rate,
        sync_eta_s=e.eta_s,
        donors_active=e.donors_active,
    )


def _sync_loaded(s: StateSync, e: ev.StateLoaded) -> StateSync:
    return replace(
        s,
        syncing=False,
        state_step=e.step,
        state_hash=e.content_hash,
        last_sync_s=e.duration_s,
        sync_done_bytes=s.sync_total_bytes,
    )


def _sync_banned(s: StateSync, e: ev.DonorBanned) -> StateSync:
    return replace(s, donors_banned=_tail(s.donors_banned, (e.donor, e.reason), BANNED_KEPT))


def _sync_served(s: StateSync, e: ev.StateServed) -> StateSync:
    return replace(s, served_step=e.step, served_size=e.size, served_hash=e.content_hash)


SYNC_RULES: Rules[StateSync] = {
    ev.StateSyncStarted: _sync_started,
    ev.StateSyncProgress: _sync_progress,
    ev.DonorBanned: _sync_banned,
    ev.StateLoaded: _sync_loaded,
    ev.StateServed: _sync_served,
}


# ------------------------------------------------------------ log tail


def _always(event: ev.Event) -> bool:
    return True


# The events the log panel keeps, and when. The periodic ones (progress, phases, steps, swarm and download
# figures) never: the panels above show them. A round only when something went wrong in it.
LOGGED: dict[type[ev.Event], Callable[[Any], bool]] = {
    ev.Joined: _always,
    ev.Reachability: _always,
    ev.PortMapped: _always,
    ev.RunNotice: _always,
    ev.StepMissed: _always,
    ev.LogLine: _always,
    ev.RoundDone: troubled,
    ev.RoundFailed: _always,
    ev.AnswerRefused: _always,
    ev.MemberPulling: _always,
    ev.StateSyncStarted: _always,
    ev.DonorBanned: _always,
    ev.StateLoaded: _always,
    ev.Evaluated: _always,
    ev.Left: _always,
}


def logged(log: tuple[LogEntry, ...], event: ev.Event) -> tuple[LogEntry, ...]:
    """The log tail after ``event``: its sentence appended when :data:`LOGGED` keeps it, the oldest dropped."""
    keep = LOGGED.get(type(event))
    if keep is None or not keep(event):
        return log
    level, text = describe(event)
    return _tail(log, LogEntry(event.t, level, text), LOG_LINES)


# ------------------------------------------------------------ a panel's record after an event


def moved(rules: Rules[P], record: P, event: ev.Event) -> P:
    """``record`` after ``event``: its rule for the event's type, or unchanged when it has none."""
    rule = rules.get(type(event))
    return record if rule is None else rule(record, event)


__all__ = [
    "AVERAGING_RULES",
    "COLLAB_RULES",
    "DATA_RULES",
    "HEADER_RULES",
    "LOGGED",
    "LOG_LINES",
    "LOSS_POINTS",
    "SYNC_RULES",
    "TRAINING_RULES",
    "Rules",
    "logged",
    "moved",
]
