"""Noticing that this volunteer was asleep: a laptop's lid closed, the process stopped (SIGSTOP) or starved.

While the process sleeps the monotonic clock runs on, so a request to the tracker that was in flight times
out the moment the process wakes, however fast the tracker answered: that says nothing of the tracker. A
watcher task sleeps in short ticks and measures how late each one ends; a tick late by more than
:data:`LEAP_S` is a sleep of that length. The volunteer's notes about a tracker that did not answer say so
instead of blaming the tracker or the network, when such a sleep ended within that request's timeout.
"""

from __future__ import annotations

import asyncio
import logging

from crowdtrain.protocol.aio import wait_at_most

TICK_S = 0.5  # how often the watcher looks at the clock
LEAP_S = 2.0  # a tick this much late: the process was asleep (or starved) that long


class Sleeps:
    """When this process last woke from a sleep, and how long it slept (``watch`` keeps them)."""

    def __init__(self) -> None:
        self.woke_at: float | None = None  # loop time
        self.slept_s = 0.0
        self._tick: float | None = None  # when the watcher's current tick began (loop time)

    async def watch(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            before = self._tick = loop.time()
            await wait_at_most(stop, TICK_S)
            late = loop.time() - before - TICK_S
            if late > LEAP_S and not stop.is_set():
                self.woke_at, self.slept_s = loop.time(), late
                logging.getLogger(__name__).info("this process was asleep for %.1f s", late)

    def recent(self, within_s: float) -> float | None:
        """How long this process slept, if it woke less than ``within_s`` seconds ago (None: it did not). A
        sleep that just ended counts before the watcher has run again (the first callbacks after a wake may
        be a request's timeout)."""
        now = asyncio.get_running_loop().time()
        if self._tick is not None and now - self._tick - TICK_S > LEAP_S:
            return now - self._tick - TICK_S
        if self.woke_at is None:
            return None
        return self.slept_s if now - self.woke_at <= within_s else None
