"""One line per event: ``--plain`` (for people reading a log) and ``--json`` (for scripts).

:func:`plain_line` gives a line for every event: its time, and its level unless ``info``, before the
sentence :func:`~crowdtrain.volunteer.view.sentences.describe` gives it. The chatty, periodic ones
(:data:`CHATTY`: swarm statistics, local-training summaries, collaboration progress, state-download
progress) are thinned by :class:`LineThrottle`, which :class:`~crowdtrain.volunteer.view.live.ViewSink`
applies in plain mode only. JSON mode keeps every event. :func:`parse_json_line` reads a JSON line back
into its event (the demo uses it to follow volunteer processes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.view.sentences import describe

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
