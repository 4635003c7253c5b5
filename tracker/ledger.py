"""The share ledger of one run: how many samples each peer may compute for the open step, what it is
credited with, and how many it may compute ahead for the next step (DeDLOC's target batch, cut up by rate).

Pure: no asyncio and no clock. Every call that needs the time is told it (monotonic seconds), so the rules
are tested on their own (``tests/test_ledger.py``) as :mod:`crowdtrain.tracker.matchmaking` is. The run
(:class:`crowdtrain.tracker.collab.RunState`) reads a peer's :class:`Share` and the :class:`Tally`; only the
ledger writes them, and it keeps the tally equal to the sum over the shares itself, so a heartbeat costs
O(1) whatever the number of peers.

The rules (``docs/tracker.md``, "Collaborative steps", items 2 and 4):

* **Credit.** A peer is credited with what is plausible of the samples it claims for a step: no more than
  it could have computed since the step began for it (SAMPLES_SLACK × its rate × the seconds since, plus two
  micro-batches, over what it held then) and no more than its share cap; what the ledger allotted it for
  the step is always credited (an honest peer stops there). A claim for a step before the peer's is not
  credited at all: it was sent before the peer heard that a round moved it on.
* **Share cap.** While another peer computes for the step or holds samples of it, one peer is credited at
  most ``max_peer_share`` of the target: no peer closes a step alone or outweighs the rest of it. The
  identities of one address (:mod:`crowdtrain.tracker.origins`) share one cap while a peer from elsewhere
  takes part: a second identity buys no second cap.
* **Probation.** A peer that took part in fewer than PROBATION_STEPS rounds counts at no more than the median
  rate of the peers that did (its claim is believed only once there are none): a new identity claiming a huge
  rate from its first heartbeat is allotted and credited like a median peer until it has taken part.
* **Allotment.** What is left of the target (the samples no peer holds yet) is shared out by rate: a peer's
  fair share is what it holds plus ``left × its rate ÷ the rate of every peer that computes`` (an unknown
  rate counts as the mean), within what the others do not hold or were not allotted, never less than it
  holds. The allotments never sum above the target (but for spares), so a step closes on its target (or
  below it).
* **Ahead share** (delay 1). A peer may compute ahead for the next step its share of a step by rate among
  the peers that compute for the run (at the step, done with it, or at another step; an unknown rate at the
  mean, so room is left for peers that arrive). A ready call's samples ahead are credited up to that share
  or the step's weight, whichever is larger, and the share cap.
* **Late and spares** (backup workers): the rules and their constants are :mod:`crowdtrain.tracker.policy`'s;
  the ledger applies them to its shares (:meth:`overdue`, :meth:`open_spares`). The run revokes a late peer
  that is also silent (:func:`crowdtrain.tracker.collab.revoke_stragglers`); one revoked that holds nothing
  of the step and has not spoken since is written off: the round does not wait for its ready call. Spares
  put the allotments above the target; the step closes on whoever reaches it, and a covered peer that
  reports again is allotted what it holds. Nobody is left out for being covered: a frozen peer's ready call
  is gathered like anyone's at the close, and what it computed is dropped only if it does not answer.
* **A new step.** When a round forms, each averaged peer moves to the next step holding what it computed
  ahead. Then three passes allot it: a peer that computes ahead first gets what it may have computed since
  its ready call (within its ahead share), then every peer its share by rate of what is left, then what no
  share took goes to the first peers below their cap.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from crowdtrain.protocol.addresses import Origin
from crowdtrain.protocol.messages import RunSpec
from crowdtrain.tracker.origins import Origins
from crowdtrain.tracker.peers import Share
from crowdtrain.tracker.policy import Spares, late

log = logging.getLogger("crowdtrain.tracker")

# A peer's samples for a step may grow by SAMPLES_SLACK × its rate × the seconds since the step began for it
# (plus two micro-batches): room for a rate that rose since it reported it, not for a number out of thin air.
SAMPLES_SLACK = 4.0
# Sums of rates are kept by adding and subtracting each peer's rate, which leaves float dust (e.g. 2**-45)
# where the exact sum is 0: what is left of a step divided by it gave ETAs of 2**47 s. A sum of rates
# below RATE_DUST (samples per second: one sample in 11 days) is that dust, and counts as 0.
RATE_DUST = 1e-6
# A peer is on probation (its rate counts at most the established peers' median) until it took part in
# this many rounds.
PROBATION_STEPS = 3


def _settled(rate_sum: float) -> float:
    """A running sum of rates, its float dust (below :data:`RATE_DUST`) put back to 0."""
    return 0.0 if abs(rate_sum) < RATE_DUST else rate_sum


@dataclass(slots=True)
class Tally:
    """Sums over every share, for the run's global step; kept by the ledger alone."""

    samples: int = 0  # Σ samples of the peers at the step
    contributors: int = 0  # peers at the step holding samples of it
    rate_sum: float = 0.0  # Σ rate of every peer
    idle_rate: float = 0.0  # Σ rate of peers at the step that compute nothing for it (incl. done ones)
    done_rate: float = 0.0  # of those, the peers done with it (holding samples, computing the next ahead)
    done_rated: int = 0
    rated: int = 0  # peers computing (or on their way to the step) whose rate is known
    unrated: int = 0  # ... and those whose rate is not known yet
    reserved: int = 0  # Σ max(allotted, samples) of the peers at the step
    computing: int = 0  # peers at the step still computing for it
    present: int = 0  # peers at the step computing for it or holding samples of it

    def count(self, share: Share, at_step: bool, sign: int) -> None:
        """Add (``sign`` 1) or take away (-1) one share."""
        r = share.samples_per_s
        self.rate_sum = _settled(self.rate_sum + sign * r)
        if at_step and not share.computing:  # done, catching up or holding no chunk: computes no more for it
            self.idle_rate = _settled(self.idle_rate + sign * r)
            if share.samples > 0:  # done with it (delay 1: computing the next step ahead)
                self.done_rate = _settled(self.done_rate + sign * r)
                self.done_rated += sign * (r > 0)
        else:
            self.rated += sign * (r > 0)
            self.unrated += sign * (r <= 0)
        if at_step:
            self.computing += sign * share.computing
            self.present += sign * (share.computing or share.samples > 0)
            self.samples += sign * share.samples
            self.contributors += sign * (share.samples > 0)
            self.reserved += sign * max(share.allotted, share.samples)


