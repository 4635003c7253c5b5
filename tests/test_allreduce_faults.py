"""Group all-reduce under faults, over real servers: late and dead peers, and every check on a contribution.

Bad contributions are sent as real signed HTTP requests built from the protocol's own pieces (frames,
peer headers), the way a broken or hostile peer would send them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import numpy as np
import pytest

from crowdtrain.protocol import peerauth
from crowdtrain.protocol.codecs import Codec, Compressor
from crowdtrain.protocol.credentials import SigningKey, issue_credential, sign_assignment
from crowdtrain.protocol.errors import AveragingError
from crowdtrain.protocol.messages import replace
from crowdtrain.volunteer.averaging import AveragingConfig, part_bounds
from crowdtrain.volunteer.averaging.wire import HEADER_ELEMENTS, HEADER_WEIGHT
from crowdtrain.volunteer.events import RoundDone, RoundFailed
from tests.frames import encode_frame
from tests.harness import until
from tests.test_allreduce import RUN, TRACKER, Peer, assign, run_round, start_peer, start_peers, weighted_mean

N = 3000


def frames(values: np.ndarray, per: int = 1000) -> list[bytes]:
    c = Compressor()
    return [encode_frame(values[a : a + per], Codec.NONE, c) for a in range(0, values.size, per)]


async def post_part(
    peer: Peer,
    owner: Peer,
    assignment,
    part: int,
    body,
    *,
    weight: str,
    elements: str,
    sign_with: SigningKey | None = None,
    credential=None,
) -> tuple[int, str]:
    """POST one copy of a part the way a peer would, returning (status, error sentence)."""
    key = f"{assignment.round_id}/grad"
    credential = credential or peer.averager.credential
    headers = peerauth.sign_headers(
        sign_with or peer.key, credential, "allreduce", key, part, weight, elements
    )
    headers |= {HEADER_WEIGHT: weight, HEADER_ELEMENTS: elements}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{owner.address}/v1/allreduce/{key}/{part}", data=body, headers=headers) as resp,
    ):
        if resp.status == 200:
            await resp.read()
            return 200, ""
        return resp.status, (await resp.json())["error"]


@pytest.fixture
async def trio():
    """A (owns the only part), H (client mode, honest) and M (client mode, misbehaving)."""
    config = AveragingConfig(clip_multiple=0.0, subframe_elements=1000)
    a = await start_peer("a", config)
    h = await start_peer("h", config, serve=False)
    m = await start_peer("m", config, serve=False)
    yield a, h, m
    for p in (a, h, m):
        await p.stop()


@pytest.mark.parametrize(
    ("case", "status", "phrase"),
    [
        ("nan", 422, "NaN"),
        ("infinite", 422, "infinite"),
        ("short", 422, "sends 2999 values but part 0 holds 3000"),
        ("shape", 400, "expected one dimension"),
        ("too_many_values", 400, "body continues after the 3000 values"),
        ("weight_above", 422, "above the 4 samples"),
        ("wrong_codec", 400, "codec fp16"),
    ],
)
async def test_bad_contribution_is_rejected_with_its_status_and_left_out_of_the_mean(
    trio, case, status, phrase
):
    a, h, m = trio
    rng = np.random.default_rng(5)
    va, vh, vm = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
    assignment = assign([a, h, m], [3, 2, 4], [0, -1, -1])
    owner = asyncio.create_task(a.averager.allreduce(assignment, va, 3.0))
    weight, elements, body = "4.0", str(N), b"".join(frames(vm))
    if case == "nan":
        vm[1234] = np.nan
        body = b"".join(frames(vm))
    elif case == "infinite":
        vm[2999] = np.inf
        body = b"".join(frames(vm))
    elif case == "short":
        elements, body = str(N - 1), b"".join(frames(vm[:-1]))
    elif case == "shape":
        body = encode_frame(vm.reshape(3, 1000)[:1].reshape(1, 1000), Codec.NONE, Compressor()) + body[1096:]
    elif case == "too_many_values":
        body = body + frames(vm[:5])[0]
    elif case == "weight_above":
        weight = "5.0"
    elif case == "wrong_codec":
        body = encode_frame(vm, Codec.FP16, Compressor())
    got, text = await post_part(m, a, assignment, 0, body, weight=weight, elements=elements)
    assert (got, phrase in text) == (status, True), text
    honest = await h.averager.allreduce(assignment, vh, 2.0)
    result = await owner
    assert result.rejected == ("m",) and result.dropped == () and result.clipped == ()
    np.testing.assert_allclose(result.values, weighted_mean([va, vh], [3, 2]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(honest.values, result.values)
    assert result.reasons["m"]
    # the refused peer may not try again in the same round
    again, _ = await post_part(m, a, assignment, 0, b"".join(frames(vm)), weight="4.0", elements=str(N))
    assert again in (409, 410)


async def test_lossy_copy_cut_into_other_frames_than_the_runs_is_refused_and_the_round_goes_on():
    """With a lossy codec the owner keeps each copy as the codec's payload, frame by frame at the places the
    run's ``subframe_elements`` gives (see ``KeptPart``): a copy cut otherwise is refused before its body is
    read, with a sentence, and the others' mean is still exact to the codec."""
    config = AveragingConfig(clip_multiple=0.0, subframe_elements=1000, codec=Codec.INT8)
    a = await start_peer("a", config)
    h = await start_peer("h", config, serve=False)
    m = await start_peer("m", config, serve=False)
    try:
        rng = np.random.default_rng(6)
        va, vh, vm = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
        assignment = assign([a, h, m], [3, 2, 4], [0, -1, -1])
        owner = asyncio.create_task(a.averager.allreduce(assignment, va, 3.0))
        c = Compressor()
        cut = b"".join(encode_frame(vm[i : i + 600], Codec.INT8, c) for i in range(0, N, 600))
        got, text = await post_part(m, a, assignment, 0, cut, weight="4.0", elements=str(N))
        assert got == 400 and "does not start a frame of this part" in text, (got, text)
        honest = await h.averager.allreduce(assignment, vh, 2.0)
        result = await owner
        assert result.rejected == ("m",)
        np.testing.assert_array_equal(honest.values, result.values)
        np.testing.assert_allclose(result.values, weighted_mean([va, vh], [3, 2]), atol=0.05)
    finally:
        for p in (a, h, m):
            await p.stop()


