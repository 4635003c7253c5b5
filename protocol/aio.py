"""Small asyncio pieces every layer uses."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

try:  # (not on Windows: there, "acknowledged" cannot be known)
    import fcntl
    import termios
except ImportError:  # pragma: no cover
    fcntl = termios = None  # type: ignore[assignment]


async def wait_at_most(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` at most ``seconds`` (≤ 0: not at all); True if it is set.

    Not ``asyncio.wait_for``: on Python 3.11 it can swallow a cancellation that arrives as the event is set,
    and a training loop that swallowed Ctrl-C waited for a step reply forever (seen in the across-hosts test:
    the join never exited).
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(0.0, seconds)):
            await event.wait()
    return event.is_set()


class BodyTooLong(Exception):
    """A body went past the limit its reader set; ``size`` is what was read (or declared) by then."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"the body is longer than the {limit} bytes expected")


async def read_body(stream, limit: int, declared: int | None = None) -> bytes:
    """The whole body from ``stream`` (an aiohttp ``StreamReader``), at most ``limit`` bytes, else
    :class:`BodyTooLong`. ``declared`` is the Content-Length, refused before anything is read if over the limit.

    Not one ``stream.read(limit + 1)``: that returns what has arrived so far, which on loopback is the whole body
    and across a real link is a cut one (seen: "RunCreated is not valid JSON: Input data was truncated" in 2 of
    40 ``run create`` across network namespaces). This reads until the end of the body.
    """
    if declared is not None and declared > limit:
        raise BodyTooLong(declared, limit)
    parts: list[bytes] = []
    size = 0
    while chunk := await stream.read(limit + 1 - size):
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            raise BodyTooLong(size, limit)
    return b"".join(parts)


_OUTQ = (
    getattr(termios, "TIOCOUTQ", None) if termios is not None else None
)  # (Linux: SIOCOUTQ, a socket's bytes not yet acknowledged)


async def acknowledged(
    transport: asyncio.BaseTransport | None, seconds: float, poll_s: float = 0.005
) -> bool:
    """Wait (at most ``seconds``) until everything written to ``transport``'s TCP socket was acknowledged
    by the other end: what "sent" means on a slow uplink, where the kernel takes megabytes into its send
    buffer at once. False when that cannot be known here (no socket, not Linux) or did not happen in time."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if _OUTQ is None or sock is None:
        return False
    deadline = time.monotonic() + seconds
    buf = bytearray(4)
    while True:
        try:
            fcntl.ioctl(sock.fileno(), _OUTQ, buf)
        except (OSError, ValueError):  # (ValueError: the socket was closed meanwhile, its fileno is -1)
            return False
        if int.from_bytes(buf, sys.byteorder) == 0:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
