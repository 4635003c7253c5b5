"""A member's complaints about part owners whose receipts did not hold (protocol/receipts.py), to its tracker.

A complaint goes out in the background once its round is over: the round never waits for the tracker. A
call that fails is logged and dropped (the round already refused the answer: a complaint only flags the
owner for the others).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.protocol.messages import Complaint, Credential, GroupAssignment

log = logging.getLogger(__name__)

# (assignment, tag, owner, the receipt, why) -> the tracker's outcome ("barred", "accused", ...), or None
Complainer = Callable[[GroupAssignment, str, str, bytes, str], Awaitable[str | None]]


def tracker_complainer(
    tracker: TrackerClient, run_id: str, peer_id: str, key: SigningKey, credential: Credential
) -> Complainer:
    """Complaints of a joined volunteer go to its tracker."""

    async def complain(a: GroupAssignment, tag: str, owner: str, receipt: bytes, why: str) -> str | None:
        msg = Complaint(
            peer_id=peer_id, assignment=a, tag=tag, owner=owner, receipt=receipt.hex(), why=why[:300]
        )
        try:
            reply = await tracker.complain(run_id, msg, key, credential)
        except (CrowdtrainError, OSError) as exc:
            log.info(
                "round %s/%s: the tracker did not take the complaint about %s: %s",
                a.round_id,
                tag,
                owner,
                exc,
            )
            return None
        return reply.outcome

    return complain