async def received(owner, assignment, sender: str) -> None:
    """Until ``owner`` has the whole copy of ``sender`` for the round of ``assignment``."""
    key = f"{assignment.round_id}/grad"
    rounds = owner.averager.owner.rounds
    await until(
        lambda: key in rounds and sender in rounds[key].reducer.contributions,
        30,
        f"the owner's receipt of {sender}'s copy",
        every_s=0.01,
    )


def m_sends_to_a(trio, seed: int) -> tuple[list[np.ndarray], object, asyncio.Task, asyncio.Task]:
    """A round of a, h and m (weights 3, 2, 4; a owns the only part) with a's own share under way and m's
    copy posted: (a's, h's and m's values, the assignment, a's round, m's post)."""
    a, h, m = trio
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
    assignment = assign([a, h, m], [3, 2, 4], [0, -1, -1])
    owner = asyncio.create_task(a.averager.allreduce(assignment, values[0], 3.0))
    post = asyncio.create_task(
        post_part(m, a, assignment, 0, b"".join(frames(values[2])), weight="4.0", elements=str(N))
    )
    return values, assignment, owner, post


async def test_duplicate_contribution_gets_409_and_the_first_one_counts(trio):
    a, h, m = trio
    (va, vh, vm), assignment, owner, first = m_sends_to_a(trio, 6)
    await asyncio.sleep(0)  # let the first request start; the second must still meet it whatever the order
    while not first.done():
        status, text = await post_part(
            m, a, assignment, 0, b"".join(frames(vm * 2)), weight="4.0", elements=str(N)
        )
        if status == 409:
            break
    assert status == 409 and "already sent" in text
    await h.averager.allreduce(assignment, vh, 2.0)
    result = await owner
    assert (await first)[0] == 200
    np.testing.assert_allclose(result.values, weighted_mean([va, vh, vm], [3, 2, 4]), rtol=1e-6, atol=1e-6)
    assert result.rejected == ()


