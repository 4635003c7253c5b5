"""The verdicts of a round's members on its parts: a part one member does not apply, no member does.

A member checks every answer it gets (the owner's receipt, protocol/receipts.py) and may refuse one that another
member, whose own line the owner did not forge, would take; it may also have lost a part to the network. Each
member reports the parts it could not apply (``POST /api/v1/runs/{id}/verdicts``, possibly none) and gets back
the union of every member's, once all have reported or :data:`WAIT_S` after the first report: every member then
applies the same parts (the others are zeroed), so a forged answer that only some members can see through
splits no one.

In a later phase a board covers a whole cluster (tracker/matchmaking.py): its columns each make the cluster's
one mean, cut into parts their own way, so a part lost in one column is told to every column's members as
that column's parts (``elsewhere``), and they zero those values too: the cluster still holds one mean. (Before,
a member of a later phase that lost a part fetched the run's state; when an owner of each column left mid-round,
every volunteer did at once, and the run stood still: the churn soak, bench/churn.py.) A member whose input to the
phase is not the mean (``spoiled``: a parameter round that lost a part before) tells the cluster so, and every
member then keeps its own parameters (as does one whose report of it came late: the next parameter round heals
it).

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
    members: frozenset[str]  # of every column of the board
    failed: dict[str, set[int]] = field(default_factory=dict)  # column (round id) -> its failed parts
    spoiled: bool = False  # a member's input was not the mean (a parameter round that lost a part)
    reported: set[str] = field(default_factory=set)
    first_at: float = 0.0
    all_in: asyncio.Event = field(default_factory=asyncio.Event)
    given: dict[str, frozenset[int]] | None = None  # the union as first given out
    given_spoiled: bool = False  # (and whether a member's input was not the mean, as given out)
    until: float = 0.0  # unix time: a cluster's members are waited for until its deadline and WAIT_S more


@dataclass(frozen=True, slots=True)
class Told:
    """What a member hears back: its column's failed parts, how many members reported, its own failed parts
    the others were told to apply (``late``), the other columns' failed parts by column, and whether a
    member's input was not the mean."""

    failed: list[int]
    reported: int
    late: list[int] = field(default_factory=list)
    elsewhere: dict[str, list[int]] = field(default_factory=dict)
    spoiled: bool = False


@dataclass(slots=True)
class Verdicts:
    """One run's verdict boards, by round key (a first phase's group, or a later phase's cluster)."""

    rounds: OrderedDict[str, _Round] = field(default_factory=OrderedDict)

    async def report(
        self,
        key: str,
        members: frozenset[str],
        peer: str,
        failed: list[int],
        *,
        column: str = "",
        spoiled: bool = False,
        deadline: float = 0.0,
    ) -> Told:
        """Record ``peer``'s failed parts of its ``column`` of board ``key`` and return what it is told (see
        :class:`Told`), once every member reported, or WAIT_S after the first report and after ``deadline``
        (unix time; a later phase's: a column that lost a member's copy only knows it at its deadline)."""
        board = self.rounds.get(key)
        if board is None:
            board = self.rounds[key] = _Round(members, first_at=time.monotonic(), until=deadline + WAIT_S)
            while len(self.rounds) > KEEP_ROUNDS:
                self.rounds.popitem(last=False)
        board.failed.setdefault(column, set()).update(failed)
        board.spoiled |= spoiled
        board.reported.add(peer)
        if board.members <= board.reported:
            board.all_in.set()
        left = max(WAIT_S - (time.monotonic() - board.first_at), board.until - time.time())
        if left > 0 and not board.all_in.is_set():
            try:
                await asyncio.wait_for(board.all_in.wait(), left)
            except TimeoutError:
                pass
        if board.given is None:
            board.given = {c: frozenset(parts) for c, parts in board.failed.items()}
            board.given_spoiled = board.spoiled
        # every member that is not late is told the union as given out (what came later is told to no one:
        # those who applied before it could not have heard it)
        given = board.given.get(column, frozenset())
        return Told(
            failed=sorted(given | set(failed)),
            reported=len(board.reported),
            late=sorted(set(failed) - given),
            elsewhere={c: sorted(p) for c, p in board.given.items() if c != column and p},
            spoiled=board.given_spoiled,
        )
