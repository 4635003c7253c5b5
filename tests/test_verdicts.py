"""The verdict board (tracker/verdicts.py): every member of a round applies the same parts, and a member whose
failure came after the union was given out learns that its mean is not the others'."""

from __future__ import annotations

import asyncio

from crowdtrain.tracker import verdicts
from crowdtrain.tracker.verdicts import Told, Verdicts

MEMBERS = frozenset({"a", "b", "c"})


async def test_members_that_all_report_get_the_union_and_none_is_late():
    board = Verdicts()
    replies = await asyncio.gather(
        board.report("r/grad", MEMBERS, "a", []),
        board.report("r/grad", MEMBERS, "b", [2]),
        board.report("r/grad", MEMBERS, "c", [0]),
    )
    assert replies == [Told([0, 2], 3)] * 3


async def test_a_member_reporting_after_the_union_was_given_out_is_told_its_late_parts(monkeypatch):
    """c died in the round and never reports: a and b wait WAIT_S; b's failure of the dead owner's part came
    only after a was told to apply it, so b hears it is late on that part (and fetches the state)."""
    monkeypatch.setattr(verdicts, "WAIT_S", 0.05)
    board = Verdicts()
    assert await board.report("r/grad", MEMBERS, "a", []) == Told([], 1)
    assert await board.report("r/grad", MEMBERS, "b", [1]) == Told([1], 2, late=[1])
    # a part the union given out already held is no news: not late
    other = Verdicts()
    assert await other.report("s/grad", MEMBERS, "a", [1]) == Told([1], 1)
    assert await other.report("s/grad", MEMBERS, "b", [1]) == Told([1], 2)
    # ... and a member reporting after the union was given out hears the union as given, not the late parts
    assert await board.report("r/grad", MEMBERS, "c", []) == Told([], 3)


async def test_the_columns_of_a_cluster_are_told_each_others_failed_parts():
    """A later phase: two columns make the cluster's one mean, each cut its own way; a part lost in column x is
    told to column y's members too (and y's to x's), so every member zeroes the same values."""
    board = Verdicts()
    members = frozenset({"a", "b", "c", "d"})
    x, _, _, y = await asyncio.gather(
        board.report("c0/grad-p1", members, "a", [1], column="x"),
        board.report("c0/grad-p1", members, "c", [], column="y"),
        board.report("c0/grad-p1", members, "b", [], column="x"),
        board.report("c0/grad-p1", members, "d", [0], column="y"),
    )
    # (a, of column x, and c, of column y: each hears its own column's union and the other column's)
    assert x == Told([1], 4, elsewhere={"y": [0]})
    assert y == Told([0], 4, elsewhere={"x": [1]})


async def test_a_spoiled_parameter_round_is_told_to_the_whole_cluster():
    board = Verdicts()
    members = frozenset({"a", "b"})
    a, b = await asyncio.gather(
        board.report("c0/params-p1", members, "a", [], column="x", spoiled=True),
        board.report("c0/params-p1", members, "b", [], column="y"),
    )
    assert a.spoiled and b.spoiled