@pytest.mark.parametrize("case", ["non_member", "bad_signature", "foreign_tracker", "no_headers"])
async def test_outsiders_are_refused_and_change_nothing(trio, case):
    a, h, m = trio
    rng = np.random.default_rng(7)
    va, vh, vm = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
    assignment = assign([a, h], [3, 2], [0, -1])
    owner = asyncio.create_task(a.averager.allreduce(assignment, va, 3.0))
    body = b"".join(frames(vm * 1000))
    if case == "non_member":  # a real run member, with a valid credential, but not in this group
        status, text = await post_part(m, a, assignment, 0, body, weight="1.0", elements=str(N))
        assert (status, "not a member" in text) == (403, True), text
    elif case == "bad_signature":  # h's credential, signed with someone else's key
        status, text = await post_part(
            h, a, assignment, 0, body, weight="1.0", elements=str(N), sign_with=m.key
        )
        assert (status, "invalid signature" in text) == (401, True), text
    elif case == "foreign_tracker":
        other = issue_credential(SigningKey(), RUN, "h", h.key.public_hex, 60)
        status, text = await post_part(
            h, a, assignment, 0, body, weight="1.0", elements=str(N), credential=other
        )
        assert (status, "credential" in text) == (401, True), text
    else:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"http://{a.address}/v1/allreduce/{assignment.round_id}/grad/0", data=body) as r,
        ):
            assert r.status == 401
    await h.averager.allreduce(assignment, vh, 2.0)
    result = await owner
    assert result.rejected == () and result.dropped == ()
    np.testing.assert_allclose(result.values, weighted_mean([va, vh], [3, 2]), rtol=1e-6, atol=1e-6)


async def test_huge_gradient_is_clipped_to_the_bound_and_reported():
    """The bound: clip_multiple × the lower median of the copies' norms, never above the owner's own."""
    config = AveragingConfig(clip_multiple=5.0)
    peers = await start_peers(4, config)
    try:
        rng = np.random.default_rng(8)
        vectors = [rng.standard_normal(10_000).astype(np.float32) for _ in peers]
        vectors[2] *= 1e6
        weights = [1, 1, 1, 1]
        results = await run_round(peers, assign(peers, weights), vectors, weights)
        bounds = part_bounds(10_000, 4)
        expected = np.empty(10_000)
        for owner, (a, b) in enumerate(bounds):  # (peer i owns part i)
            norms = sorted(float(np.linalg.norm(v[a:b])) for v in vectors)
            bound = 5.0 * min(norms[1], float(np.linalg.norm(vectors[owner][a:b])))  # lower median of four
            scaled = [v[a:b] * min(1.0, bound / np.linalg.norm(v[a:b])) for v in vectors]
            expected[a:b] = weighted_mean(scaled, weights)
        for r in results:
            assert r.clipped == ("p2",)  # every part owner saw it
            assert np.isfinite(r.values).all()
            np.testing.assert_allclose(r.values, expected, rtol=1e-5, atol=1e-5)
            assert np.abs(r.values).max() < 50  # the 1e6 spike did not get through
        done = [e for e in peers[0].events if isinstance(e, RoundDone)]
        assert done[-1].clipped == ("p2",)
    finally:
        for p in peers:
            await p.stop()


@pytest.mark.parametrize("honest, colluders", [(1, 2), (2, 3)])
async def test_colluding_members_cannot_move_the_owners_mean_more_than_the_documented_bound(
    honest, colluders
):
    """k colluders in a group of n (here 2 of 3 and 3 of 5: a majority) send the same huge direction. With
    the group's median as the clip reference they set their own bound; now each copy in the mean is at most
    clip_multiple × the owner's own norm, so their terms move the owner's part by at most
    (Σ their weights ÷ Σ weights) × clip_multiple × ‖owner's copy‖ (docs/security.md)."""
    n = honest + colluders
    config = AveragingConfig(codec=Codec.NONE, clip_multiple=5.0)
    peers = await start_peers(n, config, prefix="c")
    try:
        rng = np.random.default_rng(11)
        vectors = [rng.standard_normal(4096).astype(np.float32) for _ in range(n)]
        direction = rng.standard_normal(4096).astype(np.float32)
        for i in range(honest, n):
            vectors[i] = (1e4 * direction).astype(np.float32)
        weights = [1] * n
        parts = [0] + [-1] * (n - 1)  # the honest peer c0 owns the one part; the others only send
        results = await run_round(peers, assign(peers, weights, parts), vectors, weights)
        honest_terms = sum(vectors[i].astype(np.float64) for i in range(honest)) / n
        moved = float(np.linalg.norm(results[0].values - honest_terms))
        bound = colluders / n * 5.0 * float(np.linalg.norm(vectors[0]))
        assert 0.5 * bound < moved <= bound * (1 + 1e-5)  # (they are clipped to it, not dropped)
        assert sorted(results[0].clipped) == [f"c{i}" for i in range(honest, n)]
        for r in results:
            np.testing.assert_array_equal(r.values, results[0].values)
    finally:
        for p in peers:
            await p.stop()


