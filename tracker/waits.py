"""The tracker's long-polls: ``GET /step`` and ``POST /ready`` wait here, the run deciding each answer
(:meth:`RunState.watch_answer`, :meth:`RunState.take_ready`: no clock, no waiting in them); these loops only wait
for the run's next change, within the poll's bound.
"""

from __future__ import annotations

import asyncio
import time

from crowdtrain.protocol.aio import wait_at_most
from crowdtrain.protocol.messages import ReadyReply, StepWatch
from crowdtrain.tracker.collab import RunState
from crowdtrain.tracker.peers import Peer


async def wait_close(run: RunState, step: int, long_poll_s: float) -> StepWatch:
    """``GET /step``: returns once ``step`` closed or passed, once samples of it were freed while it waited (and
    are free still), or after ``long_poll_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + long_poll_s
    freed = run.freed
    while not run.stopping:
        answer = run.watch_answer(step, freed)
        if answer is not None:
            return answer
        freed = run.freed
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        await wait_at_most(run.changed, remaining)
    return run.watch_now()


async def ready_call(
    run: RunState, peer: Peer, step: int, weight: int, long_poll_s: float, ahead: int
) -> ReadyReply:
    """``POST /ready`` of a registered peer: answered with its group once the step's round forms, ``missed``,
    ``open``, or ``wait`` after ``long_poll_s``; the peer seen when it asks and when it is answered."""
    run.asked_ready(peer, step)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + long_poll_s
    while (reply := run.take_ready(peer.peer_id, step, weight, ahead)) is None:
        remaining = deadline - loop.time()
        if remaining <= 0:
            reply = run.ready_expired(peer.peer_id, step)
            break
        await wait_at_most(run.changed, remaining)
    if run.peers.get(peer.peer_id) is peer:
        peer.last_seen = time.monotonic()
    return reply
