"""Number formats shared by the panels and the plain lines: bytes, rates, durations, ETAs, ratios."""

from __future__ import annotations

import math

_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")
MISSING = "—"
DAY_S = 86_400
MAX_ETA_S = 30 * DAY_S  # an ETA beyond this says nothing a person can use: shown as unknown
MIN_RATE = 1e-6  # per second (samples, bytes): below it a rate is float dust, not progress


def fmt_bytes(n: float | None) -> str:
    """Decimal units, three figures: ``512 B``, ``1.2 MB``, ``34.5 kB``, ``345 kB``."""
    if n is None or not math.isfinite(n):
        return MISSING
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1000:
        return f"{sign}{value:.0f} B"
    for unit in _UNITS[1:]:
        value /= 1000.0
        if value < 99.95:
            return f"{sign}{value:.1f} {unit}"
        if value < 999.5 or unit == _UNITS[-1]:
            return f"{sign}{value:.0f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def fmt_rate(bytes_per_s: float | None) -> str:
    """``1.2 MB/s``."""
    text = fmt_bytes(bytes_per_s)
    return text if text == MISSING else f"{text}/s"


def fmt_duration(seconds: float | None) -> str:
    """``0.25 s``, ``12.5 s``, ``3m 05s``, ``1h 02m``, ``2d 03h``."""
    if seconds is None or not math.isfinite(seconds):
        return MISSING
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    whole = int(s)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < DAY_S:
        return f"{whole // 3600}h {(whole % 3600) // 60:02d}m"
    return f"{whole // DAY_S}d {(whole % DAY_S) // 3600:02d}h"


def fmt_eta(seconds: float | None, rate: float | None = None) -> str:
    """A time still to wait, as :func:`fmt_duration`; ``—`` when it is unknown or absurd: none, not
    finite, negative, over :data:`MAX_ETA_S`, or (above zero) worked out from a ``rate`` of about nothing
    (below :data:`MIN_RATE`: what is left divided by the float dust of a sum of rates gives e.g. 2**47 s)."""
    if seconds is None or not math.isfinite(seconds) or not 0 <= seconds <= MAX_ETA_S:
        return MISSING
    if seconds > 0 and rate is not None and not (math.isfinite(rate) and rate >= MIN_RATE):
        return MISSING
    return fmt_duration(seconds)


def fmt_uptime(seconds: float | None) -> str:
    """Whole seconds: ``45s``, ``3m 05s``, ``1h 02m``."""
    if seconds is None or not math.isfinite(seconds):
        return MISSING
    whole = int(max(0.0, seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    return f"{whole // 3600}h {(whole % 3600) // 60:02d}m"


def fmt_ratio(ratio: float | None) -> str:
    """A compression ratio: ``7.5×``."""
    if ratio is None or not math.isfinite(ratio) or ratio <= 0:
        return MISSING
    return f"{ratio:.1f}×"


def fmt_float(value: float | None, digits: int = 4) -> str:
    if value is None:
        return MISSING
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def fmt_speed(samples_per_s: float | None) -> str:
    """``12.5 samples/s``."""
    if samples_per_s is None or not math.isfinite(samples_per_s):
        return MISSING
    return f"{samples_per_s:.1f} samples/s"


def fmt_percent(fraction: float | None) -> str:
    if fraction is None or not math.isfinite(fraction):
        return MISSING
    return f"{fraction * 100:.0f}%"


def short_id(peer_id: str, width: int = 12) -> str:
    """A peer id cut to ``width`` characters (with an ellipsis) for tables; short ids stay whole."""
    return peer_id if len(peer_id) <= width else peer_id[: width - 1] + "…"


def short_hash(content_hash: str) -> str:
    return content_hash[:12]


def fmt_held_out(loss: float, metrics: dict[str, float]) -> str:
    """``loss 1.234, accuracy 0.912`` (a held-out evaluation)."""
    return ", ".join([f"loss {fmt_float(loss)}", *(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))])
