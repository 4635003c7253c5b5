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
  asleep, or sending its answers up a home line), so it keeps its share and is waited for at the close.
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

    __slots__ = ("covered", "given", "last", "offered")

    def __init__(self) -> None:
        self.offered: dict[str, int] = {}  # spare samples a peer done with the step is allotted next
        self.given: set[str] = set()  # the peers allotted a spare
        self.covered: set[str] = set()  # the peers whose rest they cover, silent since
        self.last = -math.inf  # when they last opened

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
        behind, unbegun = set(), False
        for s in at_step:
            owed = s.allotted - s.samples
            if not s.computing or owed <= 0:
                continue
            if s.samples_per_s <= 0:
                return 0  # (its time is unknown: it is not behind)
            rest = owed / s.samples_per_s
            due = max(s.counted_at, s.step_since) + rest
            if now < due + max(SPARE_MARGIN_S, SPARE_FRACTION * rest):
                return 0  # one on time: no spares (they would cut its share, and idle the others no less)
            if s.begun:
                behind.add(s.peer_id)
            else:
                # past its time, but it has not said it began the step: it may be asleep, or still in its
                # round (sending answers up a home line). Its rest is offered, but it is not covered: it
                # keeps its share, and is waited for at the close like anyone
                unbegun = True
        if not behind and not unbegun:
            return 0
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

    def take(self, peer_id: str) -> int:
        """The spare ``peer_id`` is allotted now (0: none)."""
        spare = self.offered.pop(peer_id, 0)
        if spare:
            self.given.add(peer_id)
        return spare
