"""A volunteer notices it was asleep (volunteer/suspend.py): its event loop's clock leapt while nothing ran.

A blocking ``time.sleep`` in a coroutine stands in for the process being stopped (SIGSTOP is in
tests/test_stragglers.py): for the loop it is the same, no callback runs and the monotonic clock moves on.
"""

from __future__ import annotations

import asyncio
import time

from crowdtrain.volunteer.suspend import LEAP_S, TICK_S, Sleeps


async def test_a_sleep_is_seen_at_once_on_waking_and_remembered_for_a_while():
    sleeps, stop = Sleeps(), asyncio.Event()
    watcher = asyncio.create_task(sleeps.watch(stop))
    await asyncio.sleep(2 * TICK_S)
    assert sleeps.recent(60) is None  # awake so far
    time.sleep(LEAP_S + 1.0)  # noqa: ASYNC251 (on purpose: asleep, nothing runs)
    # the first thing to run after waking (e.g. a request's timeout) already knows, before the watcher ran
    slept = sleeps.recent(60)
    assert slept is not None and slept >= LEAP_S
    await asyncio.sleep(2 * TICK_S)
    remembered = sleeps.recent(60)
    assert remembered is not None and remembered >= LEAP_S  # the watcher kept it
    assert sleeps.recent(0.0) is None  # but only for as long as asked
    stop.set()
    await watcher


async def test_a_busy_loop_below_the_leap_is_no_sleep():
    sleeps, stop = Sleeps(), asyncio.Event()
    watcher = asyncio.create_task(sleeps.watch(stop))
    for _ in range(4):
        time.sleep(TICK_S / 2)  # noqa: ASYNC251 (on purpose: a slow callback, not a sleep)
        await asyncio.sleep(0)
    await asyncio.sleep(2 * TICK_S)
    assert sleeps.recent(60) is None
    stop.set()
    await watcher