# ------------------------------------------------------------------ late and dead peers


async def test_late_sender_is_dropped_without_blocking_and_refused_afterwards():
    config = AveragingConfig(clip_multiple=0.0, subframe_elements=500)
    a, b = await start_peers(2, config)
    late = await start_peer("late", config, serve=False)
    try:
        rng = np.random.default_rng(9)
        va, vb, vl = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
        assignment = assign([a, b, late], [1, 2, 3], [0, 1, -1], deadline_s=1.5)
        start, stop = part_bounds(N, 2)[0]  # a owns part 0
        chunks = frames(vl[start:stop], 500)

        async def stalling_body():  # the first sub-frame arrives in time, the rest after the deadline
            yield chunks[0]
            await asyncio.sleep(assignment.deadline - time.time() + 1.0)
            for c in chunks[1:]:
                yield c

        stalled = asyncio.create_task(
            post_part(late, a, assignment, 0, stalling_body(), weight="3.0", elements=str(stop - start))
        )
        ra, rb = await run_round([a, b], assignment, [va, vb], [1, 2])
        for r in (ra, rb):
            assert r.dropped == ("late",) and r.failed_parts == ()
            np.testing.assert_allclose(r.values, weighted_mean([va, vb], [1, 2]), rtol=1e-6, atol=1e-6)
        assert time.time() < assignment.deadline + config.grace_s
        status, text = await stalled
        assert status == 408 and "deadline" in text
        # after the deadline: its own call refuses to start, and a raw copy is told the round is over
        with pytest.raises(AveragingError, match="deadline"):
            await late.averager.allreduce(assignment, vl, 3.0)
        assert isinstance(late.events[-1], RoundFailed)
        status, text = await post_part(
            late, b, assignment, 1, b"".join(frames(vl[stop:], 500)), weight="3.0", elements=str(N - stop)
        )
        assert status == 410 and "over" in text
    finally:
        for p in (a, b, late):
            await p.stop()


async def test_a_member_of_weight_0_asleep_holds_no_part_up_and_one_that_asks_after_the_close_gets_the_mean():
    """Issue 47: a member with weight 0 (catching up) only wants the mean. Asleep, it used to hold every part
    until the deadline; now the parts close once the members with a weight are in, and a weight-0 member that
    asks after a part closed, while the round lasts, still gets that part's mean."""
    config = AveragingConfig(clip_multiple=0.0, subframe_elements=500)
    a, b = await start_peers(2, config)
    sleeper = await start_peer("sleeper", config, serve=False)
    try:
        rng = np.random.default_rng(10)
        va, vb = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
        assignment = assign([a, b, sleeper], [1, 2, 0], [0, 1, -1], deadline_s=120)
        # (the deadline is far: waiting for the sleeper would fail this wait, not pass it late)
        ra, rb = await asyncio.wait_for(run_round([a, b], assignment, [va, vb], [1, 2]), 60)
        for r in (ra, rb):
            assert r.failed_parts == () and not r.late
            np.testing.assert_allclose(r.values, weighted_mean([va, vb], [1, 2]), rtol=1e-6, atol=1e-6)
        # a request of weight 0 after a part closed, while its owner's round lasts, is answered with the mean
        a2, b2 = await start_peers(2, config, prefix="q")
        try:
            second = assign([a2, b2, sleeper], [1, 2, 0], [0, 1, -1], deadline_s=120)
            hold = asyncio.Event()
            original = a2.averager.sender.exchange

            async def held_exchange(*args, **kw):  # a2's copy of b2's part waits: a2's round stays open
                await hold.wait()
                return await original(*args, **kw)

            a2.averager.sender.exchange = held_exchange
            rounds = asyncio.ensure_future(run_round([a2, b2], second, [va, vb], [1, 2]))
            key = f"{second.round_id}/grad"

            def closed() -> bool:
                rnd = a2.averager.owner.rounds.get(key)
                return rnd is not None and rnd.reducer is not None and rnd.reducer.closed

            await until(closed, 30, "a2's part closing without the sleeper")
            status, text = await post_part(sleeper, a2, second, 0, b"", weight="0.0", elements="0")
            hold.set()
            await asyncio.wait_for(rounds, 60)
            assert (status, text) == (200, "")
        finally:
            for p in (a2, b2):
                await p.stop()
    finally:
        for p in (a, b, sleeper):
            await p.stop()


