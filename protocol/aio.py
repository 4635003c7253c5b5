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
