"""A step's waiting rules, with their constants in one frozen, validated :class:`StepPolicy`: when a peer is
a straggler, late, behind (spares), or awaited at a close; beside the ledger that keeps the shares
(:mod:`crowdtrain.tracker.ledger`; ``docs/tracker.md``, item 9). The rules are clock-free: each takes the
time it is asked at.

* **Stragglers.** A peer at the open step that owes samples and said nothing for the tracker's
  ``straggler_intervals`` heartbeat intervals (at least ``straggle_floor_s``: a volunteer's event loop may lag
  behind its interval on a loaded machine) is revoked, as is one that is late (below) and silent for
  ``late_silent_s`` (one that spoke within it is computing, only slower than it said); the tracker looks every
  ``straggle_check_s`` (:func:`crowdtrain.tracker.collab.revoke_stragglers`).
* **Late.** Once the peers done with the open step have waited (``late_factor`` - 1) × their step (at least
  ``late_grace_s``), a peer that still owes samples and is past ``late_factor`` × what its rest should take at
  its rate (plus ``late_grace_s``) is late (:func:`late`).
* **Spares** (delay 0, one inner step: ``AveragingSpec.spares``; :class:`Spares`). Once the first peer done
  with the open step has waited ``spare_wait_s`` (or ``spare_fraction`` of its step) and a peer that still
  owes samples is behind its time (from its last report at the step, by ``spare_margin_s`` or
  ``spare_fraction`` of its rest), what the step still lacks beyond the rest of the peers on time is offered
  to the peers that owe nothing, by rate, each within its room and a micro-batch at least, the fastest first
  and to no more of them than cover what it lacks; the peers on time keep their shares. The peers behind are
  covered (one that reports is cut to what it holds), except one that has not reported at the step since its
  round moved it there: it may still be in its round (held by a member asleep, or sending its answers up a
  home line), so it keeps its share and is waited for at the close.
* **Shared rest** (:meth:`Spares.open`, :meth:`Spares._share_rest`). A peer that owes samples may be on
  time and still far from done: it began the step late (back from a catch-up, or after recomputing a
  member's gradient for a spot-check). Once the first peer done has waited as above, every peer that owes
  samples is on time and has reported at its step, and the last one is due more than ``steal_fraction`` of
  the done peers' step ahead (``steal_min_s`` at least), their rest (less what each computed since its last
  report at its rate, and less the micro-batch each may have in flight) is moved at once to the peers done
  with room for a micro-batch, in whole micro-batches by rate, fastest first, so that all finish together;
  the owing peers are trimmed by what the helpers got, in proportion. Each hears its new allotment at its
  report (what was moved is announced on the step watches, so at once). Nothing computed is dropped: every
  sample computed before the close enters the round.
* **Answer waits** (:func:`answer_wait`, :func:`answered`). After a close, a pending peer whose answers the
  tracker has timed is waited for ``answer_factor`` × its slowest recent answer (a decaying maximum: ×
  ``answer_decay`` a round; one answer raises it ``answer_growth`` × at most), at least ``answer_floor_s``
  and at most ``gather_s``. A live volunteer answers a close within a round trip (its step watch wakes it, or
  its micro-batch in flight ends; on a home line its answers are slower, and so is its wait); one that does
  not is asleep, and the others do not wait ``gather_s`` for it.
* **A round's inner steps** (``inner_steps = "auto"``): ``auto_hide_margin``, ``auto_share``, ``auto_shrink``,
  ``auto_growth``, ``auto_dead_band``;
  the rule is :func:`crowdtrain.tracker.horizon.next_inner_steps`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields

from crowdtrain.protocol.errors import ConfigError
from crowdtrain.protocol.messages import RunSpec
from crowdtrain.tracker.peers import Peer, Share


@dataclass(frozen=True, slots=True)
class StepPolicy:
    """The constants of a step's waiting rules (the module docstring says each rule); checked when made."""

    straggle_floor_s: float = 2.0
    straggle_check_s: float = 0.1
    late_silent_s: float = 1.0
    late_factor: float = 1.5
    late_grace_s: float = 0.5
    spare_wait_s: float = 0.1
    spare_fraction: float = 0.15
    spare_margin_s: float = 0.15
    steal_fraction: float = 0.25
    steal_min_s: float = 0.25
    answer_factor: float = 4.0
    answer_floor_s: float = 0.15
    answer_decay: float = 0.8
    answer_growth: float = 2.0
    auto_hide_margin: float = 2.0  # inner_steps = "auto" (tracker/horizon.py): compute ≥ this × averaging
    auto_share: float = 0.9  # ... and with delay 0, the compute share it aims at
    auto_shrink: float = 0.5  # ... and the most H shrinks a round, as a fraction of it
    auto_growth: float = 2.0  # ... and the most it grows a round, as a multiple of it
    auto_dead_band: float = 1.25  # ... and H stays while the rule's choice is within this factor of it

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f.name, f"{value!r} must be a finite number, 0 or more")
        if self.straggle_check_s <= 0:
            raise ConfigError("straggle_check_s", "must be above 0 (the tracker looks this often)")
        if self.late_factor < 1 or self.answer_growth < 1 or self.answer_factor < 1:
            raise ConfigError("late_factor", "late_factor, answer_factor and answer_growth must be 1 or more")
        if self.auto_hide_margin < 1 or self.auto_growth < 1 or self.auto_dead_band < 1:
            raise ConfigError(
                "auto_hide_margin",
                "auto_hide_margin, auto_growth and auto_dead_band must be 1 or more",
            )
        for name in ("spare_fraction", "steal_fraction", "answer_decay", "auto_shrink"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(name, f"{getattr(self, name)} must be above 0 and at most 1")
        if not 0 < self.auto_share < 1:
            raise ConfigError("auto_share", f"{self.auto_share} must be above 0 and below 1")

    def silent_s(self, intervals: float, heartbeat_interval_s: float) -> float:
        """How long a peer at the open step that owes samples may say nothing before it is a straggler."""
        return max(intervals * heartbeat_interval_s, self.straggle_floor_s)


POLICY = StepPolicy()


def late(at_step: list[Share], now: float) -> list[str]:
    """The peers late at the open step, from the shares of the peers at it (the rule above); none until a
    peer is done with it."""
    finished = [s for s in at_step if s.done_at >= 0]
    if not finished:
        return []
    last_done = max(s.done_at for s in finished)
    took = max(s.done_at - s.step_since for s in finished)
    if now - last_done < max(POLICY.late_grace_s, (POLICY.late_factor - 1) * took):
        return []
    found = []
    for s in at_step:
        owed = s.allotted - s.samples
        if not s.computing or owed <= 0 or s.samples_per_s <= 0:
            continue
        reported = max(s.counted_at, s.step_since)
        if now - reported >= POLICY.late_factor * owed / s.samples_per_s + POLICY.late_grace_s:
            found.append(s.peer_id)
    return found


def answer_wait(
    peer: Peer, step: int, spec: RunSpec, in_flight: bool = True, unanswered_s: float = 0.0
) -> float:
    """How long after a close the tracker gathers ready calls for ``peer`` (pending): ``gather_s`` while its
    answers were never timed, else POLICY.answer_factor × its slowest recent answer within [POLICY.answer_floor_s,
    ``gather_s``]; plus one of its micro-batches if it holds samples of the step and may be computing one
    (``in_flight``, :meth:`Ledger.in_flight`: one in flight is finished before it says "ready"); less the
    ``unanswered_s`` it has already let pass since it was asked to report (spares opened) and said nothing."""
    share, gather_s = peer.share, spec.averaging.gather_s
    wait = (
        gather_s
        if peer.answer_s is None
        else min(gather_s, max(POLICY.answer_floor_s, POLICY.answer_factor * peer.answer_s))
    )
    if share.step == step and share.samples > 0 and share.samples_per_s > 0 and in_flight:
        wait += spec.micro_batch_size / share.samples_per_s
    return max(0.0, wait - unanswered_s)


def answered(peer: Peer, waited_s: float, now: float) -> None:
    """``peer`` said "ready" ``waited_s`` seconds after its step closed: timed, if it had reached its allotment
    before the close (its answer is then a round trip, not a micro-batch and a round trip); ``now``: monotonic."""
    done_at = peer.share.done_at
    if done_at >= 0 and now - done_at >= waited_s:
        old = peer.answer_s
        # (one answer from a peer that fell asleep at the close, then woke, raises it 2× at most)
        peer.answer_s = (
            waited_s
            if old is None
            else max(POLICY.answer_decay * old, min(waited_s, POLICY.answer_growth * old))
        )


class Gathering:
    """After a close, the ready calls gathered: the peers still awaited (``pending``) and until when."""

    __slots__ = ("pending", "until")

    def __init__(self) -> None:
        self.pending: set[str] = set()
        self.until = 0.0

    def start(self, now: float, pending: set[str], wait_s: float) -> None:
        self.pending, self.until = pending, now + wait_s

    def clear(self) -> None:
        self.pending = set()

    def waits(self, now: float) -> bool:
        """Whether ready calls are still awaited."""
        return bool(self.pending) and now < self.until

    def again(self, now: float, wait_s: float, most_s: float) -> None:
        """The first ready call with samples came ``now``, after the gathering ended (the close waited for its
        contributors: with delay 1 each says "ready" once its previous round ended, and a member gone from
        that round holds every other member up alike): the others pending are gathered from now
        (``wait_s``: their longest answer wait, at most ``most_s``), or the round would form with the first
        alone and every other fall behind, fetching the state."""
        if now >= self.until:
            self.until = now + min(wait_s, most_s)


class Spares:
    """The spares of the open step (the rule above; :meth:`~crowdtrain.tracker.ledger.Ledger.open_spares`)."""

    __slots__ = ("covered", "given", "last", "moved", "offered", "trimmed")

    def __init__(self) -> None:
        self.offered: dict[str, int] = {}  # spare samples a peer done with the step is allotted next
        self.given: set[str] = set()  # the peers allotted a spare
        self.covered: set[str] = set()  # the peers whose rest they cover, silent since
        self.trimmed: dict[str, int] = {}  # peers on time whose rest was shared: the allotment they keep
        self.moved: dict[str, int] = {}  # the peers done given part of that rest, not told yet: how much
        self.last = -math.inf  # when they last opened

    def open(
        self, at_step: list[Share], missing: int, now: float, room: Callable[[Share], int], micro: int
    ) -> int:
        """Open them if the rule says so, from the shares of the peers at the open step and the samples the
        step still lacks; returns the samples offered (0: none). Only once a peer that owes samples is behind
        (what those on time still bring is not offered), or every one is on time and the last is due far
        enough ahead (the shared rest: those on time are trimmed); again once those given spares are behind
        too (one fell asleep computing them), and then not to a peer that left its last offer untaken. They
        go to the peers that compute and owe nothing (done with the step, or idle at it with nothing
        allotted: one back from a catch-up), by rate, each within its room (``room``: the share cap) and at
        least a micro-batch (``micro``) where its room allows, so a spare is never a sliver of one
        (:meth:`_offer`)."""
        if missing <= 0 or now - self.last < POLICY.spare_wait_s:
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
        if now - first < max(POLICY.spare_wait_s, POLICY.spare_fraction * took):
            return 0
        found = _owing(at_step, now)
        if found is None:
            return 0
        owing, on_time, behind = found
        rated = [s.samples_per_s for s in idle if s.samples_per_s > 0]
        mean = sum(rated) / len(rated) if rated else 1.0  # (an unknown rate counts as the mean)
        rates = {s.peer_id: s.samples_per_s if s.samples_per_s > 0 else mean for s in idle}
        if len(on_time) == len(owing):
            # the shared rest, if every peer owing samples is on time and the last one keeps the peers done
            # waiting long enough (those with room for a micro-batch): :meth:`settle` moves the samples
            helping = [s for s in idle if room(s) - s.samples >= micro]
            ahead = max(_due(s) for s in on_time) - now
            if helping and ahead > max(POLICY.steal_min_s, POLICY.steal_fraction * took):
                self._share_rest(owing, helping, rates, now, micro, lambda s: room(s) - s.samples)
                self.last = now
            return 0  # (else no spares: they would cut its share, and idle the others no less)
        # Some owe samples past their time (and others on time, perhaps): what the step lacks beyond what those
        # on time still bring is offered now; those on time keep their shares.
        missing -= sum(s.allotted - s.samples for s in on_time)
        if missing <= 0:
            return 0
        self.last = now
        self.covered |= behind
        return self._offer(idle, rates, missing, micro, room)

    def _offer(
        self,
        idle: list[Share],
        rates: dict[str, float],
        missing: int,
        micro: int,
        room: Callable[[Share], int],
    ) -> int:
        """Offer the ``missing`` samples to the ``idle`` peers by rate, each its part and a micro-batch at
        least, within its room; the fastest first, until the offers cover them (16 peers done and one
        micro-batch lacking: one peer computes it, not 15). Returns the samples offered."""
        total = sum(rates.values())
        self.offered, offered = {}, 0
        for s in sorted(idle, key=lambda s: rates[s.peer_id], reverse=True):
            if offered >= missing:
                break
            fair = max(math.ceil(missing * rates[s.peer_id] / total), micro)
            self.offered[s.peer_id] = min(fair, room(s) - s.samples)
            offered += self.offered[s.peer_id]
        return offered

    def _share_rest(
        self,
        owing: list[Share],
        helping: list[Share],
        rates: dict[str, float],
        now: float,
        micro: int,
        space: Callable[[Share], int],
    ) -> None:
        """The shared rest: what the peers owing samples (all on time) still have to compute, less what they
        computed since their last report at their rate, is computed by them and the peers done with the step
        (``helping``, at ``rates``) together: each helper gets its part by rate in whole micro-batches
        (``micro``; within its room, ``space``), each owing peer is trimmed by what the helpers got, in
        proportion to what it could give: its rest less the micro-batch it may have in flight (a trim
        smaller than a micro-batch would only make it compute past its allotment)."""
        left, spare = {}, {}
        for s in owing:
            since = max(0.0, now - max(s.counted_at, s.step_since))
            left[s.peer_id] = max(0, s.allotted - s.samples - math.floor(s.samples_per_s * since))
            spare[s.peer_id] = max(0, left[s.peer_id] - micro)
        rest = sum(spare.values())
        speed = sum(rates[s.peer_id] for s in helping) + sum(s.samples_per_s for s in owing)
        finish_s = sum(left.values()) / speed
        remaining = rest  # (the fastest helpers first, until the rest is covered)
        for s in sorted(helping, key=lambda s: rates[s.peer_id], reverse=True):
            part = min(max(round(rates[s.peer_id] * finish_s / micro), 1) * micro, space(s), remaining)
            if part < micro:
                break
            self.moved[s.peer_id] = part
            remaining -= part
        taken = rest - remaining
        for s in owing:
            if taken and spare[s.peer_id]:
                self.trimmed[s.peer_id] = s.allotted - math.floor(taken * spare[s.peer_id] / rest)

    def settle(
        self, shares: dict[str, Share], step: int, changing: Callable[[Share], AbstractContextManager[Share]]
    ) -> int:
        """Move the shared rest (if :meth:`open` shared one) in the ledger's ``shares`` at ``step``, each share
        changed inside ``changing`` (the ledger's tally follows); returns the samples moved to the peers done
        (each hears its new allotment at its report: the step watches answer)."""
        for peer_id, keep in self.trimmed.items():
            share = shares.get(peer_id)
            if share is not None and share.step == step and share.samples < keep < share.allotted:
                with changing(share):
                    share.allotted = keep
        moved = 0
        for peer_id, more in self.moved.items():
            share = shares[peer_id]  # (:meth:`open` just found it at the step, done with it)
            if share.allotted <= share.samples:  # (moved just now: the others were moved before)
                with changing(share):
                    share.allotted = share.samples + more
                self.given.add(peer_id)
                moved += more
        return moved

    def trim(self, peer_id: str, holds: int) -> int | None:
        """The allotment ``peer_id`` gets at its report if its rest was shared and it holds less (None:
        not trimmed, it reached that already, or spares covered it since: it stops at what it holds)."""
        keep = self.trimmed.get(peer_id)
        return None if keep is None or holds >= keep or peer_id in self.covered else keep

    def take(self, peer_id: str) -> int:
        """The spare ``peer_id`` is allotted now (0: none)."""
        spare = self.offered.pop(peer_id, 0)
        if spare:
            self.given.add(peer_id)
        return spare


def _owing(at_step: list[Share], now: float) -> tuple[list[Share], list[Share], set[str]] | None:
    """The peers that owe samples of the open step, those of them on time, and the ids of those behind
    (past their time and begun); None when no spares can open (none owes, one's time is unknown, or one on
    time has not said it began the step: it may still be in its round)."""
    owing = [s for s in at_step if s.computing and s.allotted > s.samples]
    if not owing or any(s.samples_per_s <= 0 for s in owing):
        return None
    on_time = [
        s for s in owing if now < _due(s) + max(POLICY.spare_margin_s, POLICY.spare_fraction * _rest(s))
    ]
    if any(not s.begun for s in on_time):
        return None
    # one past its time that has not said it began the step may be asleep, or still in its round (sending
    # answers up a home line): its rest is offered, but it is not covered (it keeps its share, and is
    # waited for at the close like anyone)
    timely = {s.peer_id for s in on_time}
    return owing, on_time, {s.peer_id for s in owing if s.peer_id not in timely and s.begun}


def _rest(s: Share) -> float:
    """Seconds the rest of its allotment takes at its rate."""
    return (s.allotted - s.samples) / s.samples_per_s


def _due(s: Share) -> float:
    """When it should be done with its allotment: its rest from its last report at the step."""
    return max(s.counted_at, s.step_since) + _rest(s)