async def test_a_copy_for_a_part_its_owner_gave_up_is_told_the_part_failed_not_that_it_came_late():
    """Issue 47 (the churn soak): an owner leaving gives its round up; a copy that came after was told 410
    ("too late"), so its sender dropped the step that the rest of its group kept (each zeroed the part). It is
    told 503 now: the part failed for every member alike, and the sender zeroes it too."""
    config = AveragingConfig(clip_multiple=0.0, subframe_elements=500)
    a, b = await start_peers(2, config)
    try:
        rng = np.random.default_rng(11)
        va, vb = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
        assignment = assign([a, b], [1, 1], deadline_s=8)
        leaving = asyncio.ensure_future(a.averager.allreduce(assignment, va, 1.0))
        key = f"{assignment.round_id}/grad"
        await until(lambda: key in a.averager.owner.rounds, 10, "a's round")
        leaving.cancel()  # a leaves: its round is given up with its part unreduced
        with pytest.raises(asyncio.CancelledError):
            await leaving
        status, text = await post_part(b, a, assignment, 0, b"", weight="1.0", elements="0")
        assert status == 503 and "was not reduced" in text
        result = await b.averager.allreduce(assignment, vb, 1.0)
        assert not result.late and 0 in result.failed_parts
    finally:
        for p in (a, b):
            await p.stop()


@pytest.mark.parametrize("how", ["server_stopped", "never_called"])
async def test_dead_part_owner_makes_senders_keep_local_values(how):
    config = AveragingConfig(clip_multiple=0.0, assignment_wait_s=0.5, connect_timeout_s=1.0)
    peers = await start_peers(3, config)
    try:
        rng = np.random.default_rng(10)
        vectors = [rng.standard_normal(N).astype(np.float32) for _ in peers]
        weights = [1, 1, 1]
        assignment = assign(peers, weights, deadline_s=2.0)
        if how == "server_stopped":
            await peers[2].stop()
        live = peers[:2]
        results = await run_round(live, assignment, vectors[:2], weights[:2])
        bounds = part_bounds(N, 3)
        mean2 = weighted_mean(vectors[:2], [1, 1])
        for r, own in zip(results, vectors[:2], strict=True):
            assert r.failed_parts == (2,)
            assert "p2" in r.reasons["part 2"]
            a, b = bounds[2]
            np.testing.assert_array_equal(r.values[a:b], own[a:b])
            np.testing.assert_allclose(r.values[: bounds[1][1]], mean2[: bounds[1][1]], rtol=1e-6, atol=1e-6)
            assert r.dropped == ("p2",)
        done = [e for e in peers[0].events if isinstance(e, RoundDone)]
        assert done[-1].failed_parts == (2,) and done[-1].dropped == ("p2",)
    finally:
        for p in peers:
            await p.stop()


async def test_a_member_that_sends_after_the_parts_closed_learns_its_values_are_not_the_groups():
    """Issue 27: p2 got its assignment and fell asleep before sending anything (its server holds the others'
    copies of its part unanswered, as a stopped process's kernel does). p0 and p1 close their parts at the
    deadline without p2's copy and keep their own values of p2's part (the engine zeroes them, as every member
    that lost it does). Waking (its own signed copy of the assignment gives it a later deadline here, so its
    call starts), p2's copies are refused with 410: its result says it came late, and the engine catches up
    instead of applying values that are not the group's."""
    config = AveragingConfig(clip_multiple=0.0, assignment_wait_s=60.0, grace_s=0.5)
    peers = await start_peers(3, config)
    try:
        rng = np.random.default_rng(27)
        vectors = [rng.standard_normal(N).astype(np.float32) for _ in peers]
        assignment = assign(peers, [1, 1, 1], deadline_s=1.0)
        results = await asyncio.wait_for(run_round(peers[:2], assignment, vectors[:2], [1, 1]), 10.0)
        for r, own in zip(results, vectors[:2], strict=True):
            assert r.failed_parts == (2,) and r.dropped == ("p2",) and not r.late
            start = part_bounds(N, 3)[2][0]
            np.testing.assert_array_equal(r.values[start:], own[start:])
        later = sign_assignment(TRACKER, replace(assignment, deadline=time.time() + 30.0, signature=""))
        woke = await asyncio.wait_for(peers[2].averager.allreduce(later, vectors[2], 1.0), 20.0)
        assert woke.late and woke.failed_parts == (0, 1)
        assert all("410" in woke.reasons[f"part {j}"] for j in (0, 1))
    finally:
        for p in peers:
            await p.stop()


