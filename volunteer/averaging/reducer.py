"""The owner's side of one part: collect the group's copies, clip outliers, take the weighted mean."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Contribution:
    peer_id: str
    weight: float
    values: np.ndarray | None  # None for a weight-0 member that sent no values
    norm: float
    owned: bool = True  # ``values`` is this reducer's buffer (False: a view of the caller's vector)


@dataclass(slots=True)
class PartOutcome:
    """What the owner decided for its part once it closed."""

    values: np.ndarray | None  # the reduced part; None when no contribution with weight arrived
    # ``values`` encoded once as (header, body) frames, sub-frame by sub-frame as each slice is reduced
    frames: list[tuple[bytes, bytes | memoryview]]
    accepted: tuple[str, ...]
    dropped: tuple[str, ...]
    rejected: tuple[str, ...]
    clipped: tuple[str, ...]
    reduce_s: float = 0.0
    reason: str = ""


@dataclass(slots=True)
class PartReducer:
    """Contributions to the part this peer owns in one round.

    A member's copy is read sub-frame by sub-frame (never a joined body) into a buffer of the part's length.
    The group's copies of one part together are about the size of the whole vector (G copies of 1/G of
    it); they are kept until the part closes because clipping to the median norm needs every member's
    norm before the mean, and a copy that fails a check half-way must leave no trace in the mean.
    """

    part: int
    length: int
    members: tuple[str, ...]
    clip_multiple: float
    contributions: dict[str, Contribution] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    rejected: dict[str, str] = field(default_factory=dict)
    duplicates: set[str] = field(default_factory=set)  # sent a second copy (refused with 409)
    closed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)  # ``outcome`` is decided
    outcome: PartOutcome | None = None
    more: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) when a frame is added
    complete: asyncio.Event = field(default_factory=asyncio.Event)  # every frame is in, or never will be

    def begin(self, peer_id: str) -> bool:
        """Mark the start of ``peer_id``'s contribution; False if it already sent one."""
        if peer_id in self.started:
            self.duplicates.add(peer_id)
            return False
        self.started.add(peer_id)
        return True

    def accept(self, c: Contribution) -> None:
        self.contributions[c.peer_id] = c

    def reject(self, peer_id: str, reason: str) -> None:
        self.rejected[peer_id] = reason

    def settled(self) -> bool:
        return len(self.contributions) + len(self.rejected) >= len(self.members)

    def add_frame(self, frame: tuple[bytes, bytes | memoryview]) -> None:
        """Publish the next frame of the answer to the senders waiting for it."""
        assert self.outcome is not None
        self.outcome.frames.append(frame)
        woken, self.more = self.more, asyncio.Event()
        woken.set()

    def finish(self) -> None:
        """No more frames will come (all are in, or the round was abandoned)."""
        self.complete.set()
        self.more.set()

    def plan(self) -> tuple[list[tuple[np.ndarray, np.float32, bool]], tuple[str, ...], str]:
        """The terms of the weighted mean: (copy, factor) pairs, outliers clipped; once every copy is in.

        Returns the terms (empty when nothing with a weight arrived), the clipped members and, on failure,
        why. Clipping needs every member's norm, so no slice can be reduced before this.
        """
        # Members in the assignment's order, not arrival order: the fp32 sum is then the same whatever the
        # network did, and the same in every group whose members the tracker listed alike (a full grid's
        # columns), so those groups' means are bit for bit equal.
        rank = {peer: i for i, peer in enumerate(self.members)}
        weighted = sorted(
            (c for c in self.contributions.values() if c.weight > 0 and c.values is not None),
            key=lambda c: (rank.get(c.peer_id, len(rank)), c.peer_id),
        )
        if not weighted:
            return [], (), "no contribution with a positive weight reached the part owner in time"
        scales = {c.peer_id: 1.0 for c in weighted}
        clipped: list[str] = []
        if self.clip_multiple > 0 and len(weighted) > 1:
            norms = sorted(c.norm for c in weighted)
            bound = self.clip_multiple * norms[(len(norms) - 1) // 2]  # lower median: robust for 2 members
            for c in weighted:
                if c.norm > bound:
                    scales[c.peer_id] = bound / c.norm if c.norm > 0 else 0.0
                    clipped.append(c.peer_id)
        total = math.fsum(c.weight for c in weighted)
        terms = [(c.values, np.float32(c.weight * scales[c.peer_id] / total), c.owned) for c in weighted]
        return terms, tuple(sorted(clipped)), ""

    @staticmethod
    def reduce_slice(
        terms: list[tuple[np.ndarray, np.float32, bool]], a: int, b: int, out: np.ndarray
    ) -> None:
        """Weighted mean in fp32 of values ``[a, b)`` of every term into ``out`` (in a thread).

        Element by element the same operations in the same order whatever the slicing, so a part reduced
        slice by slice is bit for bit the part reduced at once. A term not ``owned`` is a view of the
        caller's vector: it is never written.
        """
        for i, (values, factor, owned) in enumerate(terms):
            if i == 0:
                np.multiply(values[a:b], factor, out=out)
            elif owned:  # a received copy: scale it in place, then add; no temporaries
                v = values[a:b]
                v *= factor
                out += v
            else:  # my own copy: one temporary
                out += values[a:b] * factor
