"""Matchmaking: partitions cover every ready peer once, sizes as even as possible, owners spread out."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from crowdtrain.tracker.matchmaking import Candidate, partition, plan


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


# ------------------------------------------------------------ the phases of one mean across all groups


def run_plan(candidates, g, seed, values):
    """Apply the plan's phases to exact values: every group's members get its weighted mean."""
    phases = plan(candidates, g, seed)
    for i, groups in enumerate(phases):
        members = [m for grp in groups for m in grp.members]
        assert len(members) == len(set(members)), f"a peer twice in phase {i}"
        if i == 0:
            assert sorted(members) == sorted(c.peer_id for c in candidates)
        new = dict(values)
        for grp in groups:
            assert grp.owners and set(grp.owners) <= set(grp.members)
            total = sum(grp.weights)
            if total:
                mean = sum(w * values[p] for p, w in zip(grp.members, grp.weights, strict=True)) / total
                new.update(dict.fromkeys(grp.members, mean))
        values = new
    return phases, values


@pytest.mark.parametrize("g", [2, 3, 4, 8])
def test_every_peer_ends_with_the_one_weighted_mean_of_all(g):
    for n in range(1, 41):
        for seed, share_reachable in enumerate((1.0, 0.3)):
            rng = random.Random(1000 * g + n)
            candidates = [
                Candidate(f"p{i:02d}", i == 0 or rng.random() < share_reachable, rng.randint(0, 40))
                for i in range(n)
            ]
            values = {c.peer_id: Fraction(rng.randint(-999, 999)) for c in candidates}
            total = sum(c.weight for c in candidates)
            _, out = run_plan(candidates, g, seed, values)
            if total:
                exact = sum(c.weight * values[c.peer_id] for c in candidates) / total
                assert set(out.values()) == {exact}, (g, n, seed)


@pytest.mark.parametrize(("n", "g", "sizes"), [(8, 2, [[2] * 4] * 3), (16, 4, [[4] * 4] * 2), (32, 4, None)])
def test_full_grids_use_groups_of_g_in_log_g_n_phases(n, g, sizes):
    phases = plan([Candidate(f"p{i:02d}", True, 5) for i in range(n)], g, 7)
    got = [sorted(len(grp.members) for grp in groups) for groups in phases]
    if sizes is not None:
        assert got == sizes
    assert max(max(s) for s in got) <= g
    assert len(phases) == math.ceil(math.log(n, g) - 1e-9)


def test_groups_exceed_g_by_at_most_one_when_everyone_is_reachable():
    for g in (2, 3, 4):
        for n in range(1, 50):
            phases = plan([Candidate(f"p{i:02d}", True, 1) for i in range(n)], g, n)
            assert max(len(grp.members) for groups in phases for grp in groups) <= g + 1, (g, n)


def test_a_plan_is_reproducible_from_its_seed():
    candidates = [Candidate(f"p{i:02d}", i % 3 == 0, i) for i in range(20)]
    assert plan(candidates, 4, 11) == plan(candidates, 4, 11)
    assert plan(candidates, 4, 11) != plan(candidates, 4, 12)


def test_the_largest_column_is_the_count_of_dealing_members_one_by_one():
    """`_largest_column` answers in O(1) what dealing the members round the columns one by one counts (the
    loop it replaced cost the search N^1.8 per step at 1,000 volunteers)."""
    from crowdtrain.tracker.matchmaking import _largest_column

    def dealt(node_sizes: list[int]) -> int:
        columns = min(node_sizes)
        counts, offset = [0] * columns, 0
        for s in node_sizes:
            for j in range(s):
                counts[(offset + j) % columns] += 1
            offset += s
        return max(counts)

    rng = random.Random(26)
    for _ in range(3000):
        sizes = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
        assert _largest_column(sizes) == dealt(sizes), sizes
