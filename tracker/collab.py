"""One run's live collaboration: its volunteers, the global step (DeDLOC), closing a step, forming its round.

The rules volunteers rely on:

* Each run has a durable ``global_step`` (starts at 0). Peers heartbeat ``(step, samples)``; the tracker
  sums the samples of online peers whose ``step == global_step``. How many samples each peer may compute
  for the step (its allotment), what it is credited with, and how many it may compute ahead are the share
  ledger's rules (:mod:`crowdtrain.tracker.ledger`).
* The step *closes* when that sum reaches ``target_batch_size``, or when ``averaging.step_timeout_s``
  passed since it opened and at least ``averaging.min_group_size`` peers reported samples > 0 — and only
  if some online peer is reachable (owns a part): a round without a part owner averages nothing. While no
  peer is reachable the step stays open, volunteers keep accumulating, and every heartbeat reply and the
  run's status carry :data:`NO_REACHABLE_PEER` as ``notice``. Heartbeat replies say ``step_closed=True``
  once it closed.
* ``GET /step?step=N`` (:meth:`RunState.wait_close`, a long-poll) answers as soon as step N closed or the
  run passed it, and as soon as samples of open step N were freed (a peer left, or stopped computing: no
  peer holds them or was allotted them) with how many are free, so a peer at its allotment heartbeats for
  a share of them then, instead of polling for one.
* Peers call ``ready(step=N, weight)`` (a long-poll; before the close it just waits). After the close
  the tracker gathers ready calls until every online peer at step N is ready or its wait passed
  (:func:`answer_wait`: ``averaging.gather_s`` until the tracker has timed its answers to closes, then
  ``answer_factor`` × its slowest recent answer, within [``answer_floor_s``, ``gather_s``]: tracker/policy.py) — plus, for a
  contributor still computing, the time of one of its micro-batches (``micro_batch_size /
  samples_per_s``), at most ``round_timeout_s``. A round is never formed from
  ready peers that all have weight 0: the tracker waits for the contributors still on their way (at most
  ``round_timeout_s`` after the close), then opens the step again. The history credits a step with the
  samples of the ready peers it averaged. It partitions the ready peers (:mod:`crowdtrain.tracker.matchmaking`), signs one
  :class:`GroupAssignment` per group (:mod:`crowdtrain.tracker.rounds`), answers every waiting call, records
  the step in the durable history and advances ``global_step`` to N + 1.
* A ready call for a step that already formed returns the same assignment to a member of it, and
  ``missed`` (with the current global step) to anyone else.
* If no ready peer owns a part when the round is formed (the reachable ones left or were not ready),
  nothing is formed: the step opens again, its ready callers get ``open`` and go on accumulating, and the
  global step does not advance.
* **A straggler never holds a step**: a peer at the open step that still owes samples of its
  allotment and has said nothing for the tracker's ``straggler_intervals`` heartbeat intervals (1.5), at least
  ``straggle_floor_s`` (tracker/policy.py) (a laptop asleep, a process frozen, a machine swapping; a live volunteer heartbeats
  every interval whatever it does) loses what it has not computed: it keeps the samples it reported, counts as
  computing nothing, and the rest is freed at once for the others (the step watches answer). At the close its
  ready call is gathered like anyone's (:func:`answer_wait`): a volunteer whose heartbeats were only late (an uplink
  full of its own all-reduce) still takes part. One asleep for longer hears, when it speaks again, that it
  missed the step, drops its work and catches up. The cost is the samples it computed since its last report.
  A *late* peer goes sooner (backup workers, :meth:`Ledger.overdue`): the others done and waiting half their
  step, it past 1.5 × its own expected time and silent POLICY.late_silent_s. Sooner still, *spares*
  (:meth:`Ledger.open_spares`, delay 0): once every peer that owes samples is behind its own time, what the
  step lacks is allotted to the peers done with it (the step watches answer ``free``; every volunteer
  reports at once, and a covered one that does is cut to what it holds), so the step closes on its target
  without the sleeper. A revoked or covered peer holding nothing of the step and silent since is not waited
  for at the close (``Ledger.written_off``); one holding samples is waited for as long as its answers take.
* Peers silent for ``peer_ttl_s`` expire.
* Who may serve the run's state, and which state newcomers fetch, is :mod:`crowdtrain.tracker.donors`'s:
  a peer vouches for the state of step N only if it took part in step N - 1 (or the state's hash was
  declared by one that did). The run's status says when the run has stepped but no online peer serves its
  state.

A heartbeat costs O(1) whatever the number of peers: the ledger keeps its sums incrementally.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable

from crowdtrain.protocol.addresses import Origin
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.messages import (
    DonorList,
    EvalReport,
    Heartbeat,
    HeartbeatReply,
    InnerSteps,
    ReadyReply,
    RunSpec,
    StateVersion,
    StepRecord,
    StepWatch,
)
from crowdtrain.tracker.cuts import Cuts
from crowdtrain.tracker.donors import Donors, StateRefused
from crowdtrain.tracker.horizon import Horizon
from crowdtrain.tracker.ledger import Ledger
from crowdtrain.tracker.matchmaking import Candidate, plan
from crowdtrain.tracker.peers import Peer, Share
from crowdtrain.tracker.policy import POLICY, Gathering, answer_wait, answered
from crowdtrain.tracker.rounds import Rounds, sign_round, step_record
from crowdtrain.tracker.spotchecks import SpotChecks
from crowdtrain.tracker.store import RunStore
from crowdtrain.tracker.verdicts import Verdicts

log = logging.getLogger("crowdtrain.tracker")
NO_REACHABLE_PEER = (
    "this run has no reachable volunteer (all are in client mode or the tracker cannot connect to them), "
    "so no averaging group can be formed: the step waits and every volunteer keeps its gradients; one "
    "volunteer whose peer-server port others can connect to lets the run step (README: Across machines)"
)

OnFormed = Callable[[StepRecord, list[int]], None]


class RunState:
    """One run's collaboration (the module docstring's rules). The tracker's routes call its methods."""

    def __init__(
        self,
        spec: RunSpec,
        global_step: int,
        store: RunStore,
        signer: SigningKey,
        *,
        quiet_s: float = 0.0,
        on_formed: Iterable[OnFormed] = (),
    ) -> None:
        self.spec = spec
        self.run_id = spec.run_id
        self.store = store
        self.signer = signer
        # (a local-steps round's inner steps, chosen anew each step with inner_steps = "auto")
        self.horizon = Horizon(spec.averaging, global_step, store.inner_steps(self.run_id))
        self.ledger = Ledger.of(spec, global_step, self.horizon.h)
        self.rounds = Rounds()
        self.cuts = Cuts(lambda owner, step: cut_asleep(self, owner, step))  # (tracker/cuts.py)
        self.checks = SpotChecks(spec, store)
        self.verdicts = Verdicts()  # (tracker/verdicts.py)
        self.state_donors = Donors(self.run_id, self.rounds)
        self.peers: dict[str, Peer] = {}
        self.opened_at = time.time()
        # A tracker restarted in the middle of a run knows none of its peers yet: it closes no step until
        # they had time to heartbeat again, or the first one back would be grouped alone and the others
        # would miss the step.
        self.quiet_until = self.opened_at + quiet_s
        self.closed_at: float | None = None
        self.ready: dict[str, int] = {}  # ready peers' credited weights
        self.gathering = Gathering()  # after the close: the peers whose ready call is awaited, until when
        self.changed = asyncio.Event()
        self.freed = 0  # how many times samples of the open step were freed (answers the step watches)
        self.reopened: set[str] = set()  # ready callers to answer "open" (no part owner was ready)
        self.notice: str | None = None  # a run-wide problem, in one sentence
        self.stopping = False
        self.closed: str | None = None  # closed by its admin: the sentence every further request gets
        self.closed_at_time: float | None = None
        self.on_formed: list[OnFormed] = list(on_formed)  # e.g. metrics

    @property
    def global_step(self) -> int:
        return self.ledger.step

    @property
    def target(self) -> int:
        return self.ledger.target

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

    def clear(self) -> None:
        """Forget every peer: the run was deleted (its volunteers are answered 410 and leave)."""
        for peer_id in list(self.peers):
            self.remove(peer_id)

    # ------------------------------------------------------------ membership

    def peer(self, peer_id: str) -> Peer | None:
        return self.peers.get(peer_id)

    def full(self, limit: int) -> bool:
        """Whether the run has ``limit`` peers (or more): it takes no more."""
        return len(self.peers) >= limit

    def join(self, peer_id: str, public_key: str, origin: Origin | None = None) -> Peer:
        now = time.monotonic()
        share = self.ledger.add(peer_id, now, origin)
        peer = Peer(peer_id=peer_id, public_key=public_key, share=share, last_seen=now)
        self.peers[peer_id] = peer
        return peer

    def member(self, peer_id: str, public_key: str, limit: int, origin: Origin | None = None) -> Peer | None:
        """The peer a signed request comes from; one the tracker does not know (after a restart or an
        expiry) is registered again by its credential, counted at ``origin``. None when it is not known and
        the run is full."""
        peer = self.peers.get(peer_id)
        if peer is None and not self.full(limit):
            peer = self.join(peer_id, public_key, origin)
            log.info("peer %s re-registered in run %s by its heartbeat", peer_id, self.run_id)
        return peer

    def remove(self, peer_id: str) -> bool:
        if self.peers.pop(peer_id, None) is None:
            return False
        free = self.ledger.offered
        self.ledger.remove(peer_id)
        self.freed_now(free)
        self.gathering.pending.discard(peer_id)
        self.ready.pop(peer_id, None)
        self.reopened.discard(peer_id)
        return True

    def leave(self, peer_id: str, kept: StateVersion | None = None) -> bool:
        """The peer leaves (False: it was not registered); a round waiting for it forms without it. The state
        it ``kept`` (in its data folder) is vouched for when it may vouch for it: it serves it when it joins
        again."""
        if peer_id in self.peers and kept is not None:
            self.state_donors.vouch(peer_id, kept, self.global_step)
        if not self.remove(peer_id):
            return False
        self.maybe_form(time.time())
        return True

    def expire(self, ttl_s: float) -> int:
        before = time.monotonic() - ttl_s
        stale = [p.peer_id for p in self.peers.values() if p.last_seen < before]
        for peer_id in stale:
            self.remove(peer_id)
        if stale:
            self.maybe_form(time.time())
        return len(stale)

    def heartbeat(self, peer: Peer, hb: Heartbeat) -> HeartbeatReply:
        """Take a heartbeat (its evaluation checked by :func:`eval_refusal` first) and answer it."""
        now = time.monotonic()
        free = self.ledger.offered
        share = self.ledger.report(
            peer.peer_id,
            step=hb.step,
            samples=hb.samples,
            samples_per_s=hb.samples_per_s,
            computing=hb.computing,
            now=now,
            step_open=self.closed_at is None,
        )
        computed = None if hb.compute_share is None else min(1.0, hb.compute_share)  # (a share: at most 1)
        peer.chunks_held, peer.loss, peer.compute_share = hb.chunks_held, hb.loss, computed
        peer.backbone, peer.upload_bps, peer.averaging_s = hb.backbone, hb.upload_bps, hb.averaging_s
        peer.last_seen = now
        self.freed_now(free)
        if self.closed_at is not None and share.step == self.global_step and peer.peer_id not in self.ready:
            self.gathering.pending.add(peer.peer_id)
        self.maybe_close(time.time())
        if hb.eval is not None and hb.eval.step > peer.evaluated:  # (a retried heartbeat: counted once)
            peer.evaluated = hb.eval.step
            self.store.add_eval(self.run_id, hb.eval)
        return _heartbeat_reply(self, peer, share)

    def freed_now(self, before: int) -> None:
        """More samples of the open step are offered (free, or spares not taken) than ``before`` (what was
        offered before the change): the step watches answer (wait_close). Only more: an offer left untaken
        (its peer asleep) must not wake every watch again at each heartbeat."""
        if self.closed_at is None and self.ledger.offered > max(before, 0):
            self.freed += 1
            self._wake()

    # ------------------------------------------------------------ closing a step

    def eta_s(self) -> float | None:
        return self.ledger.eta_s(step_open=self.closed_at is None)

    def tick(self, now: float) -> None:
        if self.closed is not None:  # closed by its admin: no step closes or forms any more
            return
        self.maybe_close(now)
        self.maybe_form(now)

    def maybe_close(self, now: float) -> None:
        if self.closed_at is not None or now < self.quiet_until:
            return
        tally, avg = self.ledger.tally, self.spec.averaging
        timed_out = now - self.opened_at >= avg.step_timeout_s
        # no peer at the step computes for it any more (each is done, e.g. computing the next step ahead
        # with delay 1, or has nothing to compute): what it holds is all the step will get
        idle = tally.computing == 0
        if tally.samples < self.target and not (
            (timed_out or idle) and tally.contributors >= avg.min_group_size
        ):
            return
        if not self._any_owner():
            return
        self.closed_at = now
        log.debug("run %s: step %d closed with %d samples", self.run_id, self.global_step, tally.samples)
        self._wake()
        # (the members of the last round were moved to this step as it formed: a peer still at the step
        # before took no part in that round, asleep or late; it can bring nothing to this one, and waiting
        # for it held the close after a sleeper's by its answer time, gather_s while never timed)
        pending = [
            p
            for p in self.peers.values()
            if p.share.step == self.global_step
            and p.peer_id not in self.ready
            and not self.ledger.written_off(p.peer_id)
        ]
        self.gathering.start(
            now, {p.peer_id for p in pending}, min(gather_wait(self, pending), avg.round_timeout_s)
        )
        self.maybe_form(now)

    def _any_owner(self) -> bool:
        """Whether an online peer at this step (or on its way to it) could own a part; sets the notice."""
        owners = checking = False
        for p in self.peers.values():
            if p.share.step not in (self.global_step, self.global_step - 1):
                continue
            if p.reach.owns_part:
                owners = True
                break
            checking |= p.reach.first_check  # its first check is under way
        self.notice = None if owners or checking else NO_REACHABLE_PEER
        return owners

    def maybe_form(self, now: float) -> None:
        if self.closed_at is None:
            return
        if self.gathering.waits(now):
            return
        if not any(w > 0 for pid, w in self.ready.items() if pid in self.peers):
            # nobody who computed anything is ready: a round now would step on nothing. Wait for the
            # contributors still on their way, for at most a round's timeout, then open the step again.
            contributors = any(
                self.peers[pid].share.samples > 0 and self.peers[pid].share.step == self.global_step
                for pid in self.gathering.pending
                if pid in self.peers
            )
            if contributors and now < self.closed_at + self.spec.averaging.round_timeout_s:
                return
            self._reopen()
            return
        self.form(now)

    def _reopen(self) -> None:
        """No ready peer owns a part: form nothing, keep the step open, tell the ready callers."""
        self.reopened |= set(self.ready)
        self.closed_at = None
        self.ready = {}
        self.ledger.reopen()
        self.gathering.clear()
        self._any_owner()
        self._wake()

    # ------------------------------------------------------------ forming its round

    def form(self, now: float) -> None:
        """Partition the ready peers of the closed step, sign their groups, record the step, advance the
        global step and allot the averaged peers their shares of the next one."""
        seed = secrets.randbits(63)
        candidates = [
            Candidate(pid, self.peers[pid].reach.owns_part, self.ready[pid])
            for pid in self.ready
            if pid in self.peers
        ]
        if not any(c.reachable for c in candidates):
            self._reopen()
            return
        phases = plan(candidates, self.spec.averaging.group_size, seed)
        step = self.global_step
        log.debug(
            "run %s: step %d forms its round on %s (not ready: %s)",
            self.run_id,
            step,
            self.ready,
            self.gathering.pending,
        )
        assignments = sign_round(
            self.signer, self.run_id, step, seed, candidates, phases, self.peers, self.spec.averaging, now
        )
        closed_at = self.closed_at if self.closed_at is not None else now
        record = step_record(
            step, candidates, phases[0], seed, self.peers, closed_at, now - self.opened_at, self.horizon.h
        )
        # (it advances the stored global step too, and credits each averaged identity: the credit ledger)
        credits = [(self.peers[c.peer_id].public_key, c.weight) for c in candidates]
        self.store.close_step(self.run_id, record, credits)
        self.rounds.add(step, assignments)
        self.checks.draw(step, assignments, self.peers, self.ledger.origins.by_peer)
        self._advance(candidates, now)
        for callback in self.on_formed:
            callback(record, [len(g.members) for g in phases[0]])
        self._wake()

    def _advance(self, candidates: list[Candidate], now: float) -> None:
        """The next step opens: nothing gathered for it yet; the averaged peers move to it and are allotted
        their shares (the ledger's re-allotment)."""
        self.opened_at = now
        self.closed_at = None
        self.ready = {}
        self.gathering.clear()
        self.reopened = set()
        self.notice = None
        members = [self.peers[c.peer_id] for c in candidates if c.weight > 0]
        h = self.horizon.advance(
            self.global_step + 1, self.spec.target_batch_size, self.ledger.tally.rate_sum, members
        )
        self.ledger.advance(
            [c.peer_id for c in candidates], time.monotonic(), self.spec.target_batch_size * h
        )

    # ------------------------------------------------------------ long-polls

    def _wake(self) -> None:
        """Answer every long-poll waiting on a change (a close, a formed or reopened round)."""
        self.changed.set()
        self.changed = asyncio.Event()

    def watch_answer(self, step: int, freed_seen: int) -> StepWatch | None:
        """What ``GET /step`` answers now, or None (wait for a change): ``step`` closed or passed, or samples
        of it were freed since the watch saw ``freed_seen`` (and are free still: ``free`` says how many)."""
        if self.global_step > step or (self.global_step == step and self.closed_at is not None):
            return self.watch_now()
        if self.freed != freed_seen and self.global_step == step and self.ledger.offered > 0:
            # (freed, or spares opened, and not taken yet)
            return StepWatch(global_step=self.global_step, step_closed=False, free=self.ledger.offered)
        return None

    def watch_now(self) -> StepWatch:
        return StepWatch(global_step=self.global_step, step_closed=self.closed_at is not None)

    def asked_ready(self, peer: Peer, step: int) -> None:
        """``peer`` asks ``POST /ready`` (of ``step``): seen, and its answer to a close timed."""
        peer.last_seen = time.monotonic()
        if step == self.global_step and self.closed_at is not None and peer.peer_id in self.gathering.pending:
            answered(peer, time.time() - self.closed_at, time.monotonic())

    def take_ready(self, peer_id: str, step: int, weight: int, ahead: int) -> ReadyReply | None:
        """A ready call of ``step`` (``ahead``: samples the peer already computed for the next step, delay 1,
        counted for it when this step's round forms), taken in: its answer, or None while it waits."""
        if self.stopping:
            return ReadyReply(status="wait", global_step=self.global_step, retry_after_s=1.0)
        if step == self.global_step and peer_id in self.reopened:
            self.reopened.discard(peer_id)
            return ReadyReply(status="open", global_step=self.global_step, retry_after_s=0.0)
        if step == self.global_step:
            first = not any(w > 0 for w in self.ready.values())
            self.ready[peer_id] = self.ledger.credit_ready(peer_id, step, weight, ahead, time.monotonic())
            self.gathering.pending.discard(peer_id)
            if first and self.ready[peer_id] > 0 and self.closed_at is not None:
                pending = [self.peers[p] for p in self.gathering.pending if p in self.peers]
                self.gathering.again(
                    time.time(), gather_wait(self, pending), self.spec.averaging.round_timeout_s
                )
            self.maybe_form(time.time())
        return self._formed_reply(peer_id, step) if step < self.global_step else None

    def ready_expired(self, peer_id: str, step: int) -> ReadyReply:
        """A ready call's long-poll ended unanswered: not listening any more, it is put in no group unless it
        asks again."""
        if step == self.global_step and self.closed_at is None:
            self.ready.pop(peer_id, None)
        return ReadyReply(status="wait", global_step=self.global_step, retry_after_s=0.0)

    def _formed_reply(self, peer_id: str, step: int) -> ReadyReply:
        """A ready call for a step that formed: its assignments to a member of it, "missed" to anyone else."""
        mine = self.rounds.of(step, peer_id)
        if not mine:
            return ReadyReply(status="missed", global_step=self.global_step)
        return ReadyReply(
            status="group",
            global_step=self.global_step,
            assignment=mine[0],
            later_phases=mine[1:],
            next_allotment=self.ledger.next_allotment(peer_id, step),
            spot_check=self.checks.of(step, peer_id),
            inner=self.inner(),
        )

    def inner(self) -> InnerSteps | None:
        """The open step's inner steps, told to its peers (local steps; None: every step averages)."""
        return self.horizon.inner if self.spec.averaging.local else None

    # ------------------------------------------------------------ state donors

    def declare_state(self, peer: Peer, versions: list[StateVersion]) -> None:
        """Record the snapshots ``peer`` serves, or raise :class:`StateRefused` saying why not."""
        if peer.reach.address is None:
            raise StateRefused(
                "only a peer with a reachable address can serve state; declare an address in heartbeats"
            )
        self.state_donors.declare(peer.peer_id, peer.offer, versions, self.global_step)
        peer.last_seen = time.monotonic()

    def donors(self, limit: int = 64, without: str | None = None) -> DonorList:
        """The state's donors (:meth:`StateDonors.listing`), not counting peer ``without``."""
        peers = (p for p in self.peers.values() if p.peer_id != without)
        return self.state_donors.listing(peers, self.global_step, limit)

    def state_notice(self) -> str | None:
        return self.state_donors.notice(self.peers.values(), self.global_step)

    # ------------------------------------------------------------ views

    def refusal(self) -> str | None:
        """The sentence a volunteer's request gets once its admin closed the run (None while it is open)."""
        return self.closed


