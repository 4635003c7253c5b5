"""One mean, bit for bit, at any number of peers: the tracker's plan of phases (``matchmaking.plan``) run by
real averagers over real HTTP, with every codec, and every peer's result compared bit for bit.

With more peers than a group (two or three phases), a lossy codec used to give each column of a later phase
its own rounding of the same mean: the senders' error-feedback residuals, the owners' answer residuals,
part bounds that cut the quantisation blocks differently, and the owner's own unquantised copy all differed
from column to column, so no two volunteers held the same state (0 of 19 steps agreed with 5 volunteers in
groups of 4). The volunteers' own test of the same rule is in ``test_volunteer_collab.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import pytest

from crowdtrain.protocol.codecs import Codec
from crowdtrain.protocol.credentials import sign_assignment
from crowdtrain.protocol.errors import AveragingError
from crowdtrain.protocol.messages import GroupAssignment, GroupMember, round_tag
from crowdtrain.tracker.matchmaking import Candidate, plan
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.averaging import AveragingConfig
from tests.harness import Recorder, published_run, until, volunteers
from tests.test_allreduce import RUN, TRACKER, Peer, start_peers, weighted_mean

GROUP = 4


def phase_assignments(peers: list[Peer], weights: list[int], step: int) -> dict[str, list[GroupAssignment]]:
    """Each peer's assignments of every phase, as the tracker plans and signs them (every peer reachable)."""
    by_id = {p.peer_id: p for p in peers}
    candidates = [Candidate(p.peer_id, True, w) for p, w in zip(peers, weights, strict=True)]
    phases = plan(candidates, GROUP, seed=step)
    mine: dict[str, list[GroupAssignment]] = {p.peer_id: [] for p in peers}
    for phase, groups in enumerate(phases):
        for g, group in enumerate(groups):
            members = [
                GroupMember(
                    peer_id=pid,
                    address=by_id[pid].address,
                    public_key=by_id[pid].key.public_hex,
                    weight=w,
                    part=group.owners.index(pid) if pid in group.owners else -1,
                )
                for pid, w in zip(group.members, group.weights, strict=True)
            ]
            assignment = sign_assignment(
                TRACKER,
                GroupAssignment(
                    run_id=RUN,
                    round_id=f"s{step}-g{g}",
                    step=step,
                    members=members,
                    parts=len(group.owners),
                    average_params=False,
                    deadline=time.time() + 30,
                    seed=step,
                    phase=phase,
                    phases=len(phases),
                    signature="",
                ),
            )
            for pid in group.members:
                mine[pid].append(assignment)
    return mine


async def all_phases(peer: Peer, assignments: list[GroupAssignment], vector: np.ndarray) -> np.ndarray:
    """What ``volunteer/rounds.py`` does with a step's phases: each phase's mean the next one's input."""
    values = vector
    for a in assignments:
        [me] = [m for m in a.members if m.peer_id == peer.peer_id]
        result = await peer.averager.allreduce(a, values, float(me.weight), tag=round_tag("grad", a.phase))
        assert not result.late and not result.failed_parts and not result.dropped, result
        values = result.values
    return values


@pytest.mark.parametrize(
    ("codec", "clip"),
    [
        (Codec.NONE, 0.0),
        (Codec.FP16, 0.0),
        (Codec.INT8, 0.0),
        (Codec.INT2, 0.0),
        (Codec.SPARSE, 0.0),
        (Codec.INT8, 1.0),
    ],
)
@pytest.mark.parametrize("n", [5, 8, 16])
async def test_every_peer_holds_the_same_mean_bit_for_bit_in_every_phase_plan(n, codec, clip):
    """Four steps (error feedback carries over between them) of gradients of uneven scales and weights
    and a vector that is not a whole number of blocks: every peer's mean is the same bytes, and without
    clipping it is the weighted mean within what the codec loses; with the default clip (its copies 0.5 to
    2 × apart: it binds) it is still one mean."""
    config = AveragingConfig(codec=codec, subframe_elements=8192, clip_multiple=clip)
    peers = await start_peers(n, config)
    try:
        rng = np.random.default_rng(n * 10 + int(codec))
        size = 3 * 4096 * GROUP + 1234
        for step in range(4):
            weights = [int(w) for w in rng.integers(1, 9, n)]
            vectors = [(rng.standard_normal(size) * rng.uniform(0.5, 2)).astype(np.float32) for _ in range(n)]
            mine = phase_assignments(peers, weights, step)
            assert max(len(a) for a in mine.values()) > 1  # (more than one phase: the case that drifted)
            means = await asyncio.gather(
                *(all_phases(p, mine[p.peer_id], v.copy()) for p, v in zip(peers, vectors, strict=True))
            )
            differ = [
                p.peer_id for p, m in zip(peers, means, strict=True) if m.tobytes() != means[0].tobytes()
            ]
            assert not differ, (
                f"step {step}: {len(differ)} of {n} peers hold another mean than {peers[0].peer_id}"
            )
            if clip == 0 and codec in (Codec.NONE, Codec.FP16, Codec.INT8):  # (int2, sparse: error feedback)
                expected = weighted_mean(vectors, weights)
                tolerance = {Codec.NONE: 1e-6, Codec.FP16: 2e-3, Codec.INT8: 4e-2}[codec]
                assert np.abs(means[0] - expected).max() <= tolerance * np.abs(expected).max()
    finally:
        for p in peers:
            await p.stop()


