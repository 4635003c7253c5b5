"""Who serves a run's state, by consensus rather than by claim: state declarations, vouching, the donor list.

* A peer vouches for (declares) the state of step N only if it took part in step N - 1, or if the state's
  content hash was declared by one that did: a volunteer that left and joins again serves the state it kept.
  Who took part is known for the steps :class:`crowdtrain.tracker.rounds.Rounds` still keeps.
* A declaration refused :data:`DONOR_STRIKES` times drops its peer from the donors for good.
* The donor list names the newest step at which one content hash is held by more reachable peers than any
  other hash of that step, and by at least :data:`MIN_BACKERS` of them (or by the only one serving state).
  Only peers that train (a weight in one of the newest formed steps) count toward that: a peer catching up
  serves an older state no one else holds, and must not hold the training peers' state back.
* The run's status says when the run has stepped but no online peer serves its state, or when the peers that
  serve it disagree so that none can be listed (:meth:`Donors.notice`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.protocol.messages import Donor, DonorList, StateVersion
from crowdtrain.tracker.peers import Offer, Peer
from crowdtrain.tracker.rounds import KEEP_FORMED_STEPS, Rounds

# A state is listed when MIN_BACKERS peers serve the same one (when that many serve any), and a peer whose
# declarations were refused DONOR_STRIKES times is no donor any more.
MIN_BACKERS = 2
DONOR_STRIKES = 3


class StateRefused(CrowdtrainError, ValueError):
    """A state declaration the tracker does not record (the message says why); ``status`` is the HTTP
    status to answer it with (403 once the peer is no donor any more)."""

    def __init__(self, message: str, status: int = 400) -> None:
        self.status = status
        super().__init__(message)


class Donors:
    """The state donors of one run: what each peer declared, and the hashes vouched for by the steps before."""

    def __init__(self, run_id: str, rounds: Rounds) -> None:
        self.run_id = run_id
        self.rounds = rounds  # who took part in the newest formed steps
        # content hashes of states declared by peers that took part in the step before, by step (the newest
        # KEEP_FORMED_STEPS): a peer that rejoins with the state it kept vouches for it by its hash
        self.vouched: OrderedDict[int, set[str]] = OrderedDict()

    def declare(self, peer_id: str, offer: Offer, versions: list[StateVersion], global_step: int) -> None:
        """Record the snapshots a peer serves (newest first), or raise :class:`StateRefused` saying why not.
        A peer vouches only for the state of a step the run reached, after a step it took part in (as far as
        the tracker still knows who took part: the last KEEP_FORMED_STEPS steps, since it started). A refusal
        counts against the peer; at DONOR_STRIKES it is dropped from the donors for good."""
        if offer.dropped:
            raise StateRefused(
                f"state declaration refused: peer {peer_id} is no longer a state donor of run {self.run_id}: "
                f"{offer.refused} of its state declarations were refused",
                403,
            )
        refusal = self._refusal(peer_id, versions, global_step)
        if refusal is not None:
            offer.refused += 1
            if offer.refused >= DONOR_STRIKES:
                offer.dropped = True
                offer.states = ()
                refusal += f"; {offer.refused} declarations refused, no longer a donor of this run"
            raise StateRefused(f"state declaration refused: {refusal}", 403 if offer.dropped else 400)
        offer.states = tuple(versions)
        for v in versions:
            if not self.rounds.knows(v.step - 1) or self.rounds.took_part(v.step - 1, peer_id):
                self._vouch(v)

    def vouch(self, peer_id: str, version: StateVersion, global_step: int) -> bool:
        """Vouch for the content hash of a state a leaving peer kept, under the rule of :meth:`declare`
        (False: the peer may not vouch for it). A peer that left and joins again under a new identity then
        serves the state it kept, though it took part in no step under that identity."""
        if self._refusal(peer_id, [version], global_step) is not None:
            return False
        self._vouch(version)
        return True

    def _vouch(self, version: StateVersion) -> None:
        self.vouched.setdefault(version.step, set()).add(version.content_hash)
        for step in sorted(self.vouched)[:-KEEP_FORMED_STEPS]:
            del self.vouched[step]

    def _refusal(self, peer_id: str, versions: list[StateVersion], global_step: int) -> str | None:
        for v in versions:
            if v.step > global_step:
                return f"state step {v.step} is beyond the run's step {global_step}"
            if (
                v.step > 0
                and self.rounds.knows(v.step - 1)
                and not self.rounds.took_part(v.step - 1, peer_id)
                and v.content_hash not in self.vouched.get(v.step, ())
            ):
                return (
                    f"peer {peer_id} took no part in step {v.step - 1}, so it cannot vouch for the "
                    f"state of step {v.step}"
                )
        return None

    def notice(self, peers: Iterable[Peer], global_step: int) -> str | None:
        """A sentence when the run has stepped but no online peer serves its state, nor took part in its
        last step: volunteers that join wait for one that kept the state, or a publisher's checkpoint; or
        when the peers serving state disagree on it (no state can be listed): they then wait too."""
        peers = list(peers)
        if global_step == 0:
            return None
        if any(p.offer.states for p in peers):
            listed = self.listing(peers, global_step)
            if listed.state is None and listed.serving >= MIN_BACKERS:
                return (
                    f"the {listed.serving} peers serving the run's state disagree on it (no step's snapshot "
                    f"is held alike by {MIN_BACKERS} of them, more often than any other): volunteers that join "
                    "or fell behind wait, computing nothing; honest volunteers hold the same bytes, so one of "
                    "them runs a faulty or modified client"
                )
            return None
        if any(self.rounds.took_part(global_step - 1, p.peer_id) for p in peers):
            return None
        return (
            f"no volunteer online serves the run's state of step {global_step}: volunteers that join wait, "
            "computing nothing, until one that kept it (in its data folder) joins again or the publisher "
            f"restores a checkpoint (crowdtrain join {self.run_id} --init-from FILE)"
        )

    def listing(self, peers: Iterable[Peer], global_step: int, limit: int = 64) -> DonorList:
        """Donors of the run's state, by consensus rather than by claim. Of the reachable peers serving
        states of steps the run reached, the tracker lists the newest step at which one content hash is held
        by more of them than any other hash of that step (a tie: it does not choose) and by at least
        MIN_BACKERS of them — or by the only one, when just one peer serves state. A newcomer fetches from
        all of the listed donors at once, and checks every range against the hash."""
        backers: dict[StateVersion, list[Peer]] = {}
        serving = training = 0
        for p in peers:
            if not p.offer.states or p.offer.dropped or not p.reach.owns_part:
                continue
            serving += 1
            training += self.rounds.contributed(p.peer_id) is not False
            for v in p.offer.states:
                if v.step <= global_step:
                    backers.setdefault(v, []).append(p)
        if not serving:
            return DonorList(state=None, donors=[])
        # Only peers that train count toward how many must agree: one catching up (or waiting) still serves
        # the older state it held, which no one else holds any more, and it must not hold the others' back
        # (the churn soak, bench/churn.py: the one training peer's state went unlisted for minutes beside a rejoined
        # peer's kept one). With no training peer among them (the run stalled) all of them count.
        serving = training or serving
        need = min(MIN_BACKERS, serving)
        by_step: dict[int, list[tuple[StateVersion, list[Peer]]]] = {}
        for version, held_by in backers.items():
            by_step.setdefault(version.step, []).append((version, held_by))
        for step in sorted(by_step, reverse=True):
            ranked = sorted(by_step[step], key=lambda vp: len(vp[1]), reverse=True)
            version, chosen = ranked[0]
            if len(chosen) < need or (len(ranked) > 1 and len(ranked[1][1]) == len(chosen)):
                continue
            others = sorted(
                {p.peer_id: p for held_by in backers.values() for p in held_by if p not in chosen}.values(),
                key=lambda p: max(v.step for v in p.offer.states),
                reverse=True,
            )
            return DonorList(
                state=version,
                donors=[_donor(p) for p in chosen[:limit]],
                serving=serving,
                peers=[_donor(p) for p in others[:limit]],
            )
        return DonorList(
            state=None,
            donors=[],
            serving=serving,
            reason=(
                f"the {serving} peers serving state agree on none yet (no step's snapshot is held by "
                f"{need} of them with no other content hash held as often; {_held(by_step)}); ask again "
                "after the next step"
            ),
        )


def _held(by_step: dict[int, list[tuple[StateVersion, list[Peer]]]], shown: int = 4) -> str:
    """What the newest ``shown`` steps' snapshots are held by, e.g. ``step 96: 1+1 peers, step 88: 1 peer``
    (``1+1``: two content hashes, one peer each): snapshots on different steps, or different bytes."""
    steps = sorted(by_step, reverse=True)[:shown]
    held = (
        f"step {s}: "
        + "+".join(str(len(held_by)) for _, held_by in by_step[s])
        + (" peers" if sum(len(held_by) for _, held_by in by_step[s]) > 1 else " peer")
        for s in steps
    )
    return "held: " + ", ".join(held) if steps else "no snapshot of a step the run reached"


def _donor(p: Peer) -> Donor:
    return Donor(peer_id=p.peer_id, address=p.reach.address or "", public_key=p.public_key)