def eval_refusal(run: RunState, report: EvalReport) -> str | None:
    """Why a held-out evaluation is refused (None: it is a report of a step the run has taken and its spec
    evaluates, with finite numbers)."""
    every = run.spec.eval.every
    if not every or report.step % every or not 0 < report.step <= run.global_step:
        return (
            f"an evaluation of step {report.step} is not one this run asks for (every {every} steps, "
            f"up to step {run.global_step})"
        )
    if not all(math.isfinite(v) for v in [report.loss, *report.metrics.values()]):
        return "an evaluation's loss and metrics must be finite numbers"
    return None


def gather_wait(run: RunState, pending: list[Peer]) -> float:
    """How long after its close ``run`` gathers ready calls: the longest :func:`answer_wait` of the pending
    peers. When spares last opened, every step watch answered and each live volunteer reported at once: a
    peer silent since has already let that much of its wait pass."""
    asked = run.ledger.spares.last
    unanswered = time.monotonic() - asked
    return max(
        (
            answer_wait(
                p,
                run.global_step,
                run.spec,
                run.ledger.in_flight(p.peer_id),
                unanswered if p.last_seen < asked else 0.0,
            )
            for p in pending
        ),
        default=0.0,
    )


def _heartbeat_reply(run: RunState, peer: Peer, share: Share) -> HeartbeatReply:
    """What a heartbeat is told: the run's step and progress, where the peer is reached, and its shares."""
    return HeartbeatReply(
        global_step=run.global_step,
        samples=run.ledger.tally.samples,
        target=run.target,
        peers_online=len(run.peers),
        samples_per_s=run.ledger.tally.rate_sum,
        eta_s=run.eta_s(),
        step_closed=run.closed_at is not None,
        reachable=peer.reach.reachable,
        address=peer.reach.address,
        checked=peer.reach.checked,
        bt_address=peer.reach.bt_address,
        bt_reachable=peer.reach.bt_reachable,
        notice=run.notice,
        allotment=run.ledger.allotment(peer.peer_id, step_open=run.closed_at is None),
        ahead_share=share.ahead_share,
        inner=run.inner(),
    )


