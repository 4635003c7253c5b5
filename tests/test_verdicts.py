"""The verdict board (tracker/verdicts.py): every member of a round applies the same parts, and a member whose
failure came after the union was given out learns that its mean is not the others'."""

from __future__ import annotations

import asyncio

from crowdtrain.tracker import verdicts
from crowdtrain.tracker.verdicts import Verdicts

MEMBERS = frozenset({"a", "b", "c"})


async def test_members_that_all_report_get_the_union_and_none_is_late():
    board = Verdicts()
    replies = await asyncio.gather(
        board.report("r/grad", MEMBERS, "a", []),
        board.report("r/grad", MEMBERS, "b", [2]),
        board.report("r/grad", MEMBERS, "c", [0]),
    )
    assert replies == [([0, 2], 3, [])] * 3


async def test_a_member_reporting_after_the_union_was_given_out_is_told_its_late_parts(monkeypatch):
    """c died in the round and never reports: a and b wait WAIT_S; b's failure of the dead owner's part came
    only after a was told to apply it, so b hears it is late on that part (and fetches the state)."""
    monkeypatch.setattr(verdicts, "WAIT_S", 0.05)
    board = Verdicts()
    assert await board.report("r/grad", MEMBERS, "a", []) == ([], 1, [])
    assert await board.report("r/grad", MEMBERS, "b", [1]) == ([1], 2, [1])
    # a part the union given out already held is no news: not late
    other = Verdicts()
    assert await other.report("s/grad", MEMBERS, "a", [1]) == ([1], 1, [])
    assert await other.report("s/grad", MEMBERS, "b", [1]) == ([1], 2, [])