class _Change:
    """:meth:`Ledger._changing`'s context (a class, not a generator: it runs several times per heartbeat)."""

    __slots__ = ("ledger", "share")

    def __init__(self, ledger: Ledger, share: Share) -> None:
        self.ledger = ledger
        self.share = share

    def __enter__(self) -> Share:
        self.ledger.tally.count(self.share, self.share.step == self.ledger.step, -1)
        return self.share

    def __exit__(self, *exc: object) -> None:
        self.ledger.tally.count(self.share, self.share.step == self.ledger.step, 1)


class Ledger:
    """The shares of one run's peers and the rules above. ``step`` is the run's global step."""

    def __init__(
        self,
        run_id: str,
        target: int,
        micro_batch_size: int,
        max_peer_share: float,
        *,
        step: int = 0,
        computes_ahead: bool = False,
        spares: bool = False,
    ) -> None:
        self.run_id = run_id  # (for the log)
        self.target = target
        self.micro_batch_size = micro_batch_size
        self.max_peer_share = max_peer_share
        self.computes_ahead = computes_ahead  # (delay 1) peers compute ahead, and are told how much they may
        self.step = step
        self.tally = Tally()
        self._shares: dict[str, Share] = {}
        # what ready calls of this step said was computed ahead for the next one (credited), and when
        self._ahead: dict[str, tuple[int, float]] = {}
        self._revoked: set[str] = set()  # revoked at the open step and silent since
        self.with_spares = spares  # the spares rule applies (delay 0, one inner step)
        self.spares = Spares()  # of the open step
        self.origins = Origins()  # where each peer's requests come from (identities per address)
        self._median_rate: float | None = None  # of the peers past probation, taken as each round forms

    @classmethod
    def of(cls, spec: RunSpec, step: int, inner_steps: int = 1) -> Ledger:
        return cls(
            spec.run_id,
            spec.target_batch_size * inner_steps,  # (local steps: an outer round's samples)
            spec.micro_batch_size,
            spec.averaging.max_peer_share,
            step=step,
            computes_ahead=spec.averaging.computes_ahead,
            spares=spec.averaging.spares,
        )

    def _changing(self, share: Share) -> _Change:
        """``with self._changing(share):`` takes the share out of the tally while it changes, and puts it
        back as it is then: the only way a share changes, so the tally is always the sum over them."""
        return _Change(self, share)

    # ------------------------------------------------------------ membership

    def add(self, peer_id: str, now: float, origin: Origin | None = None) -> Share:
        """A new share for ``peer_id`` (one it had before is dropped), counted at ``origin`` (None: this
        machine's own): at no step yet, computing."""
        self.remove(peer_id, forget_ahead=False)
        share = self._shares[peer_id] = Share(counted_at=now, peer_id=peer_id)
        self.tally.count(share, share.step == self.step, 1)
        self.origins.add(peer_id, origin)
        return share

    def remove(self, peer_id: str, *, forget_ahead: bool = True) -> None:
        share = self._shares.pop(peer_id, None)
        if share is not None:
            self.tally.count(share, share.step == self.step, -1)
        self.origins.remove(peer_id)
        self.spares.offered.pop(peer_id, None)  # (a spare offered to a peer gone is offered to nobody)
        self.spares.moved.pop(peer_id, None)
        self.spares.covered.discard(peer_id)
        if forget_ahead:
            self._ahead.pop(peer_id, None)

    def share(self, peer_id: str) -> Share | None:
        return self._shares.get(peer_id)

    def revoke(self, peer_id: str) -> int:
        """A straggler (silent while it owes samples of the open step) loses the part of its allotment it
        has not computed: it keeps what it holds, counts as computing nothing and at no rate until it
        reports again, and the rest is free for the others. Returns the samples freed (0: it owed none)."""
        share = self._shares[peer_id]
        owed = share.allotted - share.samples
        if share.step != self.step or not share.computing or owed <= 0:
            return 0
        with self._changing(share):
            share.allotted = share.samples
            share.computing = False
            share.samples_per_s = 0.0
        share.done_at = -1.0  # (not one of the peers done with the step: it stopped)
        self._revoked.add(peer_id)
        return owed

    def written_off(self, peer_id: str) -> bool:
        """Revoked at the open step, or its rest covered by spares, silent since, holding nothing of it: no
        round waits for its ready call (it would bring no samples)."""
        share = self._shares.get(peer_id)
        silent = peer_id in self._revoked or peer_id in self.spares.covered
        return silent and share is not None and share.samples == 0

    def open_spares(self, now: float) -> int:
        """Spares (the module docstring's rule): what the step lacks, once every peer that owes samples is
        behind its time, allotted to the peers done with the step, by rate; returns how many (0: none)."""
        if not self.with_spares:
            return 0
        at_step = [s for s in self._shares.values() if s.step == self.step]
        missing = self.target - self.tally.samples
        offered = self.spares.open(at_step, missing, now, self._room, self.micro_batch_size)
        return offered + self.spares.settle(self._shares, self.step, self._changing)  # (a shared rest)

    def in_flight(self, peer_id: str) -> bool:
        """Whether the peer may be computing a micro-batch of the open step: not if it last reported the
        allotment it had been told and was allotted no more (it stopped there), nor if spares covered it and
        it has been silent since."""
        share = self._shares.get(peer_id)
        return share is not None and not share.stopped and peer_id not in self.spares.covered

    @property
    def offered(self) -> int:
        """What a peer done with the open step may ask for: the free samples and the spares not taken."""
        return max(0, self.free) + sum(self.spares.offered.values()) + sum(self.spares.moved.values())

    def overdue(self, now: float) -> list[str]:
        """The peers late at the open step (:func:`crowdtrain.tracker.policy.late`)."""
        return late([s for s in self._shares.values() if s.step == self.step], now)

    def _mark_done(self, share: Share, now: float) -> None:
        """Note when a share reached its allotment of the open step (and forget it if it owes samples again)."""
        if share.step == self.step and 0 < share.allotted <= share.samples:
            if share.done_at < 0:
                share.done_at = now
        else:
            share.done_at = -1.0

    def recount(self) -> Tally:
        """The tally summed afresh over every share (what the kept one must equal)."""
        tally = Tally()
        for share in self._shares.values():
            tally.count(share, share.step == self.step, 1)
        return tally

    # ------------------------------------------------------------ what peers report

    def report(
        self,
        peer_id: str,
        *,
        step: int,
        samples: int,
        samples_per_s: float,
        computing: bool,
        now: float,
        step_open: bool,
    ) -> Share:
        """A heartbeat: credit its samples, take its rate, allot it its share of the step (none while the
        step is closed or the peer is at another one) and, with delay 1, what it may compute ahead."""
        share = self._shares[peer_id]
        told = share.allotted if share.step == step == self.step else 0
        if step < share.step == self.step and share.samples <= share.step_base:
            # a heartbeat of the step before, from a peer that has reported nothing of this one: it had not
            # begun this step when it sent it (its round was still under way, e.g. held by a member asleep),
            # so its time at this step runs from now, not from when the round formed (spares, the late rule)
            share.step_since = max(share.step_since, now)
        with self._changing(share):
            # A heartbeat for a step before the peer's (sent before it heard that a round moved it on,
            # answered after) says nothing of the step it is at: crediting it would move the peer back, free
            # its allotment for the others while it computes toward it, and overshoot the target; "not
            # computing" would close its new step early.
            samples_per_s = self._believed(share, samples_per_s)
            if step >= share.step:
                share.samples_per_s = max(share.samples_per_s, samples_per_s)  # the growth allowed since then
                self._credit(peer_id, share, step, samples, now)
                share.computing = computing
            share.samples_per_s = samples_per_s
            share.allotted = self._allot(share) if share.step == self.step and step_open else 0
        self._revoked.discard(peer_id)  # it spoke
        self.spares.covered.discard(peer_id)
        self.spares.moved.pop(peer_id, None)  # (told its part of a shared rest, if any)
        share.begun |= share.step == step
        share.stopped = 0 < told <= share.samples and share.allotted <= share.samples
        if step_open:
            self._mark_done(share, now)
        share.ahead_share = self._ahead_share(share) if self.computes_ahead else None
        return share

    def credit_ready(self, peer_id: str, step: int, weight: int, ahead: int, now: float) -> int:
        """The weight credited to a ready call for ``step``, as a heartbeat's samples would be (it counts
        for the step's samples too). Its samples computed ahead are kept for the next step (:meth:`advance`),
        no more than the weight or the peer's ahead share, whichever is larger, nor the share cap."""
        share = self._shares.get(peer_id)
        self._revoked.discard(peer_id)
        self.spares.covered.discard(peer_id)
        if share is None:
            self._ahead[peer_id] = (0, now)
            return 0
        if weight != share.samples or share.step != step:
            with self._changing(share):
                self._credit(peer_id, share, step, weight, now)
            weight = share.samples
        bound = max(weight, share.ahead_share or 0, 2 * self.micro_batch_size)
        self._ahead[peer_id] = (min(ahead, bound, self.share_cap(others=True)), now)
        return weight

    def reopen(self) -> None:
        """The step opens again (no round formed): what its ready calls said was computed ahead is void."""
        self._ahead = {}
        self._revoked = set()
        self.spares = Spares()

    # ------------------------------------------------------------ what peers are told

    def allotment(self, peer_id: str, step_open: bool) -> int | None:
        """A heartbeat reply's allotment: the peer's, while the step is open and it is at it."""
        share = self._shares[peer_id]
        return share.allotted if share.step == self.step and step_open else None

    def next_allotment(self, peer_id: str, step: int) -> int | None:
        """A ready reply's allotment of the step after ``step``, if the round of ``step`` moved it there."""
        share = self._shares.get(peer_id)
        fresh = share is not None and share.step == self.step == step + 1
        return share.allotted if share is not None and fresh else None

    @property
    def free(self) -> int:
        """Samples of the step's target that no peer at it holds or was allotted (while it is open)."""
        return self.target - self.tally.reserved

    def eta_s(self, step_open: bool) -> float | None:
        """Seconds until the step's target is reached at the run's rate (0 once closed; None: no rate)."""
        if not step_open:
            return 0.0
        if self.tally.rate_sum < RATE_DUST:
            return None
        return max(0.0, (self.target - self.tally.samples) / self.tally.rate_sum)

    def share_cap(self, others: bool) -> int:
        """The most samples one peer is credited for a step while ``others`` (another peer computes for the
        step or holds samples of it): ``max_peer_share`` of the target, so that no peer closes a step alone
        or outweighs the rest of a step when others take part."""
        if not others:
            return self.target
        return max(1, math.ceil(self.max_peer_share * self.target))

    def _room(self, share: Share) -> int:
        """The most ``share`` (out of the tally) may hold of the open step: the whole target while no peer
        from another address takes part in the step; else the share cap, less what the other identities
        of its address hold or were allotted of the step."""
        siblings = [
            s for p in self.origins.siblings(share.peer_id) if (s := self._shares[p]).step == self.step
        ]
        present = sum(1 for s in siblings if s.computing or s.samples > 0)
        if self.tally.present - present <= 0:
            return self.target
        return max(0, self.share_cap(others=True) - sum(max(s.allotted, s.samples) for s in siblings))

    def _believed(self, share: Share, claimed: float) -> float:
        """The rate a peer counts at: what it claims, at most the median of the peers past probation while
        it is on probation (PROBATION_STEPS)."""
        median = self._median_rate
        if share.rounds >= PROBATION_STEPS or median is None:
            return claimed
        return min(claimed, median)

    # ------------------------------------------------------------ the rules

    def _credit(self, peer_id: str, share: Share, step: int, claimed: int, now: float) -> None:
        """Credit the share with what is plausible of the ``claimed`` samples for ``step`` (and move it to
        that step). The share is out of the tally while this runs."""
        if share.step == step:
            held, base, since = share.samples, share.step_base, share.step_since
        else:  # a step new to it: begun at the latest when it last reported
            held, base, since = 0, 0, share.counted_at
        plausible = max(held, base + self._growth(share, now - since))
        cap = self._room(share) if step == self.step else self.target
        # what the ledger allotted it for this step stands (e.g. all of it while it was alone), so a
        # peer that kept to its allotment is never cut back when others arrive
        granted = share.allotted if share.step == step else 0
        credited = min(claimed, max(plausible, granted), max(cap, held, granted))
        if credited < claimed and not share.capped:
            share.capped = True
            log.info(
                "run %s: peer %s claimed %d samples of step %d; credited %d (rate %.3g/s, share cap %d)",
                self.run_id,
                peer_id,
                claimed,
                step,
                credited,
                share.samples_per_s,
                cap,
            )
        share.step, share.samples, share.step_base, share.step_since = step, credited, base, since
        share.counted_at = now

    def _growth(self, share: Share, seconds: float) -> int:
        """The most samples a peer is taken to compute in ``seconds``: SAMPLES_SLACK × its rate × the
        seconds, plus two micro-batches (one in flight, one begun), at most the target."""
        growth = SAMPLES_SLACK * share.samples_per_s * max(0.0, seconds) + 2 * self.micro_batch_size
        return math.ceil(min(growth, float(self.target)))

    def _allot(self, share: Share) -> int:
        """How many samples a peer may accumulate for the step (its share is out of the tally).

        Its fair share is what it holds plus ``left × its rate ÷ computing rate``, so the peers finish
        together even when they began the step with different samples in hand. It is allotted that, within
        what the others do not hold or were not allotted yet, and never less than it holds; a peer that
        reached its allotment while samples are still free gets its share of those."""
        if not share.computing:
            return share.samples
        trimmed = self.spares.trim(share.peer_id, share.samples)
        if trimmed is not None:  # (its rest was shared out: it stops where the others finish too)
            return trimmed
        t = self.tally
        free = self.target - t.reserved - share.samples
        if free <= 0:  # (spares: the allotments sum above the target; a peer given one keeps it)
            if share.samples < share.allotted:  # a covered peer stops at what it holds
                return share.allotted if share.peer_id in self.spares.given else share.samples
            spare = self.spares.take(share.peer_id)
            return share.samples + min(spare, max(0, self._room(share) - share.samples))
        r = share.samples_per_s
        rated, unrated = t.rated + (r > 0), t.unrated + (r <= 0)
        known = max(0.0, t.rate_sum - t.idle_rate) + max(r, 0.0)
        total = known * (1 + unrated / rated) if rated else 0.0  # an unknown rate counts as the mean
        part = r / total if r > 0 and total > 0 else 1 / max(1, rated + unrated)
        left = max(0, self.target - t.samples - share.samples)
        more = math.ceil(left * part)
        if share.samples >= share.allotted:  # at its allotment: a share of what is still free
            more = max(more, math.ceil(free * part))
        allotted = share.samples + min(free, max(more, share.allotted - share.samples, 0))
        return max(share.samples, min(allotted, self._room(share)))

    def _ahead_share(self, share: Share) -> int | None:
        """How many samples a peer may compute ahead for the next step (its share is in the tally); None
        while its own rate is unknown."""
        r = share.samples_per_s
        t = self.tally
        rated = t.rated + t.done_rated
        if r <= 0 or not rated:
            return None
        known = max(t.rate_sum - t.idle_rate + t.done_rate, r)
        part = r * rated / (known * (rated + t.unrated))  # an unknown rate counts as the mean
        return min(math.floor(self.target * part + 1e-9), self.share_cap(others=True))

    # ------------------------------------------------------------ a new step

    def advance(self, moved: list[str], now: float, target: int | None = None) -> None:
        """The round of the step formed: the run is at the next step (of ``target`` samples: a local round's
        H chosen anew; None: as before), and each of the ``moved`` peers (the averaged ones, in the round's
        order) is at it, computing, with what it computed ahead for it (delay 1; else nothing), and is
        allotted its share now, so the ready reply carries it and the peer computes on without waiting for a
        heartbeat's answer."""
        self.step += 1
        self.target = self.target if target is None else max(1, target)
        self.tally = self.recount()
        ahead, self._ahead, self._revoked = self._ahead, {}, set()
        self.spares = Spares()
        shares = [(peer_id, self._shares[peer_id]) for peer_id in moved]
        # those done with the step compute ahead (delay 1), up to their ahead share, until they hear of this
        # round: more than their ready call said, so their allotment holds that share (see _allot_ahead)
        done = {peer_id for peer_id, s in shares if not s.computing and s.samples > 0}
        shares.sort(key=lambda ps: ps[0] not in done)
        for peer_id, share in shares:
            with self._changing(share):
                share.step, share.computing, share.stopped, share.begun = self.step, True, False, False
                share.samples = min(ahead.get(peer_id, (0, now))[0], self.target)
                share.allotted = 0  # its allotment of the step before must not hold samples of this one
                share.step_base, share.step_since = share.samples, now
        # Allotted once all are at the new step, so each one's share (and cap) counts the others.
        self._allot_ahead([(s, ahead.get(p, (0, now))[1]) for p, s in shares if p in done], now)
        for _, share in shares:
            with self._changing(share):
                share.allotted = self._allot(share)
        self._allot_free([s for _, s in shares])
        for _, share in shares:
            share.done_at = -1.0
            self._mark_done(share, now)
            share.rounds += 1
        rates = sorted(
            s.samples_per_s
            for s in self._shares.values()
            if s.rounds >= PROBATION_STEPS and s.samples_per_s > 0
        )
        self._median_rate = rates[len(rates) // 2] if rates else None

    def _allot_ahead(self, computing_ahead: list[tuple[Share, float]], now: float) -> None:
        """A peer that computes ahead is allotted what it may have computed since its ready call (said at
        the time given with it; as a heartbeat's samples may grow, within the share it was told it may
        compute ahead), so samples it holds are never left out of the target."""
        for share, said_at in computing_ahead:
            if share.ahead_share is None:
                continue
            may_hold = share.samples + self._growth(share, now - said_at)
            with self._changing(share):
                free = max(0, self.target - self.tally.reserved - share.samples)
                share.allotted = max(share.samples, min(share.ahead_share, may_hold, share.samples + free))

    def _allot_free(self, shares: list[Share]) -> None:
        """What no share took (rounding, or the share cap of a peer whose rate share is above it) goes to
        the first peers below their cap: a peer done with its allotment asks for no more (delay 1)."""
        for share in shares:
            free = self.target - self.tally.reserved
            if free <= 0:
                break
            with self._changing(share):
                held = max(share.allotted, share.samples)
                share.allotted = max(held, min(held + free, self._room(share)))