def cut_asleep(run: RunState, owner: str, step: int) -> None:
    """The group cut ``owner`` from its round of ``step``: it was asleep. If that round moved it to the open
    step, what it was allotted of it is freed for the others now (it keeps what it holds; reporting again,
    it is allotted anew) instead of once it has been silent or late long enough."""
    if run.closed_at is not None or run.global_step != step + 1 or run.peer(owner) is None:
        return
    owed = _free_share(run, owner)
    if owed:
        log.info(
            "run %s: peer %s was cut from its round of step %d (asleep): its %d samples of step %d are freed",
            run.run_id,
            owner,
            step,
            owed,
            run.global_step,
        )
        run.maybe_close(time.time())


def _free_share(run: RunState, peer_id: str) -> int:
    """Revoke what ``peer_id`` owes of the open step and tell the step watches it is free; returns it."""
    free = run.ledger.offered
    owed = run.ledger.revoke(peer_id)
    if owed:
        run.freed_now(free)
    return owed


def revoke_stragglers(run: RunState, silent_s: float) -> list[str]:
    """Free the unfinished allotments of ``run``'s peers at the open step that have said nothing for
    ``silent_s``, or are late (:meth:`Ledger.overdue`) and silent for POLICY.late_silent_s (the module docstring's
    rule); returns their ids. (Beside :class:`RunState`: the tracker's upkeep calls it every ``straggle_check_s``.)"""
    if run.closed_at is not None or run.closed is not None:
        return []
    now = time.monotonic()
    if run.ledger.open_spares(now):  # the step watches answer: the peers done ask for them, the rest report
        spares = run.ledger.spares
        log.debug(
            "run %s: spares %s for the rest of %s; shared rest %s, trimmed to %s",
            run.run_id,
            spares.offered,
            spares.covered,
            spares.moved,
            spares.trimmed,
        )
        run.freed_now(0)  # (new offers, to other peers than the untaken ones: every watch answers)
    late = run.ledger.overdue(now)
    suspects = [p for p in run.peers.values() if p.last_seen < now - silent_s]
    suspects += [
        run.peers[i] for i in late if now - POLICY.late_silent_s > run.peers[i].last_seen >= now - silent_s
    ]
    revoked = []
    for peer in suspects:
        owed = _free_share(run, peer.peer_id)
        if owed:
            revoked.append(peer.peer_id)
            log.info(
                "run %s: peer %s %s, silent for %.1f s, owes %d samples of step %d: they are freed for the others",
                run.run_id,
                peer.peer_id,
                "is late" if peer.peer_id in late else "is silent",
                now - peer.last_seen,
                owed,
                run.global_step,
            )
    if revoked:
        run.maybe_close(time.time())
    return revoked
