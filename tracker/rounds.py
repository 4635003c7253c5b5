"""A formed step's rounds: the signed :class:`GroupAssignment` of each group of each phase, the step's durable
record, and the newest formed steps kept, so a late ready call gets its own assignment again and donors are
vouched for by who took part. The partition itself is :mod:`crowdtrain.tracker.matchmaking`'s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from crowdtrain.protocol.credentials import SigningKey, sign_assignments
from crowdtrain.protocol.messages import AveragingSpec, GroupAssignment, GroupMember, StepRecord
from crowdtrain.tracker.matchmaking import Candidate, Group

if TYPE_CHECKING:
    from crowdtrain.tracker.peers import Peer

KEEP_FORMED_STEPS = 8  # assignments of this many past steps are kept to answer late ready calls
# Parts by upload rate (AveragingSpec.part_sizes = "upload"): an owner's rate counts within
# [median ÷ PART_RATE_SPREAD, median × PART_RATE_SPREAD] of its group's owners (so one claim cannot take a
# whole vector, nor shrink a part to nothing), an owner with no rate yet at that median; part weights sum
# to about PART_WEIGHT_SCALE.
PART_RATE_SPREAD = 8.0
PART_WEIGHT_SCALE = 1 << 16


class Rounds:
    """The assignments of the newest KEEP_FORMED_STEPS formed steps, phase by phase, by peer."""

    def __init__(self) -> None:
        self._formed: OrderedDict[int, dict[str, list[GroupAssignment]]] = OrderedDict()

    def add(self, step: int, assignments: dict[str, list[GroupAssignment]]) -> None:
        self._formed[step] = assignments
        while len(self._formed) > KEEP_FORMED_STEPS:
            self._formed.popitem(last=False)

    def of(self, step: int, peer_id: str) -> list[GroupAssignment]:
        """The peer's assignments of ``step``, one per phase; none if it was not averaged (or it is too old)."""
        return self._formed.get(step, {}).get(peer_id, [])

    def knows(self, step: int) -> bool:
        """Whether ``step`` formed and is still kept (so who took part in it is known)."""
        return step in self._formed

    def took_part(self, step: int, peer_id: str) -> bool:
        return peer_id in self._formed.get(step, {})

    def contributed(self, peer_id: str) -> bool | None:
        """Whether the peer took part with a weight (it is training, not catching up) in any kept step; None
        when no step is kept (nothing is known)."""
        if not self._formed:
            return None
        for formed in self._formed.values():
            for a in formed.get(peer_id, [])[:1]:
                if any(m.peer_id == peer_id and m.weight > 0 for m in a.members):
                    return True
        return False

    def columns(self, a: GroupAssignment) -> list[GroupAssignment]:
        """The groups that make one mean with ``a``: in a later phase every column of its cluster (by round
        id), in the first phase ``a`` alone; [] when its step is no longer kept."""
        formed = self._formed.get(a.step)
        if formed is None:
            return []
        if a.phase == 0:
            return [a]
        found: dict[str, GroupAssignment] = {}
        for assignments in formed.values():
            if len(assignments) > a.phase:
                b = assignments[a.phase]
                if b.cluster == a.cluster:
                    found.setdefault(b.round_id, b)
        return list(found.values())


def sign_round(
    signer: SigningKey,
    run_id: str,
    step: int,
    seed: int,
    candidates: list[Candidate],
    phases: list[list[Group]],
    peers: Mapping[str, Peer],
    averaging: AveragingSpec,
    now: float,
) -> dict[str, list[GroupAssignment]]:
    """One assignment per group of each phase of the ready ``candidates`` (each phase its own deadline),
    all signed at once (one signature over their Merkle root), listed by member: a candidate's assignments,
    phase by phase."""
    average_params = averaging.averages_params(step)
    step_samples = sum(c.weight for c in candidates)
    by_upload = averaging.part_sizes == "upload"
    unsigned: list[GroupAssignment] = []
    for phase, groups in enumerate(phases):
        deadline = now + averaging.round_timeout_s * (phase + 1)  # phase by phase, each its own timeout
        for index, group in enumerate(groups):
            unsigned.append(
                GroupAssignment(
                    run_id=run_id,
                    round_id=f"{run_id}.{step}.{phase}.{index}.{seed:016x}",
                    step=step,
                    members=_members(group, peers),
                    parts=len(group.owners),
                    part_weights=part_weights(
                        [peers[o].upload_bps for o in group.owners] if by_upload else []
                    ),
                    average_params=average_params,
                    deadline=deadline,
                    seed=seed,
                    phase=phase,
                    phases=len(phases),
                    cluster=group.cluster,
                    step_samples=step_samples,
                    signature="",
                )
            )
    assignments: dict[str, list[GroupAssignment]] = {c.peer_id: [] for c in candidates}
    for signed in sign_assignments(signer, unsigned):
        for member in signed.members:
            assignments[member.peer_id].append(signed)
    return assignments


def part_weights(rates: list[float | None]) -> list[int]:
    """Owners' part weights in proportion to their upload rates (bytes/s; None: not measured yet), each rate
    within PART_RATE_SPREAD of the owners' median; [] (equal parts) when no rate is known or all are equal.

    Why by upload rate: an owner sends its reduced part back to every other member, so its upload grows with
    its part while a member's copies of the other parts do not shrink; a slow uplink owning an equal part is
    the round's bottleneck (DeDLOC's bandwidth-proportional partitions)."""
    known = sorted(r for r in rates if r)
    if len(rates) < 2 or not known:  # (no rates given: the run's parts are equal)
        return []
    median = known[len(known) // 2]
    low, high = median / PART_RATE_SPREAD, median * PART_RATE_SPREAD
    clamped = [min(max(r if r else median, low), high) for r in rates]
    total = sum(clamped)
    weights = [max(1, round(PART_WEIGHT_SCALE * r / total)) for r in clamped]
    return [] if len(set(weights)) == 1 else weights


def _members(group: Group, peers: Mapping[str, Peer]) -> list[GroupMember]:
    """A group's members: a part owner with its address and part, the others (client mode) with part -1."""
    part_of = {peer_id: i for i, peer_id in enumerate(group.owners)}
    return [
        GroupMember(
            peer_id=peer_id,
            address=peers[peer_id].reach.address if peer_id in part_of else None,
            public_key=peers[peer_id].public_key,
            weight=weight,
            part=part_of.get(peer_id, -1),
        )
        for peer_id, weight in zip(group.members, group.weights, strict=True)
    ]


def step_record(
    step: int,
    candidates: list[Candidate],
    groups: list[Group],
    seed: int,
    peers: Mapping[str, Peer],
    closed_at: float,
    duration_s: float,
    inner_steps: int = 1,
) -> StepRecord:
    """The formed step's history record: credited with the samples that were averaged (the candidates'
    weights), its first phase's groups, and the averaged peers' last training loss, weighted by samples."""
    losses = [(c.weight, peers[c.peer_id].loss) for c in candidates if c.weight > 0]
    known = [(w, loss) for w, loss in losses if loss is not None]
    total = sum(w for w, _ in known)
    return StepRecord(
        step=step,
        closed_at=closed_at,
        duration_s=max(0.0, duration_s),
        samples=sum(c.weight for c in candidates),
        peers=len(candidates),
        groups=len(groups),
        seed=seed,
        loss=sum(w * loss for w, loss in known) / total if total else None,
        inner_steps=inner_steps,
    )
