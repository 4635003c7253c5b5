"""The owner's side of one part: collect the group's copies, clip outliers, take the weighted mean."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from crowdtrain.protocol.receipts import Line, Receipt
from crowdtrain.volunteer.averaging.wire import KeptPart


@dataclass(slots=True)
class Contribution:
    peer_id: str
    weight: float
    # float32, or kept in its codec's payload; None for a weight-0 member that sent no values
    values: np.ndarray | KeptPart | None
    norm: float
    # the reusable byte buffer a received copy lives in; None: ``values`` is a view of the caller's vector
    storage: np.ndarray | None = None

    @property
    def owned(self) -> bool:
        """``values`` is this reducer's buffer (a received copy), which the reduction may scale in place."""
        return self.storage is not None


Term = tuple[np.ndarray | KeptPart, np.float32, bool]  # (a copy, its factor in the mean, owned)


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
    """Contributions to the part this peer owns in one round, and what became of it: the reducer is the one
    place that changes that state (through its methods); the averager's routes and its round read it.

    A member's copy is read sub-frame by sub-frame (never a joined body) into a buffer of the part's length
    (in its codec's payload for a lossy codec, see :class:`KeptPart`). The group's copies of one part
    together are about the size of the whole vector (G copies of 1/G of it); they are kept until the part
    closes because clipping needs every member's norm before the mean, and a copy that
    fails a check half-way must leave no trace in the mean.

    Life: each copy is begun (:meth:`begin`), then accepted or rejected (``settled`` once every member's
    is); :meth:`close` decides the outcome and the terms of the mean (``done``); the answer is published a
    frame at a time (:meth:`add_frame`) until :meth:`finish` (``complete``). :meth:`abandon` ends the part
    early, answering every waiting sender at once.
    """

    part: int
    length: int
    members: tuple[str, ...]
    clip_multiple: float
    owner: str = ""  # this peer: its own copy's norm is what the others are clipped against
    # a later phase of the step (see ``Round.shared``): the members whose copies the part cannot do without
    # (those with a weight), and each copy's digest once the part closes (identical copies count once)
    shared: frozenset[str] | None = None
    # the members whose copies the part waits for: those with a weight (None: all); a member of weight 0 only
    # wants the mean: the part waits for its request a short grace more (see ``Owner.close_part``), and it
    # gets the mean whenever it asks while the round lasts, so one asleep holds nothing up for long
    needed: frozenset[str] | None = None
    contributions: dict[str, Contribution] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    rejected: dict[str, str] = field(default_factory=dict)
    duplicates: set[str] = field(default_factory=set)  # sent a second copy (refused with 409)
    went: set[str] = field(default_factory=set)  # closed the connection in the middle of its copy
    closed: bool = False
    settled: asyncio.Event = field(
        default_factory=asyncio.Event
    )  # every needed member's copy is in or refused
    everyone: asyncio.Event = field(default_factory=asyncio.Event)  # ... and every weight-0 member's request
    done: asyncio.Event = field(default_factory=asyncio.Event)  # ``outcome`` is decided
    outcome: PartOutcome | None = None
    more: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) when a frame is added
    complete: asyncio.Event = field(default_factory=asyncio.Event)  # every frame is in, or never will be
    # a spot-check's suspect: its copy is kept (``kept``: as it arrived, float32 or its codec's payload; no
    # longer this reducer's to reuse or scale) when the part closes, and ``arrived`` is set once it is in
    # (the checker asks for its samples only then: it has committed to its copy)
    keep: str | None = None
    kept: np.ndarray | KeptPart | None = None
    arrived: asyncio.Event | None = None
    # what the answer's receipt states (protocol/receipts.py), gathered as each slice is reduced and encoded
    witness: Witness = field(default_factory=lambda: Witness())

    def suspect(self, peer_id: str, arrived: asyncio.Event) -> None:
        """A spot-check's suspect: keep ``peer_id``'s copy when the part closes, and set ``arrived`` once it is in."""
        self.keep, self.arrived = peer_id, arrived

    def begin(self, peer_id: str) -> Literal["ok", "closed", "duplicate"]:
        """Mark the start of ``peer_id``'s copy: "ok", or why it is refused (the part closed, or the peer
        already sent one: a duplicate, also after the part closed). A copy after the part closed is "closed"
        (410: the sender was too late, the others averaged without it) unless the peer's first copy counted:
        then it is a "duplicate" (409), or a sender whose copy is in the mean would take itself for left out
        and fetch the state."""
        duplicate = peer_id in self.started
        if duplicate:
            self.duplicates.add(peer_id)
        if self.closed and peer_id not in self.contributions:
            return "closed"
        if duplicate:
            return "duplicate"
        self.started.add(peer_id)
        return "ok"

    def accept(self, c: Contribution) -> bool:
        """Count a copy read completely; False (not counted) when the part closed while it was read."""
        if self.closed:
            return False
        self.contributions[c.peer_id] = c
        if c.peer_id == self.keep and self.arrived is not None:
            self.arrived.set()
        self._check_settled()
        return True

    def gone(self, peer_id: str) -> None:
        """``peer_id``'s connection closed in the middle of its copy: it will not come (and is dropped)."""
        self.went.add(peer_id)
        self._check_settled()

    def reject(self, peer_id: str, reason: str) -> None:
        self.rejected[peer_id] = reason
        self._check_settled()

    def _check_settled(self) -> None:
        came = set(self.contributions) | set(self.rejected) | self.went
        if (set(self.members) if self.needed is None else self.needed) <= came:
            self.settled.set()
        if set(self.members) <= came:
            self.everyone.set()

    def digests(self) -> dict[str, bytes]:
        """Each copy with values by a digest of its bytes as they arrived (call in a thread, once the part is
        settled or its deadline passed: only copies read completely are in ``contributions``)."""
        out = {}
        for peer, c in list(self.contributions.items()):
            if isinstance(c.values, KeptPart):
                data = c.values.storage[: KeptPart.nbytes(c.values.codec, c.values.length, c.values.step)]
            elif c.values is not None:
                data = np.ascontiguousarray(c.values).view(np.uint8)
            else:
                continue
            out[peer] = hashlib.blake2b(data.data, digest_size=16).digest()
        return out

    def close(self, out: np.ndarray, digests: dict[str, bytes] | None = None) -> list[Term]:
        """Close the part (later copies are refused) and decide its outcome; returns the terms of the mean,
        to be reduced into ``out`` slice by slice (empty when nothing with a weight arrived). ``digests``
        (:meth:`digests`; a later phase only): copies with the same one are one term."""
        self.closed = True
        kept = self.contributions.get(self.keep) if self.keep is not None else None
        if kept is not None and kept.values is not None:  # (before the mean could scale it in place)
            self.kept, kept.storage = kept.values, None  # not owned: the mean reads it, the next round won't
        # every norm is known: clipping is decided before any slice
        terms, clipped, reason = self.plan(digests or {})
        done = set(self.contributions) | set(self.rejected)
        self.outcome = PartOutcome(
            values=out if terms else None,
            frames=[],
            accepted=tuple(sorted(self.contributions)),
            dropped=tuple(sorted(m for m in self.members if m not in done)),
            rejected=tuple(sorted(self.rejected)),
            clipped=clipped,
            reason=reason,
        )
        self.done.set()
        return terms

    def abandon(self, reason: str) -> None:
        """End the part now, if its outcome is not decided yet, as failed: waiting senders are answered."""
        if not self.done.is_set():
            self.closed = True
            self.outcome = PartOutcome(None, [], (), (), (), (), reason=reason)
            self.done.set()
        self.finish()

    def add_frame(self, frame: tuple[bytes, bytes | memoryview]) -> None:
        """Publish the next frame of the answer to the senders waiting for it."""
        assert self.outcome is not None
        self.outcome.frames.append(frame)
        woken, self.more = self.more, asyncio.Event()
        woken.set()

    def finish(self, reduce_s: float | None = None) -> None:
        """No more frames will come (all are in, or the round was abandoned); ``reduce_s``: how long
        reducing and encoding them took."""
        if reduce_s is not None and self.outcome is not None:
            self.outcome = dataclasses.replace(self.outcome, reduce_s=reduce_s)
        self.complete.set()
        self.more.set()

    def plan(self, digests: dict[str, bytes] | None = None) -> tuple[list[Term], tuple[str, ...], str]:
        """The terms of the weighted mean: (copy, factor) pairs, outliers clipped; once every copy is in.

        Returns the terms (empty when nothing with a weight arrived), the clipped members and, on failure,
        why. Clipping needs every member's norm, so no slice can be reduced before this.

        In a later phase (``shared``) the part fails unless every member with a weight sent its copy (a
        column without one node's copy would make another mean than the columns that have it), copies with
        the same digest are one term of their summed weight, in the order of their first member, and they
        are measured against the lower median of the distinct copies' norms, and a copy beyond the bound fails
        the part rather than being clipped (columns cut the vector into other parts, so a clip would differ
        from column to column): each column then adds the same terms with the same factor, whichever members
        of each node it holds and whoever owns the part, or the part fails and the verdicts zero it in all.
        """
        missing = sorted(self.shared - set(self.contributions)) if self.shared is not None else []
        if missing:
            why = f"in a later phase every member with a weight must send its copy; {', '.join(missing)} did not"
            return [], (), why + " (this column's mean would differ from the others')"
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
        total = math.fsum(c.weight for c in weighted)
        weights = {c.peer_id: c.weight for c in weighted}
        groups = {c.peer_id: [(c.peer_id, c.weight)] for c in weighted}
        if self.shared is not None and digests is not None:
            weighted = _merge_identical(weighted, digests, weights, groups)
        scales, clipped, why = self._clip_scales(weighted)
        if why:
            return [], (), why
        terms = [
            (values, np.float32(weights[c.peer_id] * scales[c.peer_id] / total), c.owned)
            for c in weighted
            if (values := c.values) is not None  # (all of them: the type checker cannot know)
        ]
        self.witness = Witness(
            [groups[c.peer_id] for c in weighted], [c.norm for c in weighted], [0.0] * len(terms)
        )
        return terms, tuple(sorted(clipped)), ""

    def _clip_scales(self, weighted: list[Contribution]) -> tuple[dict[str, float], list[str], str]:
        """Each copy's factor (1, or its clip to ``clip_multiple`` × the reference norm), the clipped members,
        and, in a later phase with a copy beyond the bound, why the part fails instead."""
        scales = {c.peer_id: 1.0 for c in weighted}
        clipped: list[str] = []
        if self.clip_multiple <= 0 or len(weighted) < 2:
            return scales, clipped, ""
        reference = self._median_norm(weighted) if self.shared is not None else self._reference_norm(weighted)
        bound = self.clip_multiple * reference
        beyond = [c for c in weighted if c.norm > bound]
        if beyond and self.shared is not None:
            # A later phase never clips: its columns cut the vector into other parts, so this part's clip
            # would be another column's no clip (or another factor) and the columns' means would differ. The
            # part fails instead; the tracker's verdicts then have every column zero its slices, and every
            # member applies one mean.
            names = ", ".join(c.peer_id for c in beyond)
            return (
                scales,
                clipped,
                (
                    f"in a later phase a copy beyond {self.clip_multiple:g} × the median norm fails the part "
                    f"(clipping it here would make another mean than the other columns'): {names}"
                ),
            )
        for c in beyond:
            scales[c.peer_id] = bound / c.norm if c.norm > 0 else 0.0
            clipped.append(c.peer_id)
        return scales, clipped, ""

    @staticmethod
    def _median_norm(weighted: list[Contribution]) -> float:
        norms = sorted(c.norm for c in weighted)
        return norms[(len(norms) - 1) // 2]  # lower median: robust for 2 members

    def _reference_norm(self, weighted: list[Contribution]) -> float:
        """The norm copies are clipped against: the lower median of the copies' norms, but never above the
        owner's own copy's. With the median alone, two colluders of three set their own clip; the owner's
        norm is one no coalition of the others can raise (they can only lower the bound, which takes their
        own weight out of the mean too), and the median still clips an owner whose own copy spikes."""
        median = PartReducer._median_norm(weighted)
        own = self.contributions.get(self.owner)
        if own is not None and own.weight > 0 and own.values is not None and own.norm > 0:
            return min(own.norm, median)
        return median

    def receipt(self, members: list[str], shared: bool) -> Receipt:
        """The receipt of my answer (unsigned), once every slice was witnessed (:meth:`Witness.receipt`)."""
        return self.witness.receipt(self.part, members, shared)

    @staticmethod
    def reduce_slice(terms: list[Term], a: int, b: int, out: np.ndarray) -> None:
        """Weighted mean in fp32 of values ``[a, b)`` of every term into ``out`` (in a thread).

        Element by element the same operations in the same order whatever the slicing, so a part reduced
        slice by slice is bit for bit the part reduced at once. A term not ``owned`` is a view of the
        caller's vector: it is never written. A kept copy is decoded a slice (one frame) at a time.
        """
        for i, (values, factor, owned) in enumerate(terms):
            v = values.values(a, b) if isinstance(values, KeptPart) else values[a:b]
            if i == 0:
                np.multiply(v, factor, out=out)
            elif owned:  # a received copy (or a slice decoded from one): scale it in place, then add
                v *= factor
                out += v
            else:  # my own copy: one temporary
                out += v * factor


def _merge_identical(
    weighted: list[Contribution],
    digests: dict[str, bytes],
    weights: dict[str, float],
    groups: dict[str, list[tuple[str, float]]],
) -> list[Contribution]:
    """The copies with distinct digests, each the first of its kind in ``weighted``'s order, whose entry in
    ``weights`` becomes the sum of its kind's weights (whole numbers of samples: exact), and whose entry in
    ``groups`` lists its kind's members."""
    first: dict[bytes, Contribution] = {}
    for c in weighted:
        d = digests.get(c.peer_id, c.peer_id.encode())
        if d in first:
            weights[first[d].peer_id] += c.weight
            groups[first[d].peer_id] += groups.pop(c.peer_id)
        else:
            first[d] = c
    return list(first.values())


@dataclass(slots=True)
class Witness:
    """What an answer's receipt states, gathered slice by slice: per term of the mean its members (with their
    weights) and norm, and ``f · <copy, answer>``; the answer's squared norm and digest; once the last frame
    is in, the receipt signed (``receipt_bytes``)."""

    term_members: list[list[tuple[str, float]]] = field(default_factory=list)
    term_norms: list[float] = field(default_factory=list)
    term_dots: list[float] = field(default_factory=list)
    answer_norm2: float = 0.0
    answer_hash: Any = field(default_factory=lambda: hashlib.blake2b(digest_size=16))
    receipt_bytes: bytes | None = None

    def add(self, terms: list[Term], a: int, b: int, answer: np.ndarray) -> None:
        """Add values ``[a, b)`` of the answer, as its receivers decode them: each term's ``f · <copy,
        answer>``, the answer's squared norm and digest (call in a thread, right after
        :meth:`PartReducer.reduce_slice` of the same slice, in slice order)."""
        self.answer_norm2 += float(np.dot(answer, answer))
        self.answer_hash.update(np.ascontiguousarray(answer).data)
        for i, (values, factor, owned) in enumerate(terms):
            if isinstance(values, KeptPart):
                self.term_dots[i] += float(factor) * float(np.dot(values.values(a, b), answer))
            elif i > 0 and owned:  # reduce_slice scaled it in place: it is the term itself
                self.term_dots[i] += float(np.dot(values[a:b], answer))
            else:
                self.term_dots[i] += float(factor) * float(np.dot(values[a:b], answer))

    def signed(self, receipt: bytes) -> None:
        self.receipt_bytes = receipt

    def receipt(self, part: int, members: list[str], shared: bool) -> Receipt:
        """The receipt of the answer (unsigned), once every slice was added: a line per member of the round
        (in ``members``' order), its share of its term's inner product by weight."""
        index = {peer: i for i, peer in enumerate(members)}
        lines = [Line(math.nan, 0.0, 0.0, i) for i in range(len(members))]
        for group, norm, dot in zip(self.term_members, self.term_norms, self.term_dots, strict=True):
            total = math.fsum(w for _, w in group)
            first = index[group[0][0]]
            for peer, w in group:
                lines[index[peer]] = Line(w, norm, dot * w / total if total > 0 else 0.0, first)
        return Receipt(part, shared, self.answer_norm2, self.answer_hash.digest(), tuple(lines))
