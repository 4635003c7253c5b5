"""One all-reduce round as both sides of it see it: its record, its byte counts, and what it gave.

:class:`Round` is what :class:`~crowdtrain.volunteer.averaging.allreduce.Averager` sets up from a checked
assignment and hands to the owner side (:mod:`~crowdtrain.volunteer.averaging.owner`, which receives the
copies of the part this peer owns) and to the member side (:mod:`~crowdtrain.volunteer.averaging.sender`,
which sends this peer's copies of the other parts); both add their bytes and seconds to its :class:`Stats`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from crowdtrain.protocol.messages import GroupAssignment, GroupMember
from crowdtrain.protocol.receipts import Finding
from crowdtrain.volunteer.averaging.reducer import PartReducer

NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")  # a round id or a tag: one path segment of the route


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What one all-reduce round gave this peer."""

    round_key: str
    values: np.ndarray  # the weighted mean (float32); local values in ``failed_parts``
    members: tuple[str, ...]
    my_part: int  # -1: client mode
    dropped: tuple[str, ...]  # members whose copy of my part did not arrive by the deadline
    rejected: tuple[str, ...]  # members whose copy of my part failed a check
    clipped: tuple[str, ...]  # members whose copy of my part was scaled down to the norm bound
    failed_parts: tuple[int, ...]  # parts whose owner failed or refused me; local values kept
    bytes_sent: int
    bytes_received: int
    raw_bytes: int  # what the values I sent would have taken as plain fp32
    duration: float
    phases: dict[str, float]
    reasons: dict[str, str] = field(default_factory=dict)  # "part 2" / peer id → why, for the log
    # an owner had closed its part (or the round) before my copy came: my values are not the group's
    late: bool = False

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.bytes_sent if self.bytes_sent else 0.0


@dataclass(slots=True)
class Stats:
    """Bytes and seconds of one round, added to by both sides."""

    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    # this peer's answers (owner side): perf_counter seconds of the first byte handed out and of the last
    # byte acknowledged, the bytes, and how many answers were acknowledged: its upload rate is measured on them
    answering: list[float] = field(default_factory=lambda: [math.inf, -math.inf])
    answered_bytes: int = 0
    answers_acked: int = 0

    def sent(self, sent: int, raw: int) -> None:
        self.bytes_sent += sent
        self.raw_bytes += raw

    def answered(self, nbytes: int) -> None:
        """This peer handed out ``nbytes`` of an answer (owner side)."""
        self.answered_bytes += nbytes

    def received(self, received: int, decode_s: float) -> None:
        self.bytes_received += received
        self.decode_s += decode_s

    def mark(self) -> None:
        """Answer bytes were handed out, or acknowledged, now."""
        t = time.perf_counter()
        self.answering[0], self.answering[1] = min(self.answering[0], t), max(self.answering[1], t)

    @property
    def upload_s(self) -> float:
        """Seconds from this peer's first answer byte handed out to its last acknowledged (0: none)."""
        return max(0.0, self.answering[1] - self.answering[0])


@dataclass(slots=True)
class Round:
    key: str
    assignment: GroupAssignment
    members: dict[str, GroupMember]
    bounds: list[tuple[int, int]]  # part index → [start, stop)
    my_part: int
    deadline: float
    uniform: bool  # every assigned weight is 0: the plain mean of everyone's values
    tag: str
    answer_stored: bool = False  # my part's answer goes stored, with a Content-Length (see Coder.stores)
    reducer: PartReducer | None = None
    output: np.ndarray | None = None  # where the round's result is written
    in_place: bool = False  # ``output`` is this peer's vector itself
    stats: Stats = field(default_factory=Stats)
    # answers whose receipt failed (protocol/receipts.py): (owner, part, the receipt, what is wrong with it)
    complaints: list[tuple[str, int, bytes, Finding]] = field(default_factory=list)
    # the receipts that held, as received: part → (owner's index, the receipt's bytes)
    held: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    late: bool = False  # an owner refused my copy with 410 (its part or the round had closed), or I was cut
    # cutting a member asleep in the round (tracker/cuts.py): when the round last moved (monotonic), and the
    # owners the group cut
    moved_at: float = field(default_factory=time.monotonic)
    cut: set[str] = field(default_factory=set)

    @property
    def shared(self) -> bool:
        """A later phase of the step (``assignment.phase > 0``): each member's values are its node's, held
        bit for bit alike by that node's members in every column of the phase, so every column must make the
        same bytes of them: copies and answers are encoded without error feedback, the owner's own copy
        counts as the others receive it (quantised), identical copies count once with their summed weight,
        and the part fails unless every member with a weight sent its copy (see the owner and reducer)."""
        return self.assignment.phase > 0

    def moved(self) -> None:
        """Something of the round arrived or went out completely now (an answer began, a sub-frame of one
        came, a copy went out)."""
        self.moved_at = time.monotonic()


def part_bounds(n: int, parts: int, weights: Sequence[int] = (), align: int = 1) -> list[tuple[int, int]]:
    """Contiguous slices of ``n`` values, one per part: part i holds ``weights[i] / sum(weights)`` of them
    (rounded at the cumulative sums, so every member cuts the same bounds), or, with no weights, sizes that
    differ by at most one.

    ``align``: every bound but the last is a multiple of it (the parts are dealt whole blocks of ``align``
    values; some may then be empty): a lossy codec's blocks then sit at the same places of the vector
    whoever owns them (:func:`~crowdtrain.protocol.codecs.block`), so groups that hold the same values and cut
    them into other parts quantise them alike."""
    if align < 1:
        raise ValueError("align must be at least 1")
    units = -(-n // align)
    if weights:
        if len(weights) != parts or min(weights) < 1:
            raise ValueError(f"{len(weights)} part weights for {parts} parts, each at least 1")
        total, cum, stops = sum(weights), 0, []
        for w in weights:
            cum += w
            stops.append(units * cum // total)
    else:
        base, extra = divmod(units, parts)
        stops = [base * (k + 1) + min(k + 1, extra) for k in range(parts)]
    bounds, start = [], 0
    for stop_units in stops:
        stop = min(n, stop_units * align)
        bounds.append((start, stop))
        start = stop
    return bounds
