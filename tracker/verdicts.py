"""The verdicts of a round's members on its parts (issue 48): a part one member does not apply, no member does.

A member checks every answer it gets (the owner's receipt, protocol/receipts.py) and may refuse one that another
member, whose own line the owner did not forge, would take; it may also have lost a part to the network. Each
member reports the parts it could not apply (``POST /api/v1/runs/{id}/verdicts``, possibly none) and gets back
the union of every member's, once all have reported or :data:`WAIT_S` after the first report: every member then
applies the same parts (the others are zeroed in a first phase, fetched as a state in a later one), so a forged
answer that only some members can see through splits no one.

A member that reports after the union was given out (it was still waiting on an owner that died, say) still
gets the union as it stands (its own parts in it), and the others do not learn of its parts: those of its
failed parts the union given out did not hold come back as ``late``, and that member does not apply the round
(its mean would not be theirs): it fetches the run's state, and every member holds the same bytes again.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

WAIT_S = 2.0  # after a round's first verdict, how long the others are waited for
KEEP_ROUNDS = 256  # rounds remembered (their unions answer late reports)


@dataclass(slots=True)
class _Round:
    members: frozenset[str]
    failed: set[int] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)
    first_at: float = 0.0
    all_in: asyncio.Event = field(default_factory=asyncio.Event)
    given: frozenset[int] | None = None  # the union as first given out


@dataclass(slots=True)
class Verdicts:
    """One run's verdict boards, by round key."""

    rounds: OrderedDict[str, _Round] = field(default_factory=OrderedDict)

    async def report(
        self, key: str, members: frozenset[str], peer: str, failed: list[int]
    ) -> tuple[list[int], int, list[int]]:
        """Record ``peer``'s failed parts of round ``key`` and return the union of every member's, how many
        reported, and those of ``peer``'s parts that others were told to apply (its report came late), once
        every member reported or WAIT_S after the first report."""
        board = self.rounds.get(key)
        if board is None:
            board = self.rounds[key] = _Round(members, first_at=time.monotonic())
            while len(self.rounds) > KEEP_ROUNDS:
                self.rounds.popitem(last=False)
        board.failed.update(failed)
        board.reported.add(peer)
        if board.members <= board.reported:
            board.all_in.set()
        left = WAIT_S - (time.monotonic() - board.first_at)
        if left > 0 and not board.all_in.is_set():
            try:
                await asyncio.wait_for(board.all_in.wait(), left)
            except TimeoutError:
                pass
        if board.given is None:
            board.given = frozenset(board.failed)
        return sorted(board.failed), len(board.reported), sorted(set(failed) - board.given)
