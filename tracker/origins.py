"""Where a volunteer's identities come from (weight is earned, not claimed).

Identities cost nothing to make, so the tracker counts them where they come from: the address a join or a
heartbeat arrives from, an IPv4 address or an IPv6 /64 (what one home or one machine holds), and its
neighbourhood, an IPv4 /24 or an IPv6 /48 (:func:`crowdtrain.protocol.addresses.origin_of`). Per run, at most ``max_peers_per_address`` live identities may
come from one address and SUBNET_FACTOR times as many from one neighbourhood; the identities of one address
share one share cap (:mod:`crowdtrain.tracker.ledger`), so two identities there weigh no more in a step than
one. The machine's own processes (``127.0.0.1``, ``::1``: the demo, a volunteer beside its tracker) are not
counted: the operator runs them. Other loopback addresses count like any host (the suite's tests use them to
stand for separate hosts).
"""

from __future__ import annotations

from collections.abc import Mapping

from crowdtrain.protocol.addresses import Origin

SUBNET_FACTOR = 8  # identities of a run per /24 (/48): this many times those per address


class Origins:
    """Live identities of one run by origin, counted as they join and leave (the ledger keeps it)."""

    def __init__(self) -> None:
        self._of: dict[str, Origin] = {}  # peer id -> its origin
        self._at: dict[str, set[str]] = {}  # an address or a subnet -> the live peers counted there

    def admits(self, origin: Origin | None, per_address: int) -> str | None:
        """None if one more identity from ``origin`` is within the bounds; else why not, in a sentence."""
        if origin is None:
            return None
        per_subnet = SUBNET_FACTOR * per_address
        if len(self._at.get(origin.address, ())) >= per_address:
            return (
                f"this run already has {per_address} volunteers from your address ({origin.address}), the "
                "limit per address; stop one, or ask the tracker's operator (tracker serve --max-per-address)"
            )
        if len(self._at.get(origin.subnet, ())) >= per_subnet:
            return (
                f"this run already has {per_subnet} volunteers from your network ({origin.subnet}), the "
                "limit per network; ask the tracker's operator (tracker serve --max-per-address)"
            )
        return None

    def add(self, peer_id: str, origin: Origin | None) -> None:
        self.remove(peer_id)
        if origin is not None:
            self._of[peer_id] = origin
            for key in (origin.address, origin.subnet):
                self._at.setdefault(key, set()).add(peer_id)

    def remove(self, peer_id: str) -> None:
        origin = self._of.pop(peer_id, None)
        if origin is not None:
            for key in (origin.address, origin.subnet):
                here = self._at[key]
                here.discard(peer_id)
                if not here:
                    del self._at[key]

    @property
    def by_peer(self) -> Mapping[str, Origin]:
        """Each live peer's origin (a peer of this machine has none)."""
        return self._of

    def siblings(self, peer_id: str) -> tuple[str, ...]:
        """The other live peers counted at ``peer_id``'s address (none for this machine's own)."""
        origin = self._of.get(peer_id)
        if origin is None:
            return ()
        return tuple(p for p in self._at[origin.address] if p != peer_id)