async def test_a_later_phase_copy_far_above_its_median_fails_the_part_and_never_clips_it():
    """The flaky local-steps case, made certain: one first-phase group's mean is 30× the other's on the tail of
    the vector (in local-steps mode a group of fast peers hands over a pseudo-gradient of many inner steps, a
    group of slow or loaded ones one of a few). The later phase's columns cut the vector into other parts, so a
    clip there scaled each column's tail by another factor: the columns held 2 different means. Now such a part
    fails (no column clips), and once every peer zeroes the slices any column lost (the tracker's verdicts,
    ``volunteer/rounds.py``) every peer holds the same bytes; the parts away from the tail are not lost."""
    config = AveragingConfig(codec=Codec.NONE, subframe_elements=8192, clip_multiple=1.0)
    peers = await start_peers(5, config, prefix="far-")
    try:
        rng = np.random.default_rng(3)
        size = 3 * 4096 * GROUP + 1234
        mine = phase_assignments(peers, [1] * len(peers), 0)
        assert all(len(a) == 2 for a in mine.values())
        first = {p.peer_id: mine[p.peer_id][0].round_id for p in peers}
        big = max(first.values())
        tail = size - size // 10
        vectors = []
        for p in peers:
            v = rng.standard_normal(size).astype(np.float32)
            if first[p.peer_id] == big:
                v[tail:] *= 50
            vectors.append(v)

        async def phases(peer: Peer, assignments: list[GroupAssignment], vector: np.ndarray):
            values, lost = vector, []
            for a in assignments:
                [me] = [m for m in a.members if m.peer_id == peer.peer_id]
                result = await peer.averager.allreduce(
                    a, values, float(me.weight), tag=round_tag("grad", a.phase)
                )
                assert not result.late and not result.dropped, result
                assert a.phase == 0 or not result.clipped, (
                    a.phase,
                    result.clipped,
                )  # a later phase never clips
                bounds = peer.averager.bounds(a, size)
                lost += [(a.phase, bounds[part]) for part in result.failed_parts]
                values = result.values
            return values, lost

        held = await asyncio.gather(
            *(phases(p, mine[p.peer_id], v.copy()) for p, v in zip(peers, vectors, strict=True))
        )
    finally:
        for p in peers:
            await p.stop()
    lost = {item for _, mine_lost in held for item in mine_lost}
    assert lost and all(phase == 1 for phase, _ in lost), (
        lost
    )  # (the far copy failed parts of the later phase)
    means = []
    for values, _ in held:
        values = values.copy()
        for _, (lo, hi) in lost:
            values[lo:hi] = 0.0
        means.append(values.tobytes())
    assert len(set(means)) == 1
    assert min(lo for _, (lo, _) in lost) > 0  # the head of the vector was averaged


# ------------------------------------------------------------------ the same rule, volunteers end to end


async def states_after_every_step(tmp_path, n: int, averaging: dict, steps: int) -> dict[int, list[bytes]]:
    """``n`` real volunteers of a run in groups of 4 until ``steps`` steps: the parameters each recorded after
    each step, as bytes, by step."""
    async with published_run(
        tmp_path,
        target_batch_size=16 * n,
        micro_batch_size=8,
        averaging={"group_size": GROUP, "clip_multiple": 5.0, **averaging},
    ) as run:
        recs = [Recorder() for _ in range(n)]
        vols = volunteers(run, tmp_path, n, seed=11, record=recs, max_steps=steps)
        summaries = await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 400)
    assert all(s.steps_done == steps for s in summaries), [s.steps_done for s in summaries]
    return {k: [rec.params[k].tobytes() for rec in recs if k in rec.params] for k in range(1, steps + 1)}


