"""Part owners' receipts (issue 48, protocol/receipts.py): no member applies an answer its owner cannot
account for, and the tracker bars an owner on its own signed receipt.

The hostile owner is a real peer (real HTTP, real frames, the default codec int8) whose :class:`Owner` is given
a coder that forges its answers and, for the cleverer attacks, a reducer that forges its receipt: the explicit
fault seams of these tests, which nothing in the CLI reaches."""

from __future__ import annotations

import numpy as np
import pytest

from crowdtrain.protocol import receipts
from crowdtrain.protocol.codecs import Codec
from crowdtrain.protocol.credentials import sign_assignment
from crowdtrain.protocol.errors import TrackerError
from crowdtrain.protocol.messages import Complaint, GroupAssignment, GroupMember
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.averaging import AveragingConfig
from tests.hostile import LineForger, OwnLineForger, forge_answers
from tests.sim import SimVolunteer, make_run_create
from tests.test_allreduce import assign, run_round, start_peers, weighted_mean

N = 4096 * 3  # three int8 blocks per part of a group of 4 (parts are cut at the codec's blocks)


def make_hostile(peer, attack: str) -> None:
    """The hostile owner's seams (tests/hostile.py) for ``attack``."""
    forger = {"x -10, own line forged": OwnLineForger, "reversed, lines forged": LineForger}.get(attack)
    forge_answers(peer.averager, -1.0 if attack == "reversed, lines forged" else -10.0, forger)


