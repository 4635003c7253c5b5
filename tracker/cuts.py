"""Cutting a sleeper out of a round in flight: one decision per (round, tag, part owner), taken
here, followed by every member before it applies the round.

A member asleep inside its round (a laptop lid closed, SIGSTOP) owns a part the others wait for: its answer
is the reduced part every member applies. A member can decide alone to stop waiting for a *copy* (the
part's answer is the same for all), but not to stop waiting for an *answer*: if one member gave up on the
owner while another took its answer, they would apply different means. So the members ask the tracker:

* **A vote**: a member whose round has been quiet for a while, whose answer from ``owner`` has not begun
  and whose ping of ``owner`` went unanswered votes to cut it (``volunteer/averaging/cutting.py``). When *every* other member of the round voted
  before the owner claimed, the part is ``cut``: every member zeroes that part of its mean (a failed part,
  alike for all) and stops waiting for the owner's copies of its own parts.
* **A claim**: every part owner, once its answer went out, asks before it applies the round. The first
  claim of an undecided part decides ``kept``; a claim of a part already cut tells the owner it was cut:
  it was asleep, it applies nothing of the round and rejoins by replaying the others' average.

A member that took the owner's answer does not vote, so a cut never meets a member holding the answer.
A member that voted in a round was awake then: it is not cut from that round (and tag). So a cut leaves its
voters, every other member, to apply the round, and a round has at most one cut: two members that each
waited on the other (both slow, or their pings lost) never cut each other and leave nobody to replay from.
Nor is an owner cut when every other member is catching up (weight 0): the round would hold no gradient,
and those members would have nobody left whose state to fetch.
A vote waits for the decision (until the round's deadline, when an undecided part is ``kept``: members
then do what they did before cuts existed, wait for the answer until the deadline). A member that is
itself asleep cannot vote, so with two members asleep neither is cut (the round waits, as before).

Pure bookkeeping, told the time by its caller (the tracker's clock, the one the round's deadline was
signed with): the route (:mod:`crowdtrain.tracker.volunteers`) checks the caller and the signed assignment.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.protocol.messages import GroupAssignment

log = logging.getLogger("crowdtrain.tracker")

Decision = Literal["cut", "kept"]
K = TypeVar("K")
V = TypeVar("V")
# cases are forgotten this long after their round's deadline (a claim that late is "cut": by then every
# member gave up on the part at its deadline, as they did before cuts)
FORGET_AFTER_S = 60.0
MAX_CASES = 200_000  # open cases across a run (each from a member of a round the tracker signed)


@dataclass(slots=True)
class _Case:
    needed: frozenset[str]  # every member but the owner
    others_train: bool  # some member but the owner has weight (is not catching up)
    deadline: float
    step: int
    votes: set[str] = field(default_factory=set)
    decision: Decision | None = None
    decided: asyncio.Event = field(default_factory=asyncio.Event)


class CutRefused(CrowdtrainError):
    """A call this run will not take (a sentence for a 4xx answer)."""


class Cuts:
    """The open cases of one run: (round id, tag, owner) -> votes and the decision."""

    def __init__(self, on_cut: Callable[[str, int], None] = lambda owner, step: None) -> None:
        """``on_cut(owner, step)``: called once per cut, with the step of the round it was cut from."""
        self.on_cut = on_cut
        self._cases: dict[tuple[str, str, str], _Case] = {}
        # (round id, tag) -> (deadline, the members that voted in it: awake, never cut from it)
        self._voters: dict[tuple[str, str], tuple[float, set[str]]] = {}
        self.decided = {"cut": 0, "kept": 0}  # how many cases ended each way

    def __len__(self) -> int:
        return len(self._cases)

    def _open(self, key: tuple[str, str, str], a: GroupAssignment, owner: str, now: float) -> _Case:
        self._forget(now)
        if len(self._cases) >= MAX_CASES:
            raise CutRefused("the tracker holds too many open cuts; wait for the round's deadline")
        others = [m for m in a.members if m.peer_id != owner]
        case = self._cases[key] = _Case(
            needed=frozenset(m.peer_id for m in others),
            others_train=any(m.weight > 0 for m in others),
            deadline=a.deadline,
            step=a.step,
        )
        return case

    def _forget(self, now: float) -> None:
        """Forget the oldest cases and voters past FORGET_AFTER_S (opened in about the order of their deadlines)."""
        _forget_before(self._cases, lambda case: case.deadline, now - FORGET_AFTER_S)
        _forget_before(self._voters, lambda voters: voters[0], now - FORGET_AFTER_S)

    async def call(self, a: GroupAssignment, tag: str, caller: str, owner: str, now: float) -> Decision:
        """A vote (``caller`` ≠ ``owner``: waits for the decision, at most until the round's deadline) or the
        owner's claim (answered at once). The caller and owner are members of ``a``, the owner owns a part
        (the route checked). ``now``: the tracker's clock (unix seconds, as the deadline).

        Past the deadline nothing new is decided: a vote on an unknown case is ``kept`` (the round is over),
        and a claim on one forgotten (FORGET_AFTER_S after the deadline) is ``cut``: every member gave up on
        that answer long ago."""
        key = (a.round_id, tag, owner)
        case = self._cases.get(key)
        if case is None:
            if caller == owner and now > a.deadline + FORGET_AFTER_S:
                return "cut"
            if caller != owner and now >= a.deadline:
                return "kept"
            case = self._open(key, a, owner, now)
        if caller == owner:
            return self._decide(case, "kept", key)
        voters = self._voters.setdefault((a.round_id, tag), (a.deadline, set()))[1]
        voters.add(caller)  # awake: a case on the caller is kept, as by its claim
        if (on_caller := self._cases.get((a.round_id, tag, caller))) is not None:
            self._decide(on_caller, "kept", (a.round_id, tag, caller))
        if owner in voters:
            self._decide(case, "kept", key)
        if case.decision is None:
            case.votes.add(caller)
            if case.votes >= case.needed:
                return self._decide(case, "cut" if case.others_train else "kept", key)
            try:
                async with asyncio.timeout(max(0.0, case.deadline - now)):
                    await case.decided.wait()
            except TimeoutError:
                return self._decide(case, "kept", key)
        assert case.decision is not None
        return case.decision

    def _decide(self, case: _Case, decision: Decision, key: tuple[str, str, str]) -> Decision:
        """The case's decision: ``decision`` if it had none (the first decision stands)."""
        if case.decision is None:
            case.decision = decision
            case.decided.set()
            self.decided[decision] += 1
            if decision == "cut":
                log.info("round %s/%s: %s cut (every other member waited on its answer)", *key)
                self.on_cut(key[2], case.step)
        return case.decision


def _forget_before(entries: dict[K, V], deadline: Callable[[V], float], before: float) -> None:
    """Drop the first ``entries`` whose deadline is before ``before`` (kept in about deadline order)."""
    while entries:
        key, value = next(iter(entries.items()))
        if deadline(value) >= before:
            return
        del entries[key]
