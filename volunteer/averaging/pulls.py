"""A member's judgement of the others' copies: one that points against the rest of the mean, round after round,
is reported to the tracker with the part owners' signed receipts that show it (protocol/receipts.py,
:func:`~crowdtrain.protocol.receipts.alignment`; the tracker's side: tracker/pulls.py)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from crowdtrain.protocol import receipts
from crowdtrain.volunteer.averaging.complaints import Complainer
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.exchange import Round
from crowdtrain.volunteer.events import Emit, MemberPulling

log = logging.getLogger(__name__)

MAX_MEMORY = 4096  # members whose last judgement is remembered


class PullJudge:
    """Judges each first phase's other members by the receipts that held (``Round.held``)."""

    def __init__(self, peer_id: str, config: AveragingConfig) -> None:
        self.peer_id = peer_id
        self.config = config
        # member → whether its copy pulled against the others in the last round this peer saw it in (a member
        # is reported from its second such round in a row: one round of noisy gradients says too little)
        self._pulled: OrderedDict[str, bool] = OrderedDict()

    async def judge(self, rnd: Round, complainer: Complainer | None, emit: Emit) -> None:
        """Report the member that points furthest against the others' terms in this round, if it did so in the
        last round this peer saw it in too, by the receipts of the parts owned by neither this peer nor it
        (computed in a thread: members × parts lines)."""
        threshold = receipts.pull_cos(self.config.local)
        judged = await asyncio.to_thread(self.alignments, rnd)
        flagged = []
        for member, cos, raws in judged:
            before = self._pulled.pop(member, False)
            self._pulled[member] = cos < threshold
            while len(self._pulled) > MAX_MEMORY:
                self._pulled.popitem(last=False)
            if cos < threshold and before:
                flagged.append((cos, member, raws))
        # Only the member that points furthest against the rest: a hostile copy in the rest turns an honest
        # member's cosine against it too (an honest every-step gradient was reported so beside one at -4.9x)
        lowest = min((cos for _, cos, _ in judged), default=None)
        for cos, member, raws in [f for f in flagged if f[0] == lowest]:
            log.warning(
                "round %s: member %s's copy points against the others' terms (cosine %.3f, by %d part owners' "
                "receipts)",
                rnd.key,
                member,
                cos,
                len(raws),
            )
            a = rnd.assignment
            outcome = None if complainer is None else await complainer.of_member(a, rnd.tag, member, raws)
            emit(
                MemberPulling(
                    round_id=a.round_id, step=a.step, member=member, alignment=cos, tracker=outcome or ""
                )
            )

    def alignments(self, rnd: Round) -> list[tuple[str, float, list[bytes]]]:
        """Each other member with a weight: its cosine with the others' terms, and the receipts it is from."""
        n, clip = len(rnd.members), self.config.clip_multiple
        held = {}
        for part, (owner, raw) in rnd.held.items():
            r = receipts.Receipt.parse(raw, n)
            held[part] = (r, owner, raw, receipts.factors(r, owner, clip))
        out = []
        for index, member in enumerate(rnd.members.values()):
            if member.peer_id == self.peer_id or member.weight <= 0:
                continue
            theirs = [h for part, h in held.items() if part != member.part]
            if len(theirs) < receipts.PULL_PARTS:
                continue
            cos = receipts.alignment([(r, o) for r, o, *_ in theirs], index, clip, [f for *_, f in theirs])
            if cos is not None:
                out.append((member.peer_id, cos, [raw for _, _, raw, _ in theirs]))
        return out