# (the averaging itself is checked above at every size with every codec: here the volunteers' side of the rule,
# its modes and delays, at sizes of two and three phases; about a minute and a half in all)
VOLUNTEER_CASES = [
    *[(5, codec, 1, 0, 5) for codec in ("int8", "sparse")],  # (the default, and the home links' codec)
    *[(5, "int8", inner, delay, 5) for inner, delay in ((1, 1), (3, 0), (3, 1))],
    (8, "int8", 3, 1, 4),
    (16, "int8", 1, 0, 3),
]


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("n", "codec", "inner_steps", "delay", "steps"), VOLUNTEER_CASES)
async def test_every_volunteer_holds_the_same_state_after_every_step(
    tmp_path, n, codec, inner_steps, delay, steps
):
    """More volunteers than a group, the run's codec, every-step (``inner_steps = 1``) or local-steps mode,
    delay 0 or 1: after every step each volunteer's parameters are the same bytes as every other's."""
    local = {"inner_steps": inner_steps, "inner_batch_size": 8} if inner_steps > 1 else {}
    states = await states_after_every_step(
        tmp_path, n, {"codec": codec, "delay": delay, **local}, steps=steps
    )
    for step, held in states.items():
        assert len(held) == n, f"step {step}: only {len(held)} of {n} volunteers recorded their state"
        distinct = len(set(held))
        assert distinct == 1, f"step {step}: the {n} volunteers hold {distinct} different states"


@pytest.mark.timeout(300)
async def test_a_member_lost_in_a_later_phase_leaves_the_others_one_mean_and_no_one_fetches(tmp_path):
    """Issue 47 (the churn soak): a member that leaves during a later phase takes its column's parts with it
    (a later phase needs every weighted member's copy), while the cluster's other column completes. Every
    member of the lost column used to fail the round and fetch the state; when that left no two donors agreeing,
    the run stood still for minutes. Now the tracker tells every column of the cluster which slices were lost
    and all zero them: the survivors apply one mean, none of them fails the round, and they hold the same
    bytes at every step; the member that left fetches the state and holds them again."""
    n, lost, steps = 5, 3, 7
    async with published_run(
        tmp_path,
        target_batch_size=16 * n,
        micro_batch_size=8,
        averaging={"group_size": GROUP, "round_timeout_s": 4.0, "gather_s": 1.0},
    ) as run:
        recs = [Recorder() for _ in range(n)]
        events: list[list[ev.Event]] = [[] for _ in range(n)]
        vols = volunteers(
            run, tmp_path, n, seed=11, record=recs, emit=[e.append for e in events], max_steps=steps
        )
        tasks = [asyncio.create_task(v.run()) for v in vols]
        await until(lambda: vols[0]._run is not None, 60, "the first volunteer joined", watching=tasks)
        allreduce = vols[0]._run.averager.allreduce

        async def leaving(assignment, vector, weight, *, tag="grad", **kw):
            if assignment.step == lost and assignment.phase == 1:  # the fault: gone from the later phase
                raise AveragingError(f"the test's fault: volunteer 0 left phase 2 of step {lost}")
            return await allreduce(assignment, vector, weight, tag=tag, **kw)

        vols[0]._run.averager.allreduce = leaving
        summaries = await asyncio.wait_for(asyncio.gather(*tasks), 240)
    assert all(s.steps_done >= steps - 2 for s in summaries), [s.steps_done for s in summaries]
    said = [[e.message for e in seen if isinstance(e, ev.LogLine)] for seen in events]
    # the fault happened where it matters: a survivor zeroed slices another column lost
    assert any("other columns of its cluster lost parts" in m for seen in said[1:] for m in seen), said[1:]
    failed = [m for seen in said[1:] for m in seen if f"round of step {lost} failed" in m]
    assert not failed, failed  # no survivor failed the round (none fetched the state)
    assert any(f"round of step {lost} failed" in m for m in said[0]), said[0]  # (the one that left did)
    for step in range(1, steps + 1):
        held = {rec.params[step].tobytes() for rec in recs[1:] if step in rec.params}
        assert len(held) == 1, f"step {step}: the survivors hold {len(held)} different states"
    final = {rec.params[max(rec.params)].tobytes() for rec in recs if max(rec.params) == steps}
    assert len(final) == 1
    # (and each volunteer said each phase once when it changed, not again: a catch-up's phases included)
    for seen in events:
        phases = [e.phase for e in seen if isinstance(e, ev.PhaseChanged)]
        assert all(a != b for a, b in itertools.pairwise(phases)), phases
