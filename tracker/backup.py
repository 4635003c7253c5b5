"""Backup workers (issue 27): the rules that keep a step from waiting on a volunteer asleep, beside the
ledger that keeps the shares (:mod:`crowdtrain.tracker.ledger`; ``docs/tracker.md``, item 9).

* **Late.** Once the peers done with the open step have waited (LATE_FACTOR - 1) × their step (at least
  LATE_GRACE_S), a peer that still owes samples and is past LATE_FACTOR × what its rest should take at its
  rate (plus LATE_GRACE_S) is late (:func:`late`); the run revokes it if it is also silent
  (:func:`crowdtrain.tracker.collab.revoke_stragglers`).
* **Spares** (delay 0, one inner step; :class:`Spares`). Once the first peer done with the open step has
  waited SPARE_WAIT_S (or SPARE_FRACTION of its step) and *every* peer that still owes samples is behind its
  time (from its last report at the step, by SPARE_MARGIN_S or SPARE_FRACTION of its rest), what the step
  still lacks is offered to the peers that owe nothing, by rate, each within its room and a micro-batch at
  least. The peers behind are covered (one that reports is cut to what it holds), except one that has not
  reported at the step since its round moved it there: it may still be in its round (held by a member
  asleep, or sending its answers up a home line), so it keeps its share and is waited for at the close;
  its time runs from when the first peer at the step began it, if sooner than its own last report.
* **Checks** (:func:`check_shifts`). A peer drawn to spot-check a member (``docs/security.md``) recomputes
  that member's samples before it begins the new step; its share of the step is cut by what the others
  compute meanwhile, which goes to them by rate, so the step does not wait for the check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crowdtrain.tracker.ledger import Share

# A peer that owes samples is late (the rule above) past LATE_FACTOR × what its rest should take, plus
# LATE_GRACE_S, once the peers done with the step have waited (LATE_FACTOR - 1) × their step, at least
# LATE_GRACE_S.
LATE_FACTOR = 1.5
LATE_GRACE_S = 0.5
# Spares (the rule above): the first peer done waits SPARE_WAIT_S, or SPARE_FRACTION of its step, and
# a peer owing samples is behind once past its time by SPARE_MARGIN_S, or SPARE_FRACTION of its rest.
SPARE_WAIT_S = 0.1
SPARE_FRACTION = 0.15
SPARE_MARGIN_S = 0.15


def late(at_step: list[Share], now: float) -> list[str]:
    """The peers late at the open step, from the shares of the peers at it (the rule above); none until a
    peer is done with it."""
    finished = [s for s in at_step if s.done_at >= 0]
    if not finished:
        return []
    last_done = max(s.done_at for s in finished)
    took = max(s.done_at - s.step_since for s in finished)
    if now - last_done < max(LATE_GRACE_S, (LATE_FACTOR - 1) * took):
        return []
    found = []
    for s in at_step:
        owed = s.allotted - s.samples
        if not s.computing or owed <= 0 or s.samples_per_s <= 0:
            continue
        reported = max(s.counted_at, s.step_since)
        if now - reported >= LATE_FACTOR * owed / s.samples_per_s + LATE_GRACE_S:
            found.append(s.peer_id)
    return found


class Spares:
    """The spares of the open step (the rule above; :meth:`~crowdtrain.tracker.ledger.Ledger.open_spares`)."""

    __slots__ = ("covered", "first_begin", "given", "last", "offered")

    def __init__(self) -> None:
        self.offered: dict[str, int] = {}  # spare samples a peer done with the step is allotted next
        self.given: set[str] = set()  # the peers allotted a spare
        self.covered: set[str] = set()  # the peers whose rest they cover, silent since
        self.last = -math.inf  # when they last opened
        self.first_begin = math.inf  # when the first peer at the step said it began it

    def open(
        self, at_step: list[Share], missing: int, now: float, room: Callable[[Share], int], micro: int
    ) -> int:
        """Open them if the rule says so, from the shares of the peers at the open step and the samples the
        step still lacks; returns the samples offered (0: none). Only once every peer that owes samples is
        behind (one on time keeps its share); again once those given spares are behind too (one fell asleep
        computing them), and then not to a peer that left its last offer untaken. They go to the peers that
        compute and owe nothing (done with the step, or idle at it with nothing allotted: one back from a
        catch-up), by rate, each within its room (``room``: the share cap) and at least a micro-batch
        (``micro``) where its room allows, so a spare is never a sliver of a micro-batch."""
        if missing <= 0 or now - self.last < SPARE_WAIT_S:
            return 0
        idle = [
            s
            for s in at_step
            if s.computing
            and s.allotted <= s.samples
            and s.peer_id not in self.offered
            and room(s) > s.samples
        ]
        done = [s for s in idle if s.done_at >= 0]
        if not idle:
            return 0
        # the first peer done has waited a little (or a peer idle at the step since its last report)
        first = min(s.done_at if s.done_at >= 0 else s.counted_at for s in idle)
        took = min((s.done_at - s.step_since for s in done), default=0.0)
        if now - first < max(SPARE_WAIT_S, SPARE_FRACTION * took):
            return 0
        found = self._behind(at_step, now)
        if found is None:
            return 0
        behind = found
        rated = [s.samples_per_s for s in idle if s.samples_per_s > 0]
        mean = sum(rated) / len(rated) if rated else 1.0  # (an unknown rate counts as the mean)
        rates = {s.peer_id: s.samples_per_s if s.samples_per_s > 0 else mean for s in idle}
        total = sum(rates.values())
        self.last = now
        self.covered |= behind
        # every peer that owes samples is behind: what the step lacks goes to the idle ones, by rate
        self.offered = {}
        for s in idle:
            fair = max(math.ceil(missing * rates[s.peer_id] / total), micro)
            self.offered[s.peer_id] = min(fair, room(s) - s.samples)
        return sum(self.offered.values())

    def _behind(self, at_step: list[Share], now: float) -> set[str] | None:
        """The peers behind their time that are covered, if *every* peer that owes samples is behind (None:
        one is on time, or its time is unknown, or none owes any). One that has not said it began the step
        is behind but not covered: it may be asleep, or still in its round (sending answers up a home line);
        its rest is offered, it keeps its share and is waited for at the close like anyone. It is timed from
        when the first peer began, if sooner than its own last report: it was moved to the step with the
        others (it slept through its round's end, or its begin, while a stale heartbeat moved its clock on)."""
        behind, owing = set(), False
        for s in at_step:
            owed = s.allotted - s.samples
            if not s.computing or owed <= 0:
                continue
            if s.samples_per_s <= 0:
                return None  # (its time is unknown: it is not behind)
            rest = owed / s.samples_per_s
            since = max(s.counted_at, s.step_since)
            due = (since if s.begun else min(since, self.first_begin)) + rest
            if now < due + max(SPARE_MARGIN_S, SPARE_FRACTION * rest):
                return None  # one on time: no spares (they would cut its share, and idle the others no less)
            owing = True
            if s.begun:
                behind.add(s.peer_id)
        return behind if owing else None

    def take(self, peer_id: str) -> int:
        """The spare ``peer_id`` is allotted now (0: none)."""
        spare = self.offered.pop(peer_id, 0)
        if spare:
            self.given.add(peer_id)
        return spare


def check_shifts(shares: list[Share], busy: dict[str, int]) -> dict[str, int]:
    """The change to each allotment of a new step (the rule "Checks" above), from the shares moved to it
    (allotted by rate) and the samples each checker recomputes first (``busy``). A checker at rate ``r``
    busy with ``b`` samples while the others compute at ``R`` is cut by ``b × R ÷ (r + R)`` (never below
    what it holds); the others gain that by rate, rounded down (the changes never sum above 0)."""
    rated = [s for s in shares if s.computing and s.samples_per_s > 0]
    total = sum(s.samples_per_s for s in rated)
    shifts: dict[str, int] = {}
    for checker in rated:
        others = [s for s in rated if s is not checker]
        rest = total - checker.samples_per_s
        owed = checker.allotted - checker.samples + shifts.get(checker.peer_id, 0)
        cut = min(owed, math.floor(busy.get(checker.peer_id, 0) * rest / total)) if others else 0
        if cut <= 0:
            continue
        shifts[checker.peer_id] = shifts.get(checker.peer_id, 0) - cut
        for s in others:
            shifts[s.peer_id] = shifts.get(s.peer_id, 0) + math.floor(cut * s.samples_per_s / rest)
    return shifts
