"""One run's live collaboration: its volunteers, the global step (DeDLOC), matchmaking, state donors.

The rules volunteers rely on:

* Each run has a durable ``global_step`` (starts at 0). Peers heartbeat ``(step, samples)``; the tracker
  sums the samples of online peers whose ``step == global_step``.
* The step *closes* when that sum reaches ``target_batch_size``, or when ``averaging.step_timeout_s``
  passed since it opened and at least ``averaging.min_group_size`` peers reported samples > 0 — and only
  if some online peer is reachable (owns a part): a round without a part owner averages nothing. While no
  peer is reachable the step stays open, volunteers keep accumulating, and every heartbeat reply and the
  run's status carry :data:`NO_REACHABLE_PEER` as ``notice``. Heartbeat replies say ``step_closed=True``
  once it closed.
* Peers call ``ready(step=N, weight)`` (a long-poll; before the close it just waits). After the close
  the tracker gathers ready calls until every online peer at step N is ready or ``averaging.gather_s``
  passed — plus, for a contributor still computing, the time of one of its micro-batches
  (``micro_batch_size / samples_per_s``), at most ``round_timeout_s``. A round is never formed from
  ready peers that all have weight 0: the tracker waits for the contributors still on their way (at most
  ``round_timeout_s`` after the close), then opens the step again. The history credits a step with the
  samples of the ready peers it averaged. It partitions the ready peers (:mod:`crowdtrain.tracker.matchmaking`), signs one
  :class:`GroupAssignment` per group, answers every waiting call, records the step in the durable
  history and advances ``global_step`` to N + 1.
* A ready call for a step that already formed returns the same assignment to a member of it, and
  ``missed`` (with the current global step) to anyone else.
* If no ready peer owns a part when the round is formed (the reachable ones left or were not ready),
  nothing is formed: the step opens again, its ready callers get ``open`` and go on accumulating, and the
  global step does not advance.
* Peers silent for ``peer_ttl_s`` expire.
* A peer vouches for (declares) the state of step N only if it took part in step N - 1, or if the state's
  content hash was declared by one that did: a volunteer that left and joins again serves the state it kept.
  The run's status says when the run has stepped but no online peer serves its state (:meth:`RunState.state_notice`).

Aggregates (samples toward the step, contributors, run-wide rate) are kept incrementally so a heartbeat
costs O(1) whatever the number of peers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from crowdtrain.protocol.aio import wait_at_most
from crowdtrain.protocol.credentials import SigningKey, sign_assignment
from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.protocol.messages import (
    Donor,
    DonorList,
    GroupAssignment,
    GroupMember,
    Heartbeat,
    PeerStatus,
    ReadyReply,
    RunSpec,
    StateVersion,
    StepRecord,
    StepWatch,
)
from crowdtrain.tracker.matchmaking import Candidate, plan
from crowdtrain.tracker.store import Store

log = logging.getLogger("crowdtrain.tracker")

# A state is listed when MIN_BACKERS peers serve the same one (when that many serve any), and a peer whose
# declarations were refused DONOR_STRIKES times is no donor any more.
MIN_BACKERS = 2
DONOR_STRIKES = 3
KEEP_FORMED_STEPS = 8  # assignments of this many past steps are kept to answer late ready calls
# A peer's samples for a step may grow by SAMPLES_SLACK × its rate × the seconds since the step began for it
# (plus two micro-batches): room for a rate that rose since it reported it, not for a number out of thin air.
SAMPLES_SLACK = 4.0
# Sums of rates are kept by adding and subtracting each peer's rate, which leaves float dust (e.g. 2**-45)
# where the exact sum is 0: what is left of a step divided by it gave ETAs of 2**47 s. A sum of rates
# below RATE_DUST (samples per second: one sample in 11 days) is that dust, and counts as 0.
RATE_DUST = 1e-6
NO_REACHABLE_PEER = (
    "this run has no reachable volunteer (all are in client mode or the tracker cannot connect to them), "
    "so no averaging group can be formed: the step waits and every volunteer keeps its gradients; one "
    "volunteer whose peer-server port others can connect to lets the run step (README: Across machines)"
)


def _settled(rate_sum: float) -> float:
    """A running sum of rates, its float dust (below :data:`RATE_DUST`) put back to 0."""
    return 0.0 if abs(rate_sum) < RATE_DUST else rate_sum


@dataclass(slots=True)
class Peer:
    peer_id: str
    public_key: str
    address: str | None  # declared "host:port", None for client mode
    reachable: bool = False  # the tracker reached ``address`` with GET /v1/ping
    checking: bool = False  # a reachability check is under way
    checks: int = 0  # reachability checks done for the current address
    checked_at: float = 0.0  # monotonic time of the last check
    checked: bool = False  # a check of the current address finished (``reachable`` is its answer)
    bt_address: str | None = None  # "host:port" of its BitTorrent session, as the tracker tries it
    bt_reachable: bool | None = None  # None: not checked yet
    bt_checking: bool = False
    bt_checked_at: float = 0.0
    computing: bool = True  # able to compute for the run (False: catching up, or no chunk yet)
    allotted: int = 0  # samples it may accumulate for ``step`` (its share of the target)
    step: int = -1
    samples: int = 0
    samples_per_s: float = 0.0
    chunks_held: int = 0
    loss: float | None = None
    compute_share: float | None = None  # as its last heartbeat said
    ahead_share: int | None = None  # delay 1: what its last heartbeat reply told it it may compute ahead
    capped: bool = False  # the tracker credited it less than it claimed once (logged once)
    last_seen: float = 0.0  # monotonic
    counted_at: float = 0.0  # monotonic time its samples were last credited (see RunState._credit)
    step_since: float = 0.0  # monotonic time its current step began for it, as far as the tracker knows
    step_base: int = 0  # the samples it held for the step then (computed ahead, with delay 1)
    states: tuple[StateVersion, ...] = ()  # the snapshots it declared it serves, newest first
    refused_states: int = 0  # its state declarations the tracker refused
    donor_dropped: bool = False  # refused DONOR_STRIKES times: never listed as a donor again
    evaluated: int = 0  # the newest step whose held-out evaluation it reported (one report per step)


class StateRefused(CrowdtrainError, ValueError):
    """A state declaration the tracker does not record (the message says why)."""


class RunState:
    def __init__(
        self, spec: RunSpec, global_step: int, store: Store, signer: SigningKey, *, quiet_s: float = 0.0
    ) -> None:
        self.spec = spec
        self.run_id = spec.run_id
        self.global_step = global_step
        self.store = store
        self.signer = signer
        self.peers: dict[str, Peer] = {}
        self.opened_at = time.time()
        # A tracker restarted in the middle of a run knows none of its peers yet: it closes no step until
        # they had time to heartbeat again, or the first one back would be grouped alone and the others
        # would miss the step.
        self.quiet_until = self.opened_at + quiet_s
        self.closed_at: float | None = None
        self.gather_until = 0.0  # after the close: how long ready calls are gathered
        self.step_samples = 0
        self.step_contributors = 0
        self.rate_sum = 0.0
        self.idle_rate = 0.0  # Σ rate of peers at this step that compute nothing for it (incl. done ones)
        # of those, the peers done with this step (holding samples of it, computing the next one ahead)
        self.done_rate = 0.0
        self.done_rated = 0
        # peers computing (or on their way to this step) whose rate is known, and those whose is not yet
        self.rated = 0
        self.unrated = 0
        # samples the peers at this step hold or were allotted: Σ max(allotted, samples); never above target
        self.reserved = 0
        self.computing = 0  # peers at this step still computing for it (a peer done with it says so)
        self.present = 0  # peers at this step computing for it or holding samples of it
        self.ready: dict[str, int] = {}
        # ready peers' samples already computed for the next step (delay 1), and when they said so
        self.ahead: dict[str, tuple[int, float]] = {}
        self.pending: set[str] = set()
        self.formed: OrderedDict[int, dict[str, list[GroupAssignment]]] = OrderedDict()  # phase by phase
        # content hashes of states declared by peers that took part in the step before, by step (the newest
        # KEEP_FORMED_STEPS): a peer that rejoins with the state it kept vouches for it by its hash
        self.vouched: OrderedDict[int, set[str]] = OrderedDict()
        self.changed = asyncio.Event()
        self.reopened: set[str] = set()  # ready callers to answer "open" (no part owner was ready)
        self.notice: str | None = None  # a run-wide problem, in one sentence
        self.stopping = False
        self.closed: str | None = None  # closed by its admin: the sentence every further request gets
        self.closed_at_time: float | None = None
        self.on_formed: list[Callable[[StepRecord, list[int]], None]] = []  # e.g. metrics

    def stop(self) -> None:
        """The tracker is shutting down: answer every waiting ready call with "wait" now."""
        self.stopping = True
        self.changed.set()

    def close(self, when: float) -> None:
        """Its admin closed the run: it takes no more steps; every volunteer request is answered 410 with
        :attr:`closed` (volunteers leave on it), reading its status, spec and history still works."""
        if self.closed is None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
            self.closed = f"run {self.run_id} was closed by its admin at {stamp}; it takes no more steps"
            self.closed_at_time = when
        self.stop()

    # ------------------------------------------------------------ aggregates

    def _unaccount(self, peer: Peer) -> None:
        self._count(peer, -1)

    def _account(self, peer: Peer) -> None:
        self._count(peer, 1)

    def _count(self, peer: Peer, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) one peer's share of the aggregates."""
        r = peer.samples_per_s
        self.rate_sum = _settled(self.rate_sum + sign * r)
        at_step = peer.step == self.global_step
        if at_step and not peer.computing:  # done, catching up or holding no chunk: computes no more for it
            self.idle_rate = _settled(self.idle_rate + sign * r)
            if peer.samples > 0:  # done with it (delay 1: computing the next step ahead)
                self.done_rate = _settled(self.done_rate + sign * r)
                self.done_rated += sign * (r > 0)
        else:
            self.rated += sign * (r > 0)
            self.unrated += sign * (r <= 0)
        if at_step:
            self.computing += sign * peer.computing
            self.present += sign * (peer.computing or peer.samples > 0)
            self.step_samples += sign * peer.samples
            self.step_contributors += sign * (peer.samples > 0)
            self.reserved += sign * max(peer.allotted, peer.samples)

    def share_cap(self, others: bool) -> int:
        """The most samples one peer is credited for a step while ``others`` (another peer computes for the
        step or holds samples of it): ``max_peer_share`` of the target, so that no peer closes a step alone
        or outweighs the rest of a step when others take part."""
        if not others:
            return self.target
        return max(1, math.ceil(self.spec.averaging.max_peer_share * self.target))

    def _credit(self, peer: Peer, step: int, claimed: int, now: float) -> None:
        """Credit ``peer`` with what is plausible of the ``claimed`` samples for ``step`` (and move it to
        that step): no more than it could have computed since the step began for it (SAMPLES_SLACK × its
        rate × the seconds since, plus two micro-batches, over what it held then), and no more than its
        share cap of a step; what the tracker allotted it for the step is always credited (an honest peer
        stops there). The peer is not accounted while this runs."""
        if peer.step == step:
            held, base, since = peer.samples, peer.step_base, peer.step_since
        else:  # a step new to it: begun at the latest when it last reported
            held, base, since = 0, 0, peer.counted_at
        plausible = max(held, base + self._growth(peer, now - since))
        cap = self.share_cap(others=step == self.global_step and self.present > 0)
        # what the tracker allotted it for this step stands (e.g. all of it while it was alone), so a
        # peer that kept to its allotment is never cut back when others arrive
        granted = peer.allotted if peer.step == step else 0
        credited = min(claimed, max(plausible, granted), max(cap, held, granted))
        if credited < claimed and not peer.capped:
            peer.capped = True
            log.info(
                "run %s: peer %s claimed %d samples of step %d; credited %d (rate %.3g/s, share cap %d)",
                self.run_id,
                peer.peer_id,
                claimed,
                step,
                credited,
                peer.samples_per_s,
                cap,
            )
        peer.step, peer.samples, peer.step_base, peer.step_since = step, credited, base, since
        peer.counted_at = now

    def _growth(self, peer: Peer, seconds: float) -> int:
        """The most samples ``peer`` is taken to compute in ``seconds``: SAMPLES_SLACK × its rate × the
        seconds, plus two micro-batches (one in flight, one begun), at most the target."""
        growth = SAMPLES_SLACK * peer.samples_per_s * max(0.0, seconds) + 2 * self.spec.micro_batch_size
        return math.ceil(min(growth, float(self.target)))

    def _credit_ready(self, peer_id: str, step: int, weight: int, ahead: int) -> tuple[int, int]:
        """The weight and computed-ahead samples credited to a ready call: the weight as a heartbeat's
        samples would be (it counts for the step's samples too), the samples ahead no more than the weight
        or the peer's share of a step by rate (what it is told it may compute ahead), nor the share cap."""
        peer = self.peers.get(peer_id)
        if peer is None:
            return 0, 0
        now = time.monotonic()
        if weight != peer.samples or peer.step != step:
            self._unaccount(peer)
            self._credit(peer, step, weight, now)
            weight = peer.samples
            self._account(peer)
        bound = max(weight, peer.ahead_share or 0, 2 * self.spec.micro_batch_size)
        return weight, min(ahead, bound, self.share_cap(others=True))

    def _allot(self, peer: Peer) -> int:
        """How many samples ``peer`` may accumulate for this step (it is not accounted while this runs).

        What is left of the target (the samples no peer holds yet) is shared out by rate: a peer's fair
        share is what it holds plus ``left × its rate ÷ computing_rate``, so the peers finish together even
        when they began the step with different samples in hand (computed ahead, with delay 1). It is
        allotted that, within what the others do not hold or were not allotted yet, and never less than it
        holds; a peer that reached its allotment while samples are still free gets its share of those. The
        allotments never sum above the target, so a step closes on exactly its target (or below it, on its
        timeout)."""
        if not peer.computing:
            return peer.samples
        free = self.target - self.reserved - peer.samples
        if free <= 0:
            return peer.samples
        r = peer.samples_per_s
        rated, unrated = self.rated + (r > 0), self.unrated + (r <= 0)
        known = max(0.0, self.rate_sum - self.idle_rate) + max(r, 0.0)
        total = known * (1 + unrated / rated) if rated else 0.0  # an unknown rate counts as the mean
        share = r / total if r > 0 and total > 0 else 1 / max(1, rated + unrated)
        left = max(0, self.target - self.step_samples - peer.samples)
        more = math.ceil(left * share)
        if peer.samples >= peer.allotted:  # at its allotment: a share of what is still free
            more = max(more, math.ceil(free * share))
        allotted = peer.samples + min(free, max(more, peer.allotted - peer.samples, 0))
        return max(peer.samples, min(allotted, self.share_cap(others=self.present > 0)))

    def ahead_share(self, peer: Peer) -> int | None:
        """How many samples ``peer`` may compute ahead for the next step (delay 1): its share of a step by
        rate among the peers that compute for the run (those still at this step, those done with it, those
        at another step), a peer of unknown rate counted at the mean, so room is left for peers that arrive.
        None while its own rate is unknown. ``peer`` is accounted."""
        r = peer.samples_per_s
        rated = self.rated + self.done_rated
        if r <= 0 or not rated:
            return None
        known = max(self.rate_sum - self.idle_rate + self.done_rate, r)
        share = r * rated / (known * (rated + self.unrated))  # an unknown rate counts as the mean
        return min(math.floor(self.target * share + 1e-9), self.share_cap(others=True))

    def _recount(self) -> None:
        self.step_samples = self.step_contributors = 0
        self.rate_sum = self.idle_rate = self.done_rate = 0.0
        self.done_rated = 0
        self.reserved = self.computing = self.present = 0
        self.rated = self.unrated = 0
        for peer in self.peers.values():
            self._account(peer)

    # ------------------------------------------------------------ membership

    def add(self, peer: Peer) -> None:
        old = self.peers.get(peer.peer_id)
        if old is not None:
            self._unaccount(old)
        peer.last_seen = peer.counted_at = time.monotonic()
        self.peers[peer.peer_id] = peer
        self._account(peer)

    def remove(self, peer_id: str) -> bool:
        peer = self.peers.pop(peer_id, None)
        if peer is None:
            return False
        self._unaccount(peer)
        self.pending.discard(peer_id)
        self.ready.pop(peer_id, None)
        self.ahead.pop(peer_id, None)
        self.reopened.discard(peer_id)
        return True

    def expire(self, ttl_s: float) -> int:
        before = time.monotonic() - ttl_s
        stale = [p.peer_id for p in self.peers.values() if p.last_seen < before]
        for peer_id in stale:
            self.remove(peer_id)
        if stale:
            self.maybe_form(time.time())
        return len(stale)

    def heartbeat(self, peer: Peer, hb: Heartbeat) -> None:
        self._unaccount(peer)
        now = time.monotonic()
        # A heartbeat for a step before the peer's (sent before it heard that a round moved it on, answered
        # after) says nothing of the step it is at: crediting it would move the peer back, free its allotment
        # for the others while it computes toward it, and overshoot the target; "not computing" would
        # close its new step early.
        if hb.step >= peer.step:
            peer.samples_per_s = max(peer.samples_per_s, hb.samples_per_s)  # the growth allowed since then
            self._credit(peer, hb.step, hb.samples, now)
            peer.computing = hb.computing
        peer.samples_per_s = hb.samples_per_s
        peer.chunks_held = hb.chunks_held
        peer.loss = hb.loss
        peer.compute_share = hb.compute_share
        peer.last_seen = time.monotonic()
        if peer.step != self.global_step or self.closed_at is not None:
            peer.allotted = 0
        else:
            peer.allotted = self._allot(peer)
        self._account(peer)
        peer.ahead_share = self.ahead_share(peer) if self.spec.averaging.delay else None
        if self.closed_at is not None and peer.step == self.global_step and peer.peer_id not in self.ready:
            self.pending.add(peer.peer_id)
        self.maybe_close(time.time())

    # ------------------------------------------------------------ progress

    @property
    def target(self) -> int:
        return self.spec.target_batch_size

    def eta_s(self) -> float | None:
        if self.closed_at is not None:
            return 0.0
        if self.rate_sum < RATE_DUST:
            return None
        return max(0.0, (self.target - self.step_samples) / self.rate_sum)

    def maybe_close(self, now: float) -> None:
        if self.closed_at is not None or now < self.quiet_until:
            return
        timed_out = now - self.opened_at >= self.spec.averaging.step_timeout_s
        # no peer at the step computes for it any more (each is done, e.g. computing the next step ahead
        # with delay 1, or has nothing to compute): what it holds is all the step will get
        idle = self.computing == 0
        if self.step_samples >= self.target or (
            (timed_out or idle) and self.step_contributors >= self.spec.averaging.min_group_size
        ):
            if not self._any_owner():
                return
            self.closed_at = now
            self._wake()
            pending = [
                p
                for p in self.peers.values()
                # peers of the previous step are on their way here (their heartbeat may lag the step)
                if p.step in (self.global_step, self.global_step - 1) and p.peer_id not in self.ready
            ]
            self.pending = {p.peer_id for p in pending}
            # a contributor says "ready" once its micro-batch in flight is done: wait that long for it
            avg = self.spec.averaging
            slowest = max(
                (
                    self.spec.micro_batch_size / p.samples_per_s
                    for p in pending
                    if p.step == self.global_step and p.samples > 0 and p.samples_per_s > 0
                ),
                default=0.0,
            )
            self.gather_until = now + min(avg.gather_s + slowest, avg.round_timeout_s)
            self.maybe_form(now)

    def _any_owner(self) -> bool:
        """Whether an online peer at this step (or on its way to it) could own a part; sets the notice."""
        owners = checking = False
        for p in self.peers.values():
            if p.step not in (self.global_step, self.global_step - 1):
                continue
            if self._owns_part(p.peer_id):
                owners = True
                break
            checking |= p.address is not None and not p.checked  # its first check is under way
        self.notice = None if owners or checking else NO_REACHABLE_PEER
        return owners

    def maybe_form(self, now: float) -> None:
        if self.closed_at is None:
            return
        if self.pending and now < self.gather_until:
            return
        if not any(w > 0 for pid, w in self.ready.items() if pid in self.peers):
            # nobody who computed anything is ready: a round now would step on nothing. Wait for the
            # contributors still on their way, for at most a round's timeout, then open the step again.
            contributors = any(
                self.peers[pid].samples > 0 and self.peers[pid].step == self.global_step
                for pid in self.pending
                if pid in self.peers
            )
            if contributors and now < self.closed_at + self.spec.averaging.round_timeout_s:
                return
            self._reopen()
            return
        self.form(now)

    def _mean_loss(self, candidates: list[Candidate]) -> float | None:
        """The averaged peers' last reported training loss, weighted by their samples in the step."""
        pairs = [(c.weight, self.peers[c.peer_id].loss) for c in candidates if c.weight > 0]
        pairs = [(w, loss) for w, loss in pairs if loss is not None]
        total = sum(w for w, _ in pairs)
        return sum(w * loss for w, loss in pairs) / total if total else None

    def tick(self, now: float) -> None:
        if self.closed is not None:  # closed by its admin: no step closes or forms any more
            return
        self.maybe_close(now)
        self.maybe_form(now)

    def form(self, now: float) -> None:
        """Partition the ready peers of the closed step, sign their groups, advance the global step."""
        step = self.global_step
        avg = self.spec.averaging
        seed = secrets.randbits(63)
        candidates = [
            Candidate(pid, self._owns_part(pid), self.ready[pid]) for pid in self.ready if pid in self.peers
        ]
        if not any(c.reachable for c in candidates):
            self._reopen()
            return
        phases = plan(candidates, avg.group_size, seed)
        average_params = avg.average_state_every > 0 and (step + 1) % avg.average_state_every == 0
        step_samples = sum(c.weight for c in candidates)
        assignments: dict[str, list[GroupAssignment]] = {c.peer_id: [] for c in candidates}
        for phase, groups in enumerate(phases):
            deadline = now + avg.round_timeout_s * (phase + 1)  # phase by phase, each its own timeout
            for index, group in enumerate(groups):
                part_of = {pid: i for i, pid in enumerate(group.owners)}
                members = [
                    GroupMember(
                        peer_id=pid,
                        address=self.peers[pid].address if pid in part_of else None,
                        public_key=self.peers[pid].public_key,
                        weight=weight,
                        part=part_of.get(pid, -1),
                    )
                    for pid, weight in zip(group.members, group.weights, strict=True)
                ]
                assignment = sign_assignment(
                    self.signer,
                    GroupAssignment(
                        run_id=self.run_id,
                        round_id=f"{self.run_id}.{step}.{phase}.{index}.{seed:016x}",
                        step=step,
                        members=members,
                        parts=len(group.owners),
                        average_params=average_params,
                        deadline=deadline,
                        seed=seed,
                        phase=phase,
                        phases=len(phases),
                        step_samples=step_samples,
                        signature="",
                    ),
                )
                for pid in group.members:
                    assignments[pid].append(assignment)
        groups = phases[0]
        record = StepRecord(
            step=step,
            closed_at=self.closed_at if self.closed_at is not None else now,
            duration_s=max(0.0, now - self.opened_at),
            samples=step_samples,  # credited: the samples that were averaged
            peers=len(candidates),
            groups=len(groups),
            seed=seed,
            loss=self._mean_loss(candidates),
        )
        self.store.close_step(self.run_id, record)
        self.formed[step] = assignments
        while len(self.formed) > KEEP_FORMED_STEPS:
            self.formed.popitem(last=False)
        self.global_step = step + 1
        self.opened_at = now
        self.closed_at = None
        self.ready = {}
        self.pending = set()
        self.reopened = set()
        self.notice = None
        self._recount()
        # Each averaged peer moves to the new step, computing, with what it computed ahead for it (delay 1;
        # else nothing): allot its share now, so the ready reply carries it and the peer computes on
        # without waiting for a heartbeat's answer.
        ahead, self.ahead = self.ahead, {}
        moved = [self.peers[c.peer_id] for c in candidates]
        # those done with the step compute ahead (delay 1), up to their share of a step, until they hear of
        # this round: more than their ready call said, so their allotment holds that share (see below)
        done = {p.peer_id for p in moved if not p.computing and p.samples > 0}
        moved.sort(key=lambda p: p.peer_id not in done)
        began = time.monotonic()
        for peer in moved:
            self._unaccount(peer)
            peer.step, peer.samples, peer.computing, peer.allotted = (
                step + 1,
                min(ahead.get(peer.peer_id, (0, began))[0], self.target),
                True,
                0,  # its allotment of the step before must not hold samples of this one
            )
            peer.step_base, peer.step_since = peer.samples, began
            self._account(peer)
        # Allotted once all are at the new step, so each one's share (and cap) counts the others. First, a
        # peer that computes ahead is allotted what it may have computed since its ready call (as a
        # heartbeat's samples may grow, within the share it was told it may compute ahead), so samples it
        # holds are never left out of the target; then every peer gets its share by rate of what is left
        # on top of what it holds.
        for peer in moved:
            if peer.peer_id in done and peer.ahead_share is not None:
                said_at = ahead.get(peer.peer_id, (0, began))[1]
                may_hold = peer.samples + self._growth(peer, began - said_at)
                self._unaccount(peer)
                free = max(0, self.target - self.reserved - peer.samples)
                peer.allotted = max(peer.samples, min(peer.ahead_share, may_hold, peer.samples + free))
                self._account(peer)
        for peer in moved:
            self._unaccount(peer)
            peer.allotted = self._allot(peer)
            self._account(peer)
        # what no share took (rounding, or the share cap of a peer whose rate share is above it) goes to
        # the first peers below their cap: a peer done with its allotment asks for no more (delay 1)
        for peer in moved:
            free = self.target - self.reserved
            if free <= 0:
                break
            self._unaccount(peer)
            held = max(peer.allotted, peer.samples)
            peer.allotted = max(held, min(held + free, self.share_cap(others=self.present > 0)))
            self._account(peer)
        for callback in self.on_formed:
            callback(record, [len(g.members) for g in groups])
        self._wake()

    def _wake(self) -> None:
        """Answer every long-poll waiting on a change (a close, a formed or reopened round)."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_close(self, step: int, long_poll_s: float) -> StepWatch:
        """The long-poll behind ``GET /step``: returns once ``step`` closed or passed, or after ``long_poll_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + long_poll_s
        while not self.stopping:
            if self.global_step > step or (self.global_step == step and self.closed_at is not None):
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            await wait_at_most(self.changed, remaining)
        return StepWatch(global_step=self.global_step, step_closed=self.closed_at is not None)

    def _reopen(self) -> None:
        """No ready peer owns a part: form nothing, keep the step open, tell the ready callers."""
        self.reopened |= set(self.ready)
        self.closed_at = None
        self.ready = {}
        self.ahead = {}
        self.pending = set()
        self._any_owner()
        self._wake()

    def _owns_part(self, peer_id: str) -> bool:
        peer = self.peers[peer_id]
        return peer.reachable and peer.address is not None

    async def wait_ready(
        self, peer_id: str, step: int, weight: int, long_poll_s: float, ahead: int = 0
    ) -> ReadyReply:
        """The long-poll behind ``POST /ready``; bounded by ``long_poll_s``. ``ahead``: samples the peer
        already computed for the next step (delay 1), counted for it when this step's round forms."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + long_poll_s
        while True:
            if self.stopping:
                return ReadyReply(status="wait", global_step=self.global_step, retry_after_s=1.0)
            if step == self.global_step and peer_id in self.reopened:
                self.reopened.discard(peer_id)
                return ReadyReply(status="open", global_step=self.global_step, retry_after_s=0.0)
            if step < self.global_step:
                mine = self.formed.get(step, {}).get(peer_id)
                if mine:
                    peer = self.peers.get(peer_id)
                    fresh = peer is not None and peer.step == self.global_step == step + 1
                    return ReadyReply(
                        status="group",
                        global_step=self.global_step,
                        assignment=mine[0],
                        later_phases=mine[1:],
                        next_allotment=peer.allotted if fresh else None,
                    )
                return ReadyReply(status="missed", global_step=self.global_step)
            if step == self.global_step:
                weight, ahead = self._credit_ready(peer_id, step, weight, ahead)
                self.ready[peer_id] = weight
                self.ahead[peer_id] = (ahead, time.monotonic())
                self.pending.discard(peer_id)
                self.maybe_form(time.time())
                if step < self.global_step:
                    continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                if step == self.global_step and self.closed_at is None:
                    # not listening any more: do not put it in a group unless it asks again
                    self.ready.pop(peer_id, None)
                return ReadyReply(status="wait", global_step=self.global_step, retry_after_s=0.0)
            changed = self.changed
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                pass

    # ------------------------------------------------------------ views

    def peer_statuses(self, limit: int = 100) -> list[PeerStatus]:
        peers = sorted(self.peers.values(), key=lambda p: p.samples_per_s, reverse=True)[:limit]
        return [
            PeerStatus(
                peer_id=p.peer_id,
                step=p.step,
                samples=p.samples,
                samples_per_s=p.samples_per_s,
                client_mode=not self._owns_part(p.peer_id),
                chunks_held=p.chunks_held,
                loss=p.loss,
                address=p.address,
                reachable=p.reachable,
                bt_reachable=p.bt_reachable,
                compute_share=p.compute_share,
            )
            for p in peers
        ]

    def declare_state(self, peer: Peer, versions: list[StateVersion]) -> None:
        """Record the snapshots ``peer`` serves (newest first), or raise :class:`StateRefused` saying why
        not. A peer vouches only for the state of a step the run reached, after a step it took part in (as
        far as the tracker still knows who took part: the last KEEP_FORMED_STEPS steps, since it started).
        A refusal counts against the peer; at DONOR_STRIKES it is dropped from the donors for good."""
        if peer.donor_dropped:
            raise StateRefused(
                f"peer {peer.peer_id} is no longer a state donor of run {self.run_id}: "
                f"{peer.refused_states} of its state declarations were refused"
            )
        refusal = None
        for v in versions:
            if v.step > self.global_step:
                refusal = f"state step {v.step} is beyond the run's step {self.global_step}"
            elif (
                v.step > 0
                and v.step - 1 in self.formed
                and peer.peer_id not in self.formed[v.step - 1]
                and v.content_hash not in self.vouched.get(v.step, ())
            ):
                refusal = (
                    f"peer {peer.peer_id} took no part in step {v.step - 1}, so it cannot vouch for the "
                    f"state of step {v.step}"
                )
            if refusal is not None:
                break
        if refusal is not None:
            peer.refused_states += 1
            if peer.refused_states >= DONOR_STRIKES:
                peer.donor_dropped = True
                peer.states = ()
                refusal += f"; {peer.refused_states} declarations refused, no longer a donor of this run"
            raise StateRefused(refusal)
        peer.states = tuple(versions)
        for v in versions:
            if v.step - 1 not in self.formed or peer.peer_id in self.formed[v.step - 1]:
                self.vouched.setdefault(v.step, set()).add(v.content_hash)
        for step in sorted(self.vouched)[:-KEEP_FORMED_STEPS]:
            del self.vouched[step]

    def state_notice(self) -> str | None:
        """A sentence when the run has stepped but no online peer serves its state, nor took part in its
        last step: volunteers that join wait for one that kept the state, or a publisher's checkpoint."""
        if self.global_step == 0 or any(p.states for p in self.peers.values()):
            return None
        last = self.formed.get(self.global_step - 1, {})
        if any(p.peer_id in last for p in self.peers.values()):
            return None
        return (
            f"no volunteer online serves the run's state of step {self.global_step}: volunteers that join wait, "
            "computing nothing, until one that kept it (in its data folder) joins again or the publisher "
            f"restores a checkpoint (crowdtrain join {self.run_id} --init-from FILE)"
        )

    def donors(self, limit: int = 64) -> DonorList:
        """Donors of the run's state, by consensus rather than by claim. Of the reachable peers serving
        states of steps the run reached, the tracker lists the newest step at which one content hash is held
        by more of them than any other hash of that step (a tie: it does not choose) and by at least
        MIN_BACKERS of them — or by the only one, when just one peer serves state. A newcomer fetches from
        all of the listed donors at once, and checks every range against the hash."""
        backers: dict[StateVersion, list[Peer]] = {}
        serving = 0
        for p in self.peers.values():
            if not p.states or p.donor_dropped or not self._owns_part(p.peer_id):
                continue
            serving += 1
            for v in p.states:
                if v.step <= self.global_step:
                    backers.setdefault(v, []).append(p)
        if not serving:
            return DonorList(state=None, donors=[])
        need = min(MIN_BACKERS, serving)
        by_step: dict[int, list[tuple[StateVersion, list[Peer]]]] = {}
        for version, held_by in backers.items():
            by_step.setdefault(version.step, []).append((version, held_by))
        for step in sorted(by_step, reverse=True):
            ranked = sorted(by_step[step], key=lambda vp: len(vp[1]), reverse=True)
            version, chosen = ranked[0]
            if len(chosen) < need or (len(ranked) > 1 and len(ranked[1][1]) == len(chosen)):
                continue
            return DonorList(
                state=version,
                donors=[
                    Donor(peer_id=p.peer_id, address=p.address or "", public_key=p.public_key)
                    for p in chosen[:limit]
                ],
                serving=serving,
            )
        return DonorList(
            state=None,
            donors=[],
            serving=serving,
            reason=(
                f"the {serving} peers serving state agree on none yet (no step's snapshot is held by "
                f"{need} of them with no other content hash held as often); ask again after the next step"
            ),
        )
