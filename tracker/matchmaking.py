"""Partition the peers that are ready for a step into all-reduce groups (pure; no I/O).

Rules, in order of precedence:

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
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    peer_id: str
    reachable: bool


@dataclass(frozen=True, slots=True)
class Group:
    members: tuple[str, ...]
    owners: tuple[str, ...]  # members that own a part, part i = owners[i]


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
    groups = []
    for bucket in buckets:
        rng.shuffle(bucket)
        groups.append(Group(tuple(bucket), tuple(p for p in bucket if p in reachable_set)))
    return groups
