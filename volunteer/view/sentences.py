"""The sentence each event stands for: its level (``info``, ``warning``, ``error``) and its human text.

:func:`describe` looks the event's type up in :data:`SENTENCES`, a table of one small function per event
type, so a new event is one new function and one new row, never a longer branch. The ``--plain`` lines
(:mod:`~crowdtrain.volunteer.view.lines`) and the view's log panel and reachability line
(:mod:`~crowdtrain.volunteer.view.state`) all read their text from here, so they never disagree. An event
type the table does not know is written as its name and fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.view.fmt import (
    MISSING,
    fmt_bytes,
    fmt_duration,
    fmt_eta,
    fmt_float,
    fmt_held_out,
    fmt_percent,
    fmt_rate,
    fmt_ratio,
    fmt_speed,
    short_hash,
)

Sentence = tuple[str, str]  # (level, text)


def _ids(ids: Sequence[str]) -> str:
    return ", ".join(ids)


def troubled(r: ev.RoundDone) -> bool:
    """Whether a round lost something (a member dropped or rejected, a part failed): a warning, and a line
    the log panel keeps. A clipped contribution or a duplicate alone is not trouble."""
    return bool(r.dropped or r.rejected or r.failed_parts)


def round_trouble(r: ev.RoundDone, fmt_ids: Callable[[Sequence[str]], str] = _ids) -> list[str]:
    """What went wrong in a round, one phrase per kind (the plain line and the averaging panel share it;
    ``fmt_ids`` formats a list of peer ids, in full by default)."""
    _ids = fmt_ids
    trouble = []
    if r.dropped:
        trouble.append(f"dropped {_ids(r.dropped)}")
    if r.rejected:
        trouble.append(f"rejected {_ids(r.rejected)}")
    if r.clipped:
        trouble.append(f"clipped {_ids(r.clipped)}")
    if r.duplicates:
        trouble.append(f"duplicates from {_ids(r.duplicates)}")
    if r.failed_parts:
        trouble.append(f"failed parts {', '.join(map(str, r.failed_parts))}")
    return trouble


def reachability(event: ev.Reachability) -> Sentence:
    """One sentence: where the tracker reaches this machine for averaging and for BitTorrent, or why not
    and what to do. Warning level when something the user did not ask for is unreachable."""
    level = "info"
    if event.asked_client_mode or event.address is None:
        parts = [
            "client mode (asked for): this machine sends its gradients and gets the average, owns no part and serves no state"
        ]
    elif event.reachable:
        parts = [f"reachable for averaging at {event.address}"]
    else:
        port = event.address.rpartition(":")[2]
        level = "warning"
        parts = [
            f"not reachable for averaging at {event.address} (the tracker could not connect), so this machine "
            f"only sends, like --client-mode; open or forward TCP port {port} to it, or pass "
            "--advertise :PORT if the router forwards another port to it"
        ]
    if event.bt_reachable is True:
        parts.append(f"BitTorrent peers can connect at {event.bt_address}")
    elif event.bt_reachable is False and event.bt_address is not None:
        port = event.bt_address.rpartition(":")[2]
        parts.append(
            f"BitTorrent port {port} is not reachable at {event.bt_address} (chunks still arrive over "
            f"outgoing connections; to serve them to others, forward TCP {port} and pass --bt-port {port})"
        )
    return level, "; ".join(parts)


def _eta(seconds: float | None, rate: float | None) -> str:
    """``, eta 4.00 s``; nothing while the ETA is unknown or absurd (see :func:`fmt_eta`)."""
    text = fmt_eta(seconds, rate)
    return "" if text == MISSING else f", eta {text}"


# ------------------------------------------------------------ one function per event type


def _joined(e: ev.Joined) -> Sentence:
    where = f"peer server at {e.address}" if e.address else "client mode"
    if e.backbone:
        where += ", a backbone (computes no gradients: averages, serves the state and the data set)"
    return "info", (
        f"joined run {e.run_name} ({e.run_id}) at {e.tracker} as {e.peer_id} "
        f"on {e.device}, {where}; global step {e.global_step}, "
        f"target {e.target_batch_size} samples, recipe {e.recipe}, codec {e.codec}" + _local_steps(e)
    )


def _local_steps(e: ev.Joined) -> str:
    if e.inner_bounds is not None:
        lo, hi = e.inner_bounds
        return f"; local steps: an outer round of H inner steps' samples, H chosen by the tracker from {lo} to {hi}"
    return (
        f"; local steps: an outer round of {e.inner_steps} inner steps' samples" if e.inner_steps > 1 else ""
    )


def _progress(e: ev.Progress) -> Sentence:
    eta = _eta(e.eta_s, e.samples_per_s)
    unreachable = "; peers cannot reach this machine" if not e.reachable else ""
    return "info", (
        f"collaboration at step {e.global_step}: {e.samples}/{e.target} samples, "
        f"{e.peers_online} peers online, {fmt_speed(e.samples_per_s)}{eta}{unreachable}"
    )


def _port_mapped(e: ev.PortMapped) -> Sentence:
    if e.external_port is None:
        return "info", f"the router did not forward TCP {e.port} ({e.what}) over {e.via}: {e.error}"
    outside = "" if e.external_port == e.port else f" (as {e.external_port} outside)"
    return "info", f"the router forwards TCP {e.port}{outside} to this machine's {e.what} ({e.via})"


def _notice(e: ev.RunNotice) -> Sentence:
    if e.message is None:
        return "info", "the tracker reports no run-wide problem any more"
    return "warning", e.message


def _phase(e: ev.PhaseChanged) -> Sentence:
    return "info", f"phase: {e.phase}"


def _step_done(e: ev.StepDone) -> Sentence:
    share = e.contributed_samples / e.group_samples if e.group_samples else None
    loss = f", loss {fmt_float(e.loss, 3)}" if e.loss is not None else ""
    mine = f"{e.contributed_samples}/{e.group_samples} samples from this machine ({fmt_percent(share)}){loss}"
    compute = f"compute {fmt_percent(e.compute_share)}"
    if e.local:  # an outer round: its wall time, and its averaging named as such
        wall = "" if e.wall_s is None else f"round {fmt_duration(e.wall_s)}, "
        return "info", (
            f"round {e.step} done: {mine}, outer lr {e.lr:.3g}, {wall}averaging {fmt_duration(e.step_time_s)}, {compute}"
        )
    return "info", f"step {e.step} done: {mine}, lr {e.lr:.3g}, {fmt_duration(e.step_time_s)}, {compute}"


def _step_missed(e: ev.StepMissed) -> Sentence:
    return "warning", (
        f"missed step {e.step} (collaboration at {e.now_step}); "
        f"{e.dropped_samples} samples dropped (computed on that step's parameters); fetching the state"
    )


def _local_training(e: ev.LocalTraining) -> Sentence:
    toward = (
        f"{e.samples} samples toward this step"
        if e.inner_steps is None
        else f"{e.samples} samples and {e.inner_steps} inner steps this round"
        + ("" if e.inner_lr is None else f", inner lr {e.inner_lr:.3g}")
    )
    return "info", (
        f"loss {fmt_float(e.loss)}, {toward}, {fmt_speed(e.samples_per_s)}, {e.micro_batches} micro-batches, "
        f"compute {fmt_percent(e.compute_share)}"
    )


def _log_line(e: ev.LogLine) -> Sentence:
    return e.level.lower(), e.message


def _chunk_verified(e: ev.ChunkVerified) -> Sentence:
    return "info", f"chunk {e.index} verified ({e.name}, {e.samples} samples): {e.held}/{e.total} held"


def _torrent_stats(e: ev.TorrentStats) -> Sentence:
    ratio = f", ratio {e.uploaded / e.downloaded:.2f}" if e.downloaded else ""
    return "info", (
        f"data: {e.chunks_held}/{e.chunks_total} chunks ({fmt_percent(e.progress)}), "
        f"down {fmt_rate(e.download_rate)}, up {fmt_rate(e.upload_rate)}, "
        f"{e.peers} peers ({e.seeds} seeding){ratio}"
    )


def _round_done(e: ev.RoundDone) -> Sentence:
    text = (
        f"{e.kind} round {e.round_id} for step {e.step}: {len(e.members)} members, "
        f"{fmt_duration(e.duration_s)}, sent {fmt_bytes(e.bytes_sent)}, "
        f"received {fmt_bytes(e.bytes_received)}, {fmt_ratio(e.compression_ratio)} compression"
    )
    trouble = round_trouble(e)
    if trouble:
        text += "; " + "; ".join(trouble)
    return ("warning" if troubled(e) else "info"), text


def _round_failed(e: ev.RoundFailed) -> Sentence:
    return "warning", f"round {e.round_id} for step {e.step} failed: {e.reason}"


def _sync_started(e: ev.StateSyncStarted) -> Sentence:
    return "info", (
        f"state sync: fetching step {e.step} ({short_hash(e.content_hash)}), "
        f"{fmt_bytes(e.total_bytes)} from {len(e.donors)} donors"
    )


def _sync_progress(e: ev.StateSyncProgress) -> Sentence:
    fraction = e.done_bytes / e.total_bytes if e.total_bytes else None
    eta = _eta(e.eta_s, e.rate)
    return "info", (
        f"state sync: {fmt_bytes(e.done_bytes)}/{fmt_bytes(e.total_bytes)} "
        f"({fmt_percent(fraction)}) at {fmt_rate(e.rate)}, {e.donors_active} donors{eta}"
    )


def _donor_banned(e: ev.DonorBanned) -> Sentence:
    return "warning", f"state sync: donor {e.donor} banned: {e.reason}"


def _state_loaded(e: ev.StateLoaded) -> Sentence:
    return "info", (
        f"state loaded: step {e.step} ({short_hash(e.content_hash)}) "
        f"in {fmt_duration(e.duration_s)} from {_ids(e.donors_used) or 'no donor'}"
    )


def _evaluated(e: ev.Evaluated) -> Sentence:
    return "info", f"held-out evaluation of step {e.step}: {fmt_held_out(e.loss, e.metrics)}"


def _state_served(e: ev.StateServed) -> Sentence:
    return "info", f"serving state of step {e.step} ({short_hash(e.content_hash)}, {fmt_bytes(e.size)})"


def _answer_refused(e: ev.AnswerRefused) -> Sentence:
    told = f"; the tracker: {e.tracker}" if e.tracker else ""
    return "warning", (
        f"step {e.step}: part {e.part}'s answer from owner {e.owner} refused ({e.reason}){told}"
    )


def _member_pulling(e: ev.MemberPulling) -> Sentence:
    told = f"; the tracker: {e.tracker}" if e.tracker else ""
    return "warning", (
        f"step {e.step}: member {e.member}'s copy points against the others' (cosine {e.alignment:.2f}){told}"
    )


def _left(e: ev.Left) -> Sentence:
    return "info", f"left the run: {e.reason}"


# each function takes the event of its key's type, which a dict's type cannot say: hence Any
SENTENCES: dict[type[ev.Event], Callable[[Any], Sentence]] = {
    ev.Joined: _joined,
    ev.Progress: _progress,
    ev.Reachability: reachability,
    ev.PortMapped: _port_mapped,
    ev.RunNotice: _notice,
    ev.PhaseChanged: _phase,
    ev.StepDone: _step_done,
    ev.StepMissed: _step_missed,
    ev.LocalTraining: _local_training,
    ev.LogLine: _log_line,
    ev.ChunkVerified: _chunk_verified,
    ev.TorrentStats: _torrent_stats,
    ev.RoundDone: _round_done,
    ev.RoundFailed: _round_failed,
    ev.AnswerRefused: _answer_refused,
    ev.MemberPulling: _member_pulling,
    ev.StateSyncStarted: _sync_started,
    ev.StateSyncProgress: _sync_progress,
    ev.DonorBanned: _donor_banned,
    ev.StateLoaded: _state_loaded,
    ev.Evaluated: _evaluated,
    ev.StateServed: _state_served,
    ev.Left: _left,
}


def _fields(event: ev.Event) -> Sentence:
    """An event the table does not know: its type's name and its fields, ``name=value``."""
    fields = {k: v for k, v in ev.to_dict(event).items() if k not in ("event", "t")}
    return "info", f"{type(event).__name__} " + " ".join(f"{k}={v}" for k, v in fields.items())


def describe(event: ev.Event) -> Sentence:
    """The level (``info``, ``warning``, ``error``) and the human text of one event, without the time.

    A subclass of a known event reads as that event (the nearest known type in its MRO)."""
    for kind in type(event).__mro__:
        say = SENTENCES.get(kind)
        if say is not None:
            return say(event)
    return _fields(event)


__all__ = ["SENTENCES", "Sentence", "describe", "reachability", "round_trouble", "troubled"]
