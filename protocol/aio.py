"""Small asyncio pieces every layer uses."""

from __future__ import annotations

import asyncio
import contextlib


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