async def test_invalid_assignment_fails_the_round_with_a_sentence():
    config = AveragingConfig(clip_multiple=0.0)
    (p,) = await start_peers(1, config)
    try:
        good = assign([p], [1])
        forged = replace(good, deadline=good.deadline + 100)
        with pytest.raises(AveragingError, match="not the tracker's"):
            await p.averager.allreduce(forged, np.zeros(10, np.float32), 1.0)
        with pytest.raises(AveragingError, match=r"weight 2\.0 must be between 0 and the assigned 1"):
            await p.averager.allreduce(good, np.zeros(10, np.float32), 2.0)
        with pytest.raises(AveragingError, match="flat float32"):
            await p.averager.allreduce(good, np.zeros(10, np.float64), 1.0)
        assert [type(e) for e in p.events] == [RoundFailed] * 3
        result = await p.averager.allreduce(good, np.arange(10, dtype=np.float32), 1.0)
        np.testing.assert_array_equal(result.values, np.arange(10, dtype=np.float32))
        with pytest.raises(AveragingError, match="already run"):
            await p.averager.allreduce(good, np.zeros(10, np.float32), 1.0)
    finally:
        await p.stop()


async def test_abandoned_round_answers_waiting_senders_at_once(trio):
    a, h, m = trio
    rng = np.random.default_rng(11)
    va, vh = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
    assignment = assign([a, h, m], [3, 2, 4], [0, -1, -1], deadline_s=60.0)
    owner = asyncio.create_task(a.averager.allreduce(assignment, va, 3.0))
    sender = asyncio.create_task(h.averager.allreduce(assignment, vh, 2.0))
    await received(a, assignment, "h")
    owner.cancel()  # e.g. Ctrl-C on the owner while m never sends: h must not wait for the deadline
    with pytest.raises(asyncio.CancelledError):
        await owner
    result = await sender  # at once, its only part failed: it keeps its own values
    assert result.failed_parts == (0,)
    assert "503" in result.reasons["part 0"] and "abandoned" in result.reasons["part 0"]
    np.testing.assert_array_equal(result.values, vh)
    assert time.time() < assignment.deadline
    # RoundFailed means a round that could not start; this one ran and lists its failed part
    assert isinstance(h.events[-1], RoundDone) and h.events[-1].failed_parts == (0,)


async def test_a_sender_that_hangs_up_before_its_answer_costs_the_owner_nothing(trio, caplog):
    """m sends its whole copy and hangs up while the owner still waits for h: the owner counts m's copy,
    answers h, and its server logs no error for the answer it could not send."""
    a, h, _ = trio
    (va, vh, vm), assignment, owner, hangs_up = m_sends_to_a(trio, 12)
    await received(a, assignment, "m")
    hangs_up.cancel()  # its connection closes while its answer waits for h's copy
    with pytest.raises(asyncio.CancelledError):
        await hangs_up
    await asyncio.sleep(0.1)
    result = await h.averager.allreduce(assignment, vh, 2.0)
    mean = weighted_mean([va, vh, vm], [3, 2, 4])
    np.testing.assert_allclose(result.values, mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose((await owner).values, mean, rtol=1e-6, atol=1e-6)
    await asyncio.sleep(0.1)  # the handler of m's request writes (or fails to write) its answer
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_a_second_copy_after_the_part_closed_is_a_duplicate_when_the_first_counted():
    """The poison test's hostile sent every part twice at once; when its first copy was the last one in, the
    part closed before the second began and the owner answered 410 (too late): its sender took itself for
    left out of a round its copy was in, and fetched the state (3 of 16 steps lost, 1 run in 7). A second copy
    of a counted one is a duplicate (409) whenever it comes; a copy that never counted is still too late."""
    from crowdtrain.volunteer.averaging.reducer import Contribution, PartReducer

    red = PartReducer(0, 4, ("a", "b", "c"), 0.0, owner="a")
    for peer in ("a", "b"):
        assert red.begin(peer) == "ok"
        assert red.accept(Contribution(peer, 1.0, np.ones(4, np.float32), 2.0))
    red.close(np.empty(4, np.float32))
    assert red.begin("b") == "duplicate" and "b" in red.duplicates  # (409: its copy is in the mean)
    assert red.begin("c") == "closed"  # (410: the others averaged without it)
