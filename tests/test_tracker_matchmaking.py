"""Matchmaking: partitions cover every ready peer once, sizes as even as possible, owners spread out."""

from __future__ import annotations

import math

import pytest
from crowdtrain.tracker.matchmaking import Candidate, partition


def check_partition(candidates, g, seed):
    groups = partition(candidates, g, seed)
    members = [m for grp in groups for m in grp.members]
    assert sorted(members) == sorted(c.peer_id for c in candidates)  # each exactly once
    sizes = [len(grp.members) for grp in groups]
    return groups, sizes


@pytest.mark.parametrize(("n", "expected_sizes"), [(1, [1]), (2, [2]), (7, [3, 4]), (20, [4, 4, 4, 4, 4])])
def test_sizes_are_as_even_as_possible_with_g4(n, expected_sizes):
    candidates = [Candidate(f"p{i:02d}", reachable=True) for i in range(n)]
    for seed in range(20):
        groups, sizes = check_partition(candidates, 4, seed)
        assert sorted(sizes) == expected_sizes
        assert len(groups) == math.ceil(n / 4)
        for grp in groups:
            assert grp.owners == grp.members  # everyone reachable owns a part


def test_no_group_of_one_when_avoidable():
    for n in range(2, 41):
        _, sizes = check_partition([Candidate(f"p{i}", True) for i in range(n)], 4, n)
        assert min(sizes) >= 2, (n, sizes)
        assert max(sizes) - min(sizes) <= 1
        assert max(sizes) <= 4


def test_groups_are_redrawn_with_the_seed_and_reproducible():
    candidates = [Candidate(f"p{i:02d}", True) for i in range(20)]
    a = partition(candidates, 4, 1)
    assert partition(candidates, 4, 1) == a
    assert any(partition(candidates, 4, s) != a for s in range(2, 6))


def test_reachable_peers_are_spread_so_every_group_has_a_part_owner():
    candidates = [Candidate(f"r{i}", True) for i in range(3)] + [Candidate(f"c{i}", False) for i in range(9)]
    for seed in range(20):
        groups, sizes = check_partition(candidates, 4, seed)
        assert sorted(sizes) == [4, 4, 4]
        assert all(len(grp.owners) == 1 for grp in groups)
        assert all(all(o.startswith("r") for o in grp.owners) for grp in groups)


def test_too_few_reachable_peers_means_fewer_larger_groups():
    candidates = [Candidate("r0", True)] + [Candidate(f"c{i}", False) for i in range(6)]
    groups, sizes = check_partition(candidates, 4, 3)
    assert sizes == [7]
    assert groups[0].owners == ("r0",)


def test_no_reachable_peer_at_all_gives_groups_without_parts():
    candidates = [Candidate(f"c{i}", False) for i in range(5)]
    groups, sizes = check_partition(candidates, 4, 3)
    assert sorted(sizes) == [2, 3]
    assert all(grp.owners == () for grp in groups)


def test_empty_input_gives_no_groups():
    assert partition([], 4, 0) == []
