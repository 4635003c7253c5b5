"""Plan a step's all-reduce: the groups of each phase, so every ready peer ends with the one weighted mean
of all of them (pure; no I/O).

:func:`partition` draws the first phase's groups. Rules, in order of precedence:

1. every ready peer is in exactly one group;
2. a group must hold at least one reachable peer (a *part owner*); when there are fewer reachable peers
   than ``ceil(n / G)`` groups, there are only as many groups as reachable peers (the only case where a
   group grows past G: with r reachable of n ready peers, no group holds more than ``ceil(n / r)``
   members); with no reachable peer at all this function returns groups with ``parts = 0``, which the
   tracker never forms (the step stays open, see :mod:`crowdtrain.tracker.collab`);
3. at most G members per group, with ``ceil(n / G)`` groups whose sizes differ by at most one — so no
   group of one unless n == 1 or G == 2 with n odd;
4. reachable peers are spread over the groups round-robin, so each group gets its share of part owners;
5. the partition is drawn from ``random.Random(seed)``: new every round, reproducible from the step
   history.

:func:`plan` adds the later phases (Moshpit SGD's grid, made exact for any number of peers). After a
phase, the members of each group hold the same values: a *node*, with the summed weight of its members.
The next phase deals the nodes into clusters of at most G nodes; a cluster's nodes are averaged in
*columns*, each holding at least one member of every node of the cluster, a member weighing its node's
weight split over its node's members in that column. A column's weighted mean is then exactly the
cluster's weighted mean, so after the phase the whole cluster is one node. The phases end when one node
holds everyone: with n = G^k peers that is k phases of full groups (16 = 4·4: two phases of 4; 8 = 2·2·2:
three phases of 2). How many clusters each phase makes is searched (a few choices per phase) for the
fewest phases with groups of at most G; where no plan keeps every group at G (G = 2 with n odd, or
scarce reachable peers) groups grow past G as little as found, and the weights keep the mean exact.
Every group of every phase holds a part owner when any ready peer is reachable. Columns list their members
node by node, so where the grid is full every column adds the same terms in the same order.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MAX_LOOKAHEAD = 2  # cluster counts tried per phase beyond the fewest


@dataclass(frozen=True, slots=True)
class Candidate:
    peer_id: str
    reachable: bool
    weight: int = 0  # samples it accumulated for the step


@dataclass(frozen=True, slots=True)
class Group:
    members: tuple[str, ...]
    owners: tuple[str, ...]  # members that own a part, part i = owners[i]
    weights: tuple[int, ...] = ()  # each member's weight in this phase's mean, aligned with ``members``
    # in a later phase: which of the phase's clusters this column averages (its columns give one mean, so
    # a part that fails in one must be left out by all: tracker/verdicts.py)
    cluster: int = 0


@dataclass(slots=True)
class _Node:
    """Peers that hold the same values after a phase: its part owners and the others, each in the order
    they were dealt."""

    owners: list[str]
    others: list[str]
    weight: int

    @property
    def size(self) -> int:
        return len(self.owners) + len(self.others)


def partition(candidates: list[Candidate], group_size: int, seed: int) -> list[Group]:
    if group_size < 1:
        raise ValueError("group_size must be at least 1")
    n = len(candidates)
    if n == 0:
        return []
    rng = random.Random(seed)
    reachable = sorted(c.peer_id for c in candidates if c.reachable)
    others = sorted(c.peer_id for c in candidates if not c.reachable)
    rng.shuffle(reachable)
    rng.shuffle(others)
    k = math.ceil(n / group_size)
    if reachable:
        k = min(k, len(reachable))
    buckets: list[list[str]] = [[] for _ in range(k)]
    for i, peer_id in enumerate(reachable + others):  # round-robin: sizes differ by at most one
        buckets[i % k].append(peer_id)
    reachable_set = set(reachable)
    weight = {c.peer_id: c.weight for c in candidates}
    groups = []
    for bucket in buckets:
        rng.shuffle(bucket)
        groups.append(
            Group(
                tuple(bucket),
                tuple(p for p in bucket if p in reachable_set),
                tuple(weight[p] for p in bucket),
            )
        )
    return groups


def plan(candidates: list[Candidate], group_size: int, seed: int) -> list[list[Group]]:
    """The groups of every phase (the first is :func:`partition`'s); see the module docstring."""
    first = partition(candidates, group_size, seed)
    if not first:
        return []
    phases = [first]
    reachable = any(c.reachable for c in candidates)
    nodes = [
        _Node(list(g.owners), [p for p in g.members if p not in g.owners], sum(g.weights)) for g in first
    ]
    while len(nodes) > 1:
        k = _best_k([n.size for n in nodes], group_size)
        if reachable:  # a cluster needs a part owner: no more clusters than nodes holding one
            k = min(k, sum(bool(n.owners) for n in nodes))
        # nodes holding a reachable peer first, then the largest: dealt round-robin over the clusters
        order = sorted(nodes, key=lambda n: (not n.owners, -n.size))
        clusters = [order[r::k] for r in range(k)]
        groups: list[Group] = []
        nodes = []
        for index, cluster in enumerate(clusters):
            merged = _Node([p for n in cluster for p in n.owners], [p for n in cluster for p in n.others], 0)
            merged.weight = sum(n.weight for n in cluster)
            nodes.append(merged)
            if len(cluster) > 1:  # a lone node's members hold the same values already: they sit it out
                groups.extend(_columns(cluster, index))
        phases.append(groups)
    return phases


def _columns(cluster: list[_Node], index: int) -> list[Group]:
    """Deal each node's members over the columns so every column holds ≥ 1 member of every node (and a
    part owner, with fewer columns if owners are scarce); weights as in the module docstring, scaled to
    whole numbers."""
    owners = sum(len(n.owners) for n in cluster)
    columns = max(1, min(min(n.size for n in cluster), owners or 1))
    while True:
        # (peer, node index, owns a part), node by node: each column lists its members node by node
        cols: list[list[tuple[str, int, bool]]] = [[] for _ in range(columns)]
        has_owner = [False] * columns
        offset = 0  # each node's owners go on where the previous node's ended: owners spread out
        for ni, node in enumerate(cluster):
            for j, p in enumerate(node.owners):
                c = (offset + j) % columns
                cols[c].append((p, ni, True))
                has_owner[c] = True
            for j, p in enumerate(node.others, len(node.owners)):
                cols[(offset + j) % columns].append((p, ni, False))
            offset += len(node.owners) or node.size
        if columns == 1 or not owners or all(has_owner):
            break
        columns -= 1
    groups = []
    for col in cols:
        counts: dict[int, int] = {}
        for _, ni, _ in col:
            counts[ni] = counts.get(ni, 0) + 1
        scale = math.lcm(*counts.values())
        groups.append(
            Group(
                tuple(p for p, _, _ in col),
                tuple(p for p, _, owns in col if owns),
                tuple(cluster[ni].weight * scale // counts[ni] for _, ni, _ in col),
                index,
            )
        )
    return groups


def _deal(sizes: tuple[int, ...], k: int) -> list[list[int]]:
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    return [order[r::k] for r in range(k)]


def _largest_column(node_sizes: list[int]) -> int:
    """The most members one column gets when the nodes' members are dealt, one after another, round the
    ``min(node_sizes)`` columns: ``ceil(total / columns)``. (Counting them one by one cost O(N) per call and
    the search calls it for every cluster of every count it tries: N^1.8 over a step at 1,000 volunteers.)"""
    return -(-sum(node_sizes) // min(node_sizes))


def _best_k(sizes: list[int], group_size: int) -> int:
    """How many clusters to deal these nodes into now: the fewest phases to one node with groups ≤ G,
    else the smallest excess over G (a short search: a few cluster counts per phase)."""
    memo: dict[tuple[int, ...], tuple[tuple[int, int], int]] = {}

    def cost(sizes: tuple[int, ...]) -> tuple[tuple[int, int], int]:
        if len(sizes) == 1:
            return (0, 0), 1
        if sizes not in memo:
            kmin = math.ceil(len(sizes) / group_size)
            best: tuple[tuple[int, int], int] | None = None
            for k in range(kmin, min(len(sizes) - 1, kmin + MAX_LOOKAHEAD) + 1):
                clusters = [[sizes[i] for i in cl] for cl in _deal(sizes, k)]
                worst = max((_largest_column(c) for c in clusters if len(c) > 1), default=0)
                (excess, phases), _ = cost(tuple(sorted((sum(c) for c in clusters), reverse=True)))
                key = (max(excess, worst - group_size), phases + 1)
                if best is None or key < best[0]:
                    best = (key, k)
            memo[sizes] = best or ((0, 1), 1)
        return memo[sizes]

    return cost(tuple(sorted(sizes, reverse=True)))[1]
