"""A member's complaints to its tracker: part owners whose receipts did not hold, and members whose copies pull
against the others' (protocol/receipts.py, tracker/pulls.py).

A complaint goes out in the background once its round is over: the round never waits for the tracker. A
call that fails is logged and dropped (the round already refused the answer, or clipped the copy: a complaint
only flags the peer for the others).
"""

from __future__ import annotations

import logging
from typing import Protocol

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.protocol.messages import Complaint, Credential, GroupAssignment, PullReport

log = logging.getLogger(__name__)


class Complainer(Protocol):
    """Where a member's complaints go; each returns the tracker's outcome ("barred", "accused", "counted",
    ...), or None when it did not take it."""

    async def of_owner(
        self, a: GroupAssignment, tag: str, owner: str, receipt: bytes, why: str
    ) -> str | None:
        """``owner``'s answer came with ``receipt``, which does not hold (``why``)."""
        ...

    async def of_member(self, a: GroupAssignment, tag: str, member: str, held: list[bytes]) -> str | None:
        """``member``'s copy points against the others' terms, as the receipts ``held`` show."""
        ...


class TrackerComplainer:
    """Complaints of a joined volunteer go to its tracker."""

    def __init__(
        self, tracker: TrackerClient, run_id: str, peer_id: str, key: SigningKey, credential: Credential
    ) -> None:
        self.tracker = tracker
        self.run_id = run_id
        self.peer_id = peer_id
        self.key = key
        self.credential = credential

    async def of_owner(
        self, a: GroupAssignment, tag: str, owner: str, receipt: bytes, why: str
    ) -> str | None:
        msg = Complaint(
            peer_id=self.peer_id, assignment=a, tag=tag, owner=owner, receipt=receipt.hex(), why=why[:300]
        )
        try:
            reply = await self.tracker.complain(self.run_id, msg, self.key, self.credential)
        except (CrowdtrainError, OSError) as exc:
            return self._not_taken(a, tag, f"the complaint about {owner}", exc)
        return reply.outcome

    async def of_member(self, a: GroupAssignment, tag: str, member: str, held: list[bytes]) -> str | None:
        msg = PullReport(
            peer_id=self.peer_id, assignment=a, tag=tag, member=member, receipts=[r.hex() for r in held]
        )
        try:
            reply = await self.tracker.report_pull(self.run_id, msg, self.key, self.credential)
        except (CrowdtrainError, OSError) as exc:
            return self._not_taken(a, tag, f"the report of {member}", exc)
        return reply.outcome

    @staticmethod
    def _not_taken(a: GroupAssignment, tag: str, what: str, exc: BaseException) -> None:
        log.info("round %s/%s: the tracker did not take %s: %s", a.round_id, tag, what, exc)
        return None
