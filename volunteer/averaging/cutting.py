"""A member asleep inside a round does not hold the others (issue 27): the group cuts it, through the tracker.

A part owner that sleeps (SIGSTOP, a laptop lid) holds every member: they wait for its answer and for its
copies of their own parts. Each member decides alone to stop waiting for a copy, but an answer is what
every member applies, so giving up on one must be one decision for the whole group
(:mod:`crowdtrain.tracker.cuts`):

* **Vote.** Once the round has been quiet (nothing arrived or went out completely) for ``quiet_s``, this
  member votes to cut every owner whose answer has not begun. The tracker cuts an owner when every other
  member voted before it claimed. Cut: this member stops waiting for its answer (that part is failed,
  zeroed alike by every member) and for its copy of this member's own part; the owner's later copies are
  refused (410).
* **Claim.** This member, as a part owner, asks once its answer went out whether it may apply the round.
  Cut (it was asleep while every other member waited): the round is ``late`` for it, it applies nothing
  and rejoins by replaying the others' average.

``quiet_s`` is QUIET_FACTOR × the median of this peer's last rounds (QUIET_FLOOR_S at least; none before
QUIET_ROUNDS rounds were measured: a member on a slow line must not be cut before the group knows how long
its rounds take). A vote waits for the decision (until the round's deadline at most); a tracker that
cannot be reached decides nothing: the member waits as it did before cuts existed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import numpy as np

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.protocol.messages import Credential, CutCall, GroupAssignment, GroupMember
from crowdtrain.volunteer.averaging.round import Round

log = logging.getLogger(__name__)

Decision = Literal["cut", "kept"]
# (assignment, tag, owner) -> the tracker's decision; owner = this peer: a claim, else a vote
Referee = Callable[[GroupAssignment, str, str], Awaitable[Decision]]

QUIET_FLOOR_S = 0.3
QUIET_FACTOR = 5.0
QUIET_ROUNDS = 3  # rounds measured before this peer votes at all
MEASURED_ROUNDS = 16


def tracker_referee(
    tracker: TrackerClient, run_id: str, peer_id: str, key: SigningKey, credential: Credential
) -> Referee:
    """The referee of a joined volunteer: its tracker. A call that fails decides nothing: ``kept`` (a vote:
    wait for the answer as before cuts existed; a claim: the others could not reach the tracker to vote
    either, unless only this peer was cut off from it, which the round cannot tell)."""

    async def referee(a: GroupAssignment, tag: str, owner: str) -> Decision:
        call = CutCall(peer_id=peer_id, assignment=a, tag=tag, owner=owner)
        # (a claim is answered at once; a vote waits for the decision, at most until the round's deadline)
        wait_s = 0.0 if owner == peer_id else max(0.0, a.deadline - time.time())
        try:
            verdict = await tracker.cut(run_id, call, key, credential, wait_s)
        except (CrowdtrainError, OSError) as exc:
            log.info("round %s/%s: the tracker did not decide on %s: %s", a.round_id, tag, owner, exc)
            return "kept"
        return verdict.decision

    return referee


class Cutter:
    """This peer's votes and claims, and the round durations its quiet time is measured from."""

    def __init__(self, peer_id: str, referee: Referee) -> None:
        self.peer_id = peer_id
        self.referee = referee
        self._durations: collections.deque[float] = collections.deque(maxlen=MEASURED_ROUNDS)

    def measured(self, duration_s: float) -> None:
        """A round that nobody was cut from took ``duration_s`` here."""
        self._durations.append(duration_s)

    @property
    def quiet_s(self) -> float | None:
        if len(self._durations) < QUIET_ROUNDS:
            return None
        return max(QUIET_FLOOR_S, QUIET_FACTOR * statistics.median(self._durations))

    async def claim(self, rnd: Round) -> None:
        """As the owner of a part: once its answer went out, ask whether the group cut this peer meanwhile;
        if so the round is late for it (it must not apply what it reduced: the others zeroed that part)."""
        red = rnd.reducer
        assert red is not None
        await red.complete.wait()
        if await self.referee(rnd.assignment, rnd.tag, self.peer_id) == "cut":
            rnd.late = True
            rnd.cut.add(self.peer_id)
            log.warning(
                "round %s: the group cut this peer (it was asleep while every other member waited)", rnd.key
            )

    async def watch(
        self,
        rnd: Round,
        exchanges: dict[int, asyncio.Task[None]],
        failed: dict[int, str],
        vector: np.ndarray,
    ) -> None:
        """Vote on the owners whose answer has not begun once the round has been quiet for ``quiet_s``; wait
        for the votes' decisions (a cut owner's part is failed: it keeps what ``rnd.output`` holds there,
        this peer's own values from ``vector`` unless the output is the vector itself)."""
        quiet = self.quiet_s
        if quiet is None:
            return
        owners = {m.part: m for m in rnd.assignment.members if m.part in exchanges}
        votes: dict[int, asyncio.Task[None]] = {}
        try:
            while waiting := [t for t in exchanges.values() if not t.done()]:
                left = rnd.moved_at + quiet - time.monotonic()
                if left <= 0:
                    for j, t in exchanges.items():
                        if not t.done() and j not in rnd.begun and j not in votes:
                            votes[j] = asyncio.create_task(self._vote(rnd, owners[j], t, failed, vector))
                    left = quiet  # (then look again: an answer that began may stall in turn)
                await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if votes:
                await asyncio.gather(*votes.values())
        finally:
            for v in votes.values():
                v.cancel()

    async def _vote(
        self,
        rnd: Round,
        owner: GroupMember,
        exchange: asyncio.Task[None],
        failed: dict[int, str],
        vector: np.ndarray,
    ) -> None:
        if await self.referee(rnd.assignment, rnd.tag, owner.peer_id) != "cut":
            return
        rnd.cut.add(owner.peer_id)
        if owner.part not in rnd.begun:  # nothing of its answer is being written into the output
            exchange.cancel()
        await asyncio.wait([exchange])
        start, stop = rnd.bounds[owner.part]
        if rnd.output is not None and not rnd.in_place:
            rnd.output[start:stop] = vector[start:stop]
        failed[owner.part] = (
            f"owner {owner.peer_id} of part {owner.part} was cut from the round: it did not answer while "
            "every other member waited (asleep?)"
        )
        if rnd.reducer is not None:
            rnd.reducer.gone(owner.peer_id)  # (my part does not wait for its copy either)
