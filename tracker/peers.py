"""The records of a run's peers, at the bottom of ``tracker/`` (they import nothing of it): one
:class:`Peer` per volunteer, each of its sub-records written by one part alone: :class:`Share` by the ledger
(:mod:`crowdtrain.tracker.ledger`), :class:`Reach` by the reachability checker (:mod:`crowdtrain.tracker.reach`),
:class:`Offer` by the state donors (:mod:`crowdtrain.tracker.donors`); the run (:mod:`crowdtrain.tracker.collab`)
writes the rest from the peer's heartbeats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crowdtrain.protocol.messages import PeerStatus, StateVersion


@dataclass(slots=True)
class Share:
    """One peer's part of the run's steps, as the ledger keeps it (read by the run, written by the ledger)."""

    step: int = -1  # the step it is at, as far as the tracker knows
    samples: int = 0  # credited for ``step``
    samples_per_s: float = 0.0
    computing: bool = True  # able to compute for the run (False: done, catching up, or no chunk yet)
    allotted: int = 0  # samples it may accumulate for ``step`` (its share of the target)
    ahead_share: int | None = None  # delay 1: what its last heartbeat reply told it it may compute ahead
    capped: bool = False  # credited less than it claimed once (logged once)
    counted_at: float = 0.0  # when its samples were last credited
    step_since: float = 0.0  # when its current step began for it, as far as the tracker knows
    step_base: int = 0  # the samples it held for the step then (computed ahead, with delay 1)
    done_at: float = -1.0  # when it reached its allotment of ``step`` (monotonic); -1: it owes samples
    peer_id: str = ""
    rounds: int = 0  # rounds it took part in (PROBATION_STEPS)
    stopped: bool = False  # its last report reached the allotment it had been told, and it got no more
    begun: bool = False  # it reported at its step since a round moved it there (it began computing it)


@dataclass(slots=True)
class Reach:
    """What the tracker knows of where one peer is reached; a :class:`Checker` alone writes it."""

    address: str | None = None  # declared "host:port", None for client mode
    reachable: bool = False  # the tracker reached ``address`` with GET /v1/ping
    checking: bool = False  # a reachability check is under way
    checks: int = 0  # reachability checks done for the current address
    checked_at: float = 0.0  # monotonic time of the last check
    checked: bool = False  # a check of the current address finished (``reachable`` is its answer)
    bt_address: str | None = None  # "host:port" of its BitTorrent session, as the tracker tries it
    bt_reachable: bool | None = None  # None: not checked yet
    bt_checking: bool = False
    bt_checked_at: float = 0.0

    @property
    def owns_part(self) -> bool:
        """Whether the peer may own an all-reduce part: its declared address answered."""
        return self.reachable and self.address is not None

    @property
    def first_check(self) -> bool:
        """Whether the first check of its declared address is still under way."""
        return self.address is not None and not self.checked


@dataclass(slots=True)
class Offer:
    """The states one peer serves, as :class:`Donors` recorded them (only it writes this)."""

    states: tuple[StateVersion, ...] = ()  # the snapshots it declared it serves, newest first
    refused: int = 0  # its state declarations the tracker refused
    dropped: bool = False  # refused DONOR_STRIKES times: never listed as a donor again


@dataclass(slots=True)
class Peer:
    """One volunteer of a run. Each sub-record has one writer: ``share`` the ledger
    (:mod:`crowdtrain.tracker.ledger`), ``reach`` the reachability checker (:mod:`crowdtrain.tracker.reach`),
    ``offer`` the state donors (:mod:`crowdtrain.tracker.donors`)."""

    peer_id: str
    public_key: str
    share: Share
    reach: Reach = field(default_factory=Reach)
    offer: Offer = field(default_factory=Offer)
    chunks_held: int = 0
    loss: float | None = None
    compute_share: float | None = None  # as its last heartbeat said
    backbone: bool = False  # as its last heartbeat said: it computes no gradients
    upload_bps: float | None = None  # as its last heartbeat said: what its rounds went out at lately
    averaging_s: float | None = None  # as its last heartbeat said: its last step's averaging took (horizon)
    last_seen: float = 0.0  # monotonic
    answer_s: float | None = None  # close → its ready call, done before the close (decaying max; answer_wait)
    evaluated: int = 0  # the newest step whose held-out evaluation it reported (one report per step)

    def status(self) -> PeerStatus:
        """Its row in the run's status."""
        return PeerStatus(
            peer_id=self.peer_id,
            step=self.share.step,
            samples=self.share.samples,
            samples_per_s=self.share.samples_per_s,
            client_mode=not self.reach.owns_part,
            chunks_held=self.chunks_held,
            loss=self.loss,
            address=self.reach.address,
            reachable=self.reach.reachable,
            bt_reachable=self.reach.bt_reachable,
            compute_share=self.compute_share,
            backbone=self.backbone,
            upload_bps=self.upload_bps,
        )
