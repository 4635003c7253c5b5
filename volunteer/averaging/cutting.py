"""A member asleep inside a round does not hold the others: the group cuts it, through the tracker.

A part owner that sleeps (SIGSTOP, a laptop lid) holds every member: they wait for its answer and for its
copies of their own parts. Each member decides alone to stop waiting for a copy, but an answer is what
every member applies, so giving up on one must be one decision for the whole group
(:mod:`crowdtrain.tracker.cuts`):

* **Vote.** Once the round has been quiet (nothing arrived or went out completely: no copy sent, no
  sub-frame of an answer come) for ``quiet_s``, this member asks every owner whose answer has not come
  whole whether it is awake at all (``GET /v1/awake``, within ``quiet_s``: an owner waiting for another
  member's copy answers, and so does one streaming its answer up a slow line) and votes to cut those that
  do not. An owner asleep halfway through its answer is cut like one asleep before it: a member that has
  its whole answer votes on nobody, so the group cuts it only where nobody has its whole answer.
  The tracker cuts an owner when every other member voted before it claimed. Cut: this member stops
  waiting for its answer (that part is failed, zeroed alike by every member) and for its copy of this
  member's own part; the owner's later copies are refused (410).
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
from crowdtrain.volunteer.averaging.exchange import Round

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

    def __init__(
        self, peer_id: str, referee: Referee, awake: Callable[[GroupMember, float], Awaitable[bool]]
    ) -> None:
        """``awake(owner, within_s)``: whether the owner's peer answers at all (it may be waiting for another
        member's copy: then it is not the one asleep)."""
        self.peer_id = peer_id
        self.referee = referee
        self.awake = awake
        self._durations: collections.deque[float] = collections.deque(maxlen=MEASURED_ROUNDS)
        # round id -> the owners cut from it (under any tag): its next tag (params after grad) does not
        # wait out a quiet time for them
        self._cut_from: collections.OrderedDict[str, set[str]] = collections.OrderedDict()

    def measured(self, duration_s: float) -> None:
        """A round that nobody was cut from took ``duration_s`` here."""
        self._durations.append(duration_s)

    @property
    def quiet_s(self) -> float | None:
        if len(self._durations) < QUIET_ROUNDS:
            return None
        return max(QUIET_FLOOR_S, QUIET_FACTOR * statistics.median(self._durations))

    async def claim_ahead(self, a: GroupAssignment, tag: str) -> None:
        """Claim this peer's part of a round it will join late, still awake (a spot-checker recomputes a
        gradient before its parameter round): the others do not cut it for being slow."""
        await self.referee(a, tag, self.peer_id)

    def _cut(self, rnd: Round, owner: str) -> None:
        rnd.cut.add(owner)
        self._cut_from.setdefault(rnd.assignment.round_id, set()).add(owner)
        while len(self._cut_from) > MEASURED_ROUNDS:
            self._cut_from.popitem(last=False)

    async def claim(self, rnd: Round) -> None:
        """As the owner of a part: once its answer went out, ask whether the group cut this peer meanwhile;
        if so the round is late for it (it must not apply what it reduced: the others zeroed that part)."""
        red = rnd.reducer
        assert red is not None
        await red.complete.wait()
        if await self.referee(rnd.assignment, rnd.tag, self.peer_id) == "cut":
            rnd.late = True
            self._cut(rnd, self.peer_id)
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
        """Vote on the owners whose answer has not come whole once the round has been quiet for ``quiet_s``;
        wait for the votes' decisions (a cut owner's part is failed: it keeps what ``rnd.output`` holds there,
        this peer's own values from ``vector`` unless the output is the vector itself)."""
        quiet = self.quiet_s
        if quiet is None:
            return
        owners = {m.part: m for m in rnd.assignment.members if m.part in exchanges}
        cut_before = self._cut_from.get(rnd.assignment.round_id, set())
        asks: dict[int, asyncio.Task[bool]] = {}  # per owner: asleep? then a vote (True: it voted)
        try:
            while waiting := [t for t in exchanges.values() if not t.done()]:
                left = rnd.moved_at + quiet - time.monotonic()
                for j, t in exchanges.items():
                    ask = asks.get(j)
                    if t.done() or (ask is not None and (not ask.done() or ask.result())):
                        continue
                    if left <= 0 or owners[j].peer_id in cut_before:
                        known = owners[j].peer_id in cut_before
                        asks[j] = asyncio.create_task(
                            self._ask(rnd, owners[j], t, failed, vector, quiet, known)
                        )
                if left <= 0:
                    left = quiet  # (then look again: one awake may fall asleep, an answer may stall)
                    rnd.moved()
                busy = [a for a in asks.values() if not a.done()]
                await asyncio.wait([*waiting, *busy], timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if asks:
                await asyncio.gather(*asks.values())
        finally:
            for a in asks.values():
                a.cancel()

    async def _ask(
        self,
        rnd: Round,
        owner: GroupMember,
        exchange: asyncio.Task[None],
        failed: dict[int, str],
        vector: np.ndarray,
        quiet: float,
        known: bool,
    ) -> bool:
        """Vote on ``owner`` if it does not answer a ping within ``quiet`` (``known``: it was cut from this
        round already, under another tag: no ping); False if it answered (it waits for someone else). Cut:
        its part is failed here (it keeps what ``rnd.output`` holds there: this peer's own values from
        ``vector``, unless the output is the vector itself) and my own part stops waiting for its copy."""
        if not known and await self.awake(owner, quiet):
            return False
        if exchange.done():  # (its whole answer came meanwhile: it is no longer asleep to me)
            return True
        if await self.referee(rnd.assignment, rnd.tag, owner.peer_id) != "cut":
            return True
        self._cut(rnd, owner.peer_id)
        # (a sub-frame being decoded into the output is finished first: read_part never leaves a thread
        # writing there)
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
        return True