ATTACKS = {  # attack -> (the hostile's weight, proven by the receipt alone)
    "x -10": (1, True),
    "x -10, own line forged": (1, True),
    "reversed, lines forged": (1, False),
    "backbone (weight 0), x -10": (0, True),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_an_honest_member_applies_no_answer_its_owner_cannot_account_for(attack):
    weight, proven = ATTACKS[attack]
    peers = await start_peers(4, AveragingConfig(clip_multiple=0.0), prefix="rc-")
    complaints: list[tuple[str, str]] = []

    class Complainer:
        async def of_owner(self, a, tag, owner, receipt, why):
            complaints.append((owner, receipts.Receipt.parse(receipt, len(a.members)).part))
            return "accused"

        async def of_member(self, a, tag, member, held):
            raise AssertionError(f"no member pulls here, yet {member} was reported")

    complainer = Complainer()

    try:
        make_hostile(peers[0], attack)
        for p in peers[1:]:
            p.averager.complainer = complainer
        rng = np.random.default_rng(3)
        vectors = [rng.standard_normal(N).astype(np.float32) for _ in peers]
        weights = [weight, 1, 1, 1]
        results = await run_round(peers, assign(peers, weights), vectors, weights)
    finally:
        for p in peers:
            await p.stop()
    mean = weighted_mean(vectors, weights)
    bounds = peers[1].averager.bounds(assign(peers, weights), N)
    (a0, b0) = bounds[0]
    for i in (1, 2, 3):
        r = results[i]
        assert r.failed_parts == (0,), (attack, r.reasons)
        assert "receipt does not account for" in r.reasons["part 0"], r.reasons
        np.testing.assert_array_equal(r.values[a0:b0], vectors[i][a0:b0])  # kept, not the forged answer
        np.testing.assert_allclose(r.values[b0:], mean[b0:], atol=0.05)  # the honest owners' parts (int8)
        refused = [e for e in peers[i].events if isinstance(e, ev.AnswerRefused)]
        assert [(e.owner, e.part, e.proven, e.tracker) for e in refused] == [
            (peers[0].peer_id, 0, proven, "accused")
        ], refused
    assert sorted(complaints) == [(peers[0].peer_id, 0)] * 3


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("phase", [0, 1])
async def test_honest_owners_receipts_hold_for_every_codec_and_phase(codec, phase):
    """Each member checks each answer's receipt: an honest round loses no part to them (with error feedback
    carried over three rounds, as a run does)."""
    config = AveragingConfig(clip_multiple=0.0, codec=codec)
    peers = await start_peers(4, config, prefix=f"ok-{codec.label}-{phase}-")
    try:
        rng = np.random.default_rng(5)
        for _ in range(3):
            vectors = [rng.standard_normal(N).astype(np.float32) * rng.uniform(0.1, 10) for _ in peers]
            a = assign(peers, [3, 1, 2, 5])
            if phase:
                a = sign_assignment_phase(a, phase)
            results = await run_round(peers, a, vectors, [3, 1, 2, 5])
            for r in results:
                assert r.failed_parts == (), r.reasons
    finally:
        for p in peers:
            await p.stop()


def sign_assignment_phase(a: GroupAssignment, phase: int) -> GroupAssignment:
    from tests.test_allreduce import TRACKER

    unsigned = GroupAssignment(
        **{**{f: getattr(a, f) for f in a.__struct_fields__}, "phase": phase, "phases": 2}
    )
    return sign_assignment(TRACKER, unsigned)


# ------------------------------------------------------------------ the tracker's side


async def test_the_tracker_bars_an_owner_on_its_own_receipt_and_counts_other_complaints(tracker, admin):
    """A broken receipt bars its signer at once (its next request is refused with the reason, the status
    shows it); a receipt that holds by itself is an accusation, and two accusers bar the key; a receipt
    the owner did not sign is refused."""
    run_id = (await admin.create_run(make_run_create(target_batch_size=10**6))).run_id
    peers = {}
    for name in ("owner", "m1", "m2", "liar", "n1", "n2"):
        peers[name] = SimVolunteer(admin, run_id)
        await peers[name].join()

    def round_of(owner: str, others: list[str], round_id: str) -> GroupAssignment:
        members = [
            GroupMember(
                peer_id=peers[n].peer_id,
                address="127.0.0.1:9" if n == owner else None,
                public_key=peers[n].key.public_hex,
                weight=1,
                part=0 if n == owner else -1,
            )
            for n in [owner, *others]
        ]
        unsigned = GroupAssignment(
            run_id=run_id,
            round_id=round_id,
            step=1,
            members=members,
            parts=1,
            average_params=False,
            deadline=9e9,
            seed=0,
            signature="",
        )
        return sign_assignment(tracker.signer, unsigned)

    def receipt(signer: str, a: GroupAssignment, g: tuple[float, ...], norm2: float) -> str:
        lines = tuple(receipts.Line(1.0, 1.0, x, i) for i, x in enumerate(g))
        r = receipts.Receipt(0, False, norm2, b"\0" * 16, lines)
        return r.signed(peers[signer].key, run_id, f"{a.round_id}/grad").to_bytes().hex()

    async def complain(who: str, owner: str, a: GroupAssignment, rec: str):
        v = peers[who]
        msg = Complaint(
            peer_id=v.peer_id, assignment=a, tag="grad", owner=peers[owner].peer_id, receipt=rec, why="seen"
        )
        return await admin.complain(run_id, msg, v.key, v.joined.credential)

    # ‖a‖² = 100 but the terms (each within its bound, f·n·‖a‖ = 3.33) sum to -9: broken by itself
    a = round_of("liar", ["n1", "n2"], "broken")
    reply = await complain("n1", "liar", a, receipt("liar", a, (-3.0, -3.0, -3.0), 100.0))
    assert (reply.outcome, reply.proven) == ("barred", True)
    with pytest.raises(TrackerError) as refused:
        await peers["liar"].heartbeat(0, 0)
    assert refused.value.status == 410 and "signed a receipt that does not hold" in str(refused.value)
    status = await admin.status(run_id)
    barred = {c.public_key: c.barred for c in status.credits}
    assert "the answer is not the mean" in barred[peers["liar"].key.public_hex], barred

    # a receipt that holds by itself: one accuser accuses (once however often), a second bars
    b = round_of("owner", ["m1", "m2"], "consistent")
    rec = receipt("owner", b, (1 / 3, 1 / 3, 1 / 3), 1.0)
    first = await complain("m1", "owner", b, rec)
    again = await complain("m1", "owner", b, rec)
    assert (first.outcome, first.proven, again.outcome) == ("accused", False, "accused")
    assert (await complain("m2", "owner", b, rec)).outcome == "barred"

    # a receipt not signed by the owner proves nothing and counts for nothing
    c = round_of("m1", ["n1", "n2"], "unsigned")
    with pytest.raises(TrackerError) as bad:
        await complain("n2", "m1", c, receipt("n1", c, (1 / 3, 1 / 3, 1 / 3), 1.0))
    assert bad.value.status == 422, bad.value


async def test_the_tracker_bars_a_member_whose_copies_pull_against_the_others_by_its_owners_receipts(
    tracker, admin
):
    """A report of a member pulling against the others is recomputed from the part owners' signed receipts:
    an honest member's is refused, and so are receipts of the reporter's or the accused's own part and
    receipts their owners did not sign; the accused is barred once reported in 3 steps by 2 reporters, and its
    next request is refused with the reason."""
    from crowdtrain.protocol.messages import PullReport
    from crowdtrain.tracker.pulls import PULL_ROUNDS

    run_id = (await admin.create_run(make_run_create(target_batch_size=10**6))).run_id
    names = ("o1", "o2", "r1", "r2", "x")
    peers = {}
    for name in names:
        peers[name] = SimVolunteer(admin, run_id)
        await peers[name].join()
    parts = {"o1": 0, "o2": 1, "r1": 2}  # (r2 and x own no part)

    def round_at(step: int) -> GroupAssignment:
        members = [
            GroupMember(
                peer_id=peers[n].peer_id,
                address="127.0.0.1:9" if n in parts else None,
                public_key=peers[n].key.public_hex,
                weight=1,
                part=parts.get(n, -1),
            )
            for n in names
        ]
        unsigned = GroupAssignment(
            run_id=run_id,
            round_id=f"pull-{step}",
            step=step,
            members=members,
            parts=len(parts),
            average_params=False,
            deadline=9e9,
            seed=0,
            signature="",
        )
        return sign_assignment(tracker.signer, unsigned)

    rng = np.random.default_rng(5)

    def receipt(a: GroupAssignment, part: int, signer: str) -> str:
        """The honest receipt of ``part``: four copies near one direction, x's against it (all of norm 1)."""
        base = rng.standard_normal(64)
        copies = [base + 0.5 * rng.standard_normal(64) for _ in range(4)] + [-base]
        copies = [c / np.linalg.norm(c) for c in copies]
        answer = sum(copies) / len(copies)
        lines = tuple(
            receipts.Line(1.0, 1.0, float(c @ answer) / len(copies), i) for i, c in enumerate(copies)
        )
        r = receipts.Receipt(part, False, float(answer @ answer), b"\0" * 16, lines)
        return r.signed(peers[signer].key, run_id, f"{a.round_id}/grad").to_bytes().hex()

    async def report(who: str, member: str, a: GroupAssignment, recs: list[str]):
        v = peers[who]
        msg = PullReport(
            peer_id=v.peer_id, assignment=a, tag="grad", member=peers[member].peer_id, receipts=recs
        )
        return await admin.report_pull(run_id, msg, v.key, v.joined.credential)

    async def refused(who: str, member: str, a: GroupAssignment, recs: list[str]) -> str:
        with pytest.raises(TrackerError) as caught:
            await report(who, member, a, recs)
        assert caught.value.status == 422, caught.value
        return str(caught.value)

    a = round_at(1)
    held = [receipt(a, 0, "o1"), receipt(a, 1, "o2")]
    assert "not below" in await refused("r2", "o1", a, [receipt(a, 1, "o2"), receipt(a, 2, "r1")])  # honest
    assert "2 parts or more" in await refused("r2", "x", a, held[1:])  # a third of the vector says too little
    assert "owned by neither" in await refused("r1", "x", a, [*held, receipt(a, 2, "r1")])
    assert "not its owner's" in await refused("r2", "x", a, [receipt(a, 0, "r2")])

    outcomes = []
    for step in range(1, PULL_ROUNDS + 1):
        a = round_at(step)
        reply = await report("r1", "x", a, [receipt(a, 0, "o1"), receipt(a, 1, "o2")])
        assert reply.alignment < receipts.pull_cos(local=False), reply
        outcomes.append(reply.outcome)
    assert outcomes == ["counted"] * PULL_ROUNDS  # one reporter is not enough
    a = round_at(PULL_ROUNDS)
    assert (await report("r2", "x", a, [receipt(a, 0, "o1"), receipt(a, 1, "o2")])).outcome == "barred"
    with pytest.raises(TrackerError) as gone:
        await peers["x"].heartbeat(0, 0)
    assert gone.value.status == 410 and "pointed against the other members'" in str(gone.value)
    status = await admin.status(run_id)
    assert "signed receipts" in {c.public_key: c.barred for c in status.credits}[peers["x"].key.public_hex]


def test_a_pull_is_read_only_against_others_that_no_single_member_outweighs():
    """``receipts.alignment``: a member that holds most of the others' weight and points against the run makes
    every honest member's copy point against "the others"; the cosine then says only that two copies disagree,
    so it names no one (None). With the weight spread, the one that points against the rest is found."""
    rng = np.random.default_rng(7)

    def held(weights: list[float], flip: int) -> list[tuple[receipts.Receipt, int]]:
        """Two parts' receipts (no clipping: factors are the weights' shares); member ``flip`` points against."""
        out = []
        for part in range(2):
            base = rng.standard_normal(64)
            copies = [base + 0.3 * rng.standard_normal(64) for _ in weights]
            copies[flip] = -copies[flip]
            copies = [c / np.linalg.norm(c) for c in copies]
            f = [w / sum(weights) for w in weights]
            answer = sum(fi * c for fi, c in zip(f, copies, strict=True))
            lines = tuple(
                receipts.Line(w, 1.0, fi * float(c @ answer), i)
                for i, (w, fi, c) in enumerate(zip(weights, f, copies, strict=True))
            )
            out.append((receipts.Receipt(part, False, float(answer @ answer), b"\0" * 16, lines), part))
        return out

    threshold = receipts.pull_cos(local=False)
    spread = held([1.0, 1.0, 1.0, 1.0], flip=3)
    assert receipts.alignment(spread, 3, 0.0) < threshold  # the one against the rest
    assert receipts.alignment(spread, 0, 0.0) > 0  # an honest one, with the rest
    heavy = held([1.0, 1.0, 1.0, 6.0], flip=3)  # the one against holds 2/3 of the weight
    assert receipts.alignment(heavy, 3, 0.0) < threshold  # (it is still against the others: they are alike)
    assert receipts.alignment(heavy, 0, 0.0) is None  # the honest ones: "the others" are mostly it
