"""One line per event: ``--plain`` (for people reading a log) and ``--json`` (for scripts).

:func:`plain_line` gives a line for every event; the chatty, periodic ones (:data:`CHATTY`: swarm
statistics, local-training summaries, collaboration progress, state-download progress) are thinned by
:class:`LineThrottle`, which :class:`~crowdtrain.volunteer.view.live.ViewSink` applies in plain mode only.
JSON mode keeps every event. :func:`parse_json_line` reads a JSON line back into its event (the demo
uses it to follow volunteer processes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from crowdtrain.protocol.errors import ProtocolError
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

CHATTY: tuple[type[ev.Event], ...] = (
    ev.TorrentStats,
    ev.LocalTraining,
    ev.Progress,
    ev.StateSyncProgress,
)
MAX_JSON_LINE = 1 << 20


def stamp(t: float) -> str:
    """The local wall-clock time of an event, ``HH:MM:SS``."""
    return time.strftime("%H:%M:%S", time.localtime(t))


def _ids(ids: tuple[str, ...] | list[str]) -> str:
    return ", ".join(ids)


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


def reachability(event: ev.Reachability) -> tuple[str, str]:
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
            "--advertise HOST:PORT if others reach it at another address"
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


def describe(event: ev.Event) -> tuple[str, str]:
    """The level (``info``, ``warning``, ``error``) and the human text of one event, without the time."""
    match event:
        case ev.Joined():
            where = f"peer server at {event.address}" if event.address else "client mode"
            return "info", (
                f"joined run {event.run_name} ({event.run_id}) at {event.tracker} as {event.peer_id} "
                f"on {event.device}, {where}; global step {event.global_step}, "
                f"target {event.target_batch_size} samples, recipe {event.recipe}, codec {event.codec}"
            )
        case ev.Progress():
            eta = _eta(event.eta_s, event.samples_per_s)
            unreachable = "; peers cannot reach this machine" if not event.reachable else ""
            return "info", (
                f"collaboration at step {event.global_step}: {event.samples}/{event.target} samples, "
                f"{event.peers_online} peers online, {fmt_speed(event.samples_per_s)}{eta}{unreachable}"
            )
        case ev.Reachability():
            return reachability(event)
        case ev.RunNotice():
            if event.message is None:
                return "info", "the tracker reports no run-wide problem any more"
            return "warning", event.message
        case ev.PhaseChanged():
            return "info", f"phase: {event.phase}"
        case ev.StepDone():
            share = event.contributed_samples / event.group_samples if event.group_samples else None
            loss = f", loss {fmt_float(event.loss, 3)}" if event.loss is not None else ""
            return "info", (
                f"step {event.step} done: {event.contributed_samples}/{event.group_samples} samples "
                f"from this machine ({fmt_percent(share)}){loss}, lr {event.lr:.3g}, "
                f"{fmt_duration(event.step_time_s)}, compute {fmt_percent(event.compute_share)}"
            )
        case ev.StepMissed():
            return "warning", (
                f"missed step {event.step} (collaboration at {event.now_step}); "
                f"{event.dropped_samples} samples dropped (computed on that step's parameters); fetching the state"
            )
        case ev.LocalTraining():
            return "info", (
                f"loss {fmt_float(event.loss)}, {event.samples} samples toward this step, "
                f"{fmt_speed(event.samples_per_s)}, {event.micro_batches} micro-batches, "
                f"compute {fmt_percent(event.compute_share)}"
            )
        case ev.LogLine():
            level = event.level.lower()
            return level, event.message
        case ev.ChunkVerified():
            return "info", (
                f"chunk {event.index} verified ({event.name}, {event.samples} samples): "
                f"{event.held}/{event.total} held"
            )
        case ev.TorrentStats():
            ratio = f", ratio {event.uploaded / event.downloaded:.2f}" if event.downloaded else ""
            return "info", (
                f"data: {event.chunks_held}/{event.chunks_total} chunks ({fmt_percent(event.progress)}), "
                f"down {fmt_rate(event.download_rate)}, up {fmt_rate(event.upload_rate)}, "
                f"{event.peers} peers ({event.seeds} seeding){ratio}"
            )
        case ev.RoundDone():
            text = (
                f"{event.kind} round {event.round_id} for step {event.step}: {len(event.members)} members, "
                f"{fmt_duration(event.duration_s)}, sent {fmt_bytes(event.bytes_sent)}, "
                f"received {fmt_bytes(event.bytes_received)}, {fmt_ratio(event.compression_ratio)} compression"
            )
            trouble = round_trouble(event)
            if trouble:
                text += "; " + "; ".join(trouble)
            return ("warning" if event.dropped or event.rejected or event.failed_parts else "info"), text
        case ev.RoundFailed():
            return "warning", f"round {event.round_id} for step {event.step} failed: {event.reason}"
        case ev.StateSyncStarted():
            return "info", (
                f"state sync: fetching step {event.step} ({short_hash(event.content_hash)}), "
                f"{fmt_bytes(event.total_bytes)} from {len(event.donors)} donors"
            )
        case ev.StateSyncProgress():
            fraction = event.done_bytes / event.total_bytes if event.total_bytes else None
            eta = _eta(event.eta_s, event.rate)
            return "info", (
                f"state sync: {fmt_bytes(event.done_bytes)}/{fmt_bytes(event.total_bytes)} "
                f"({fmt_percent(fraction)}) at {fmt_rate(event.rate)}, {event.donors_active} donors{eta}"
            )
        case ev.DonorBanned():
            return "warning", f"state sync: donor {event.donor} banned: {event.reason}"
        case ev.StateLoaded():
            return "info", (
                f"state loaded: step {event.step} ({short_hash(event.content_hash)}) "
                f"in {fmt_duration(event.duration_s)} from {_ids(event.donors_used) or 'no donor'}"
            )
        case ev.Evaluated():
            return (
                "info",
                f"held-out evaluation of step {event.step}: {fmt_held_out(event.loss, event.metrics)}",
            )
        case ev.StateServed():
            return "info", (
                f"serving state of step {event.step} ({short_hash(event.content_hash)}, {fmt_bytes(event.size)})"
            )
        case ev.Left():
            return "info", f"left the run: {event.reason}"
    fields = {k: v for k, v in ev.to_dict(event).items() if k not in ("event", "t")}
    return "info", f"{type(event).__name__} " + " ".join(f"{k}={v}" for k, v in fields.items())


def plain_line(event: ev.Event) -> str | None:
    """``HH:MM:SS text`` for one event; warnings and errors carry their level.

    Never ``None`` today: thinning the chatty events is :class:`LineThrottle`'s job, so a caller that
    wants every line (a test, a log file) gets them all. ``None`` stays in the signature for events a
    future version may choose not to print at all.
    """
    level, text = describe(event)
    tag = "" if level == "info" else f"{level.upper()} "
    return f"{stamp(event.t)} {tag}{text}"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN or infinity
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def json_line(event: ev.Event) -> str:
    """The event as one JSON object (``events.to_dict``); non-finite floats become ``null``."""
    return json.dumps(_clean(ev.to_dict(event)), ensure_ascii=False, separators=(",", ":"))


def _event_types() -> dict[str, type[ev.Event]]:
    found: dict[str, type[ev.Event]] = {}
    for value in vars(ev).values():
        if isinstance(value, type) and issubclass(value, ev.Event) and value is not ev.Event:
            found[value.__name__] = value
    return found


EVENT_TYPES = _event_types()


def parse_json_line(line: str) -> ev.Event:
    """The event a :func:`json_line` stands for. Raises :class:`ProtocolError` on anything else."""
    if len(line) > MAX_JSON_LINE:
        raise ProtocolError(f"event line of {len(line)} characters is longer than {MAX_JSON_LINE}")
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"event line is not JSON ({exc}); expected one object per line") from exc
    if not isinstance(data, dict) or not isinstance(data.get("event"), str):
        raise ProtocolError('event line must be a JSON object with an "event" name')
    cls = EVENT_TYPES.get(data["event"])
    if cls is None:
        raise ProtocolError(f"unknown event {data['event']!r}; known: {', '.join(sorted(EVENT_TYPES))}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        kind = str(f.type)
        if kind.startswith("tuple") and isinstance(value, list):
            value = tuple(value)
        elif kind == "float" and value is None:
            value = math.nan
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ProtocolError(f"event line for {cls.__name__} has wrong fields: {exc}") from exc


class LineThrottle:
    """Lets through at most one chatty event of each type per ``interval_s`` of event time; all others pass."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[type[ev.Event], float] = {}

    def admit(self, event: ev.Event) -> bool:
        kind = type(event)
        if kind not in CHATTY or self.interval_s <= 0:
            return True
        last = self._last.get(kind)
        if last is not None and event.t - last < self.interval_s:
            return False
        self._last[kind] = event.t
        return True
