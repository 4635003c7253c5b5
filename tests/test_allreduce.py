"""Group all-reduce over real aiohttp servers on 127.0.0.1:0: exactness, client mode, lossy codecs.

Assignments are signed and credentials issued with a tracker key made here (the real issuer code); every
peer is a real Averager behind a real HTTP server, all in this test process.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crowdtrain.protocol.codecs import Codec
from crowdtrain.protocol.credentials import SigningKey, issue_credential, sign_assignment
from crowdtrain.protocol.errors import AveragingError
from crowdtrain.protocol.messages import GroupAssignment, GroupMember
from crowdtrain.volunteer.averaging import Averager, AveragingConfig, part_bounds
from crowdtrain.volunteer.events import Event, RoundDone
from crowdtrain.volunteer.spotcheck import squares

TRACKER = SigningKey()
RUN = "run-allreduce"
_round_ids = itertools.count()


@dataclass
class Peer:
    peer_id: str
    key: SigningKey
    averager: Averager
    runner: web.AppRunner | None
    address: str | None
    events: list[Event] = field(default_factory=list)

    async def stop(self) -> None:
        await self.averager.close()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def start_peer(
    peer_id: str, config: AveragingConfig, *, serve: bool = True, middlewares: tuple = ()
) -> Peer:
    key = SigningKey()
    credential = issue_credential(TRACKER, RUN, peer_id, key.public_hex, 3600)
    events: list[Event] = []
    averager = Averager(
        run_id=RUN,
        tracker_public_key=TRACKER.public_hex,
        peer_id=peer_id,
        key=key,
        credential=credential,
        config=config,
        emit=events.append,
    )
    runner = address = None
    if serve:
        app = web.Application(middlewares=middlewares)
        app.add_routes(averager.routes())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        address = f"127.0.0.1:{runner.addresses[0][1]}"
    return Peer(peer_id, key, averager, runner, address, events)


async def start_peers(n: int, config: AveragingConfig, prefix: str = "p") -> list[Peer]:
    return [await start_peer(f"{prefix}{i}", config) for i in range(n)]


def assign(
    peers: list[Peer],
    weights: list[int],
    parts: list[int] | None = None,
    *,
    deadline_s: float = 30.0,
    round_id: str | None = None,
    part_weights: list[int] | None = None,
) -> GroupAssignment:
    """A tracker-signed assignment; ``parts[i]`` is peer i's part (-1: client mode); default one each."""
    parts = list(range(len(peers))) if parts is None else parts
    members = [
        GroupMember(
            peer_id=p.peer_id,
            address=p.address if part >= 0 else None,
            public_key=p.key.public_hex,
            weight=w,
            part=part,
        )
        for p, w, part in zip(peers, weights, parts, strict=True)
    ]
    unsigned = GroupAssignment(
        run_id=RUN,
        round_id=round_id or f"r{next(_round_ids)}",
        step=7,
        members=members,
        parts=sum(1 for part in parts if part >= 0),
        average_params=False,
        deadline=time.time() + deadline_s,
        seed=0,
        signature="",
        part_weights=part_weights or [],
    )
    return sign_assignment(TRACKER, unsigned)


def weighted_mean(vectors: list[np.ndarray], weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() == 0:
        w = np.ones_like(w)
    stacked = np.stack([v.astype(np.float64) for v in vectors])
    return (w[:, None] * stacked).sum(axis=0) / w.sum()


def fp32_sum_error_bound(vectors: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """How far a float32 weighted mean of these vectors may honestly be from the exact one, per value.

    Summing g scaled terms in float32 errs by at most about (g + 2) · eps · Σ|w_i · x_i| / Σw (each addition
    and scaling rounds once); a tolerance relative to the *result* fails where the terms cancel (weights
    [0,1,1,0,2,5,1,1] gave 0.0026942492 for 0.0026942790: 1e-5 relative, 3e-8 absolute)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() == 0:
        w = np.ones_like(w)
    magnitude = (w[:, None] * np.abs(np.stack([v.astype(np.float64) for v in vectors]))).sum(axis=0) / w.sum()
    return (len(vectors) + 2) * float(np.finfo(np.float32).eps) * magnitude


async def run_round(peers, assignment, vectors, weights, **kw):
    return await asyncio.gather(
        *(
            p.averager.allreduce(assignment, v, float(w), **kw)
            for p, v, w in zip(peers, vectors, weights, strict=True)
        )
    )


# ------------------------------------------------------------------ exactness (property over real servers)


def test_codec_none_gives_the_exact_weighted_mean_for_groups_of_1_to_8():
    """Property over real servers (reused across examples): sizes 1–8, uneven parts, weights with 0."""
    config = AveragingConfig(codec=Codec.NONE, clip_multiple=0, subframe_elements=16)
    loop = asyncio.new_event_loop()
    peers = loop.run_until_complete(start_peers(8, config))

    def one_round(
        g: int, n: int, weights: list[int], owners: list[bool], order: list[int], seed: int
    ) -> None:
        parts, it = [], iter(order)
        for owns in owners:
            parts.append(next(it) if owns else -1)
        rng = np.random.default_rng(seed)
        members = peers[:g]
        vectors = [rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 10) for _ in members]
        assignment = assign(members, weights, parts)
        results = loop.run_until_complete(run_round(members, assignment, vectors, weights))
        expected = weighted_mean(vectors, weights)
        for r in results:
            assert r.failed_parts == () and r.dropped == () and r.rejected == ()
            assert r.values.dtype == np.float32
            error = np.abs(r.values.astype(np.float64) - expected)
            bound = fp32_sum_error_bound(vectors, weights)
            assert (error <= bound).all(), (
                f"worst {error.max():.3g} where the bound is {bound[error.argmax()]:.3g}"
            )
            np.testing.assert_array_equal(
                r.values, results[0].values
            )  # the whole group holds the same numbers

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def check(data):
        g = data.draw(st.integers(1, 8), label="group size")
        n = data.draw(st.integers(1, 200), label="values")
        weights = data.draw(st.lists(st.integers(0, 6), min_size=g, max_size=g), label="weights")
        owners = data.draw(st.lists(st.booleans(), min_size=g, max_size=g), label="owns a part")
        if not any(owners):
            owners[0] = True
        order = data.draw(st.permutations(range(sum(owners))), label="part order")
        one_round(g, n, weights, owners, list(order), data.draw(st.integers(0, 2**16), label="seed"))

    try:
        for g in range(1, 9):  # every size at least once, whatever hypothesis draws
            weights = [0 if i % 3 == 1 else i + 1 for i in range(g)]
            one_round(g, 37 * g + 5, weights, [True] * g, list(reversed(range(g))), g)
        one_round(4, 50, [0, 0, 0, 0], [True, False, True, True], [2, 0, 1], 9)  # all weights 0: plain mean
        check()
    finally:
        for p in peers:
            loop.run_until_complete(p.stop())
        loop.close()


def test_part_bounds_are_contiguous_and_even():
    for n, parts in [(10, 3), (3, 5), (1, 1), (1000003, 7)]:
        bounds = part_bounds(n, parts)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1


def test_part_bounds_follow_part_weights_and_every_member_cuts_the_same():
    assert part_bounds(800, 3, [1, 3, 4]) == [(0, 100), (100, 400), (400, 800)]
    for n, weights in [(10, [5, 1]), (1_000_003, [65000, 700, 1, 12]), (3, [1, 1, 1, 1])]:
        bounds = part_bounds(n, len(weights), weights)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in itertools.pairwise(bounds))
        for (a, b), w in zip(bounds, weights, strict=True):
            assert abs((b - a) - n * w / sum(weights)) <= 1
    with pytest.raises(ValueError):
        part_bounds(10, 3, [1, 2])
    with pytest.raises(ValueError):
        part_bounds(10, 2, [1, 0])


async def test_parts_of_unequal_sizes_give_the_exact_mean_and_each_peer_measures_its_upload():
    """The tracker's part weights (here 6:1:1) cut the vector for every member alike: the mean is exact, the
    big part's owner answers 6× what the others do, and each owner measures the rate its answers went out at."""
    config = AveragingConfig(codec=Codec.NONE, clip_multiple=0, subframe_elements=1 << 14)
    peers = await start_peers(3, config)
    try:
        rng = np.random.default_rng(3)
        n = 240_000
        vectors = [rng.standard_normal(n).astype(np.float32) for _ in peers]
        weights = [2, 3, 5]
        a = assign(peers, weights, part_weights=[6, 1, 1])
        results = await run_round(peers, a, vectors, weights)
        for r in results:
            np.testing.assert_allclose(r.values, weighted_mean(vectors, weights), rtol=1e-6, atol=1e-6)
        sizes = [b - s for s, b in part_bounds(n, 3, [6, 1, 1])]
        assert sizes == [180_000, 30_000, 30_000]
        # each member sends its copies of the two other parts and answers its own part to the two others
        for i, r in enumerate(results):
            assert r.raw_bytes == 4 * (n - sizes[i]) + 2 * 4 * sizes[i]
        # (taken once the answers are acknowledged, which may be just after the round returned)
        for _ in range(500):
            if all(p.averager.upload_bps for p in peers):
                break
            await asyncio.sleep(0.01)
        assert all(p.averager.upload_bps is not None and p.averager.upload_bps > 0 for p in peers)
    finally:
        for p in peers:
            await p.stop()


async def test_an_assignment_whose_part_weights_do_not_match_its_parts_is_refused():
    config = AveragingConfig(clip_multiple=0.0, codec=Codec.NONE)
    peers = await start_peers(2, config)
    try:
        a = assign(peers, [1, 1], part_weights=[1, 2, 3])
        v = np.ones(100, np.float32)
        with pytest.raises(AveragingError, match="weighs 3 parts, not 2"):
            await peers[0].averager.allreduce(a, v, 1.0)
    finally:
        for p in peers:
            await p.stop()


async def test_client_mode_member_sends_and_receives_the_mean_and_the_event_says_so():
    config = AveragingConfig(clip_multiple=0.0, subframe_elements=1000)
    peers = await start_peers(2, config)
    client = await start_peer("nat", config, serve=False)
    members = [*peers, client]
    try:
        rng = np.random.default_rng(1)
        vectors = [rng.standard_normal(4099).astype(np.float32) for _ in members]
        weights = [3, 0, 5]
        results = await run_round(members, assign(members, weights, [1, 0, -1]), vectors, weights)
        expected = weighted_mean(vectors, weights)
        for r in results:
            np.testing.assert_allclose(r.values, expected, rtol=1e-6, atol=1e-6)
        assert results[2].my_part == -1
        done = [e for e in client.events if isinstance(e, RoundDone)]
        assert len(done) == 1 and done[0].my_part == -1 and done[0].kind == "grad"
        assert done[0].raw_bytes == 4 * 4099 and 0 < done[0].bytes_sent and done[0].failed_parts == ()
        # the weight-0 member sends no values but still gets the average
        (a, b) = part_bounds(4099, 2)[0]
        assert results[1].raw_bytes == 2 * 4 * (b - a)  # it sends nothing and answers the two others
    finally:
        for p in members:
            await p.stop()


async def test_two_rounds_on_one_assignment_with_tags():
    config = AveragingConfig(clip_multiple=0.0)
    peers = await start_peers(3, config)
    try:
        rng = np.random.default_rng(2)
        grads = [rng.standard_normal(777).astype(np.float32) for _ in peers]
        params = [rng.standard_normal(777).astype(np.float32) for _ in peers]
        assignment = assign(peers, [1, 2, 3])
        r1 = await run_round(peers, assignment, grads, [1, 2, 3], tag="grad")
        r2 = await run_round(peers, assignment, params, [1, 2, 3], tag="params")
        np.testing.assert_allclose(r1[0].values, weighted_mean(grads, [1, 2, 3]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r2[2].values, weighted_mean(params, [1, 2, 3]), rtol=1e-6, atol=1e-6)
        assert r2[0].round_key == f"{assignment.round_id}/params"
    finally:
        for p in peers:
            await p.stop()


# ------------------------------------------------------------------ stored parts (codec none, dense values)


async def test_dense_parts_travel_stored_with_a_length_and_sparse_ones_compressed_and_the_mean_is_exact():
    """Large parts take two paths: dense fp32 goes stored with a Content-Length (straight from memory), a
    part with many zeros goes zstd in chunks. Mixed in one group, over two rounds that reuse the receive
    buffers and the result buffer, the mean stays exact and the group equal."""
    seen: list[tuple[str, str, bool, bool]] = []  # (owner, sender, request chunked, answer chunked)
    weights = [2, 0, 5, 1]
    by_weight = {repr(float(w)): f"big{i}" for i, w in enumerate(weights)}  # each sender's weight differs

    def recorder(owner: str):
        @web.middleware
        async def record(request: web.Request, handler):
            response = await handler(request)
            sender = by_weight.get(request.headers.get("X-Crowdtrain-Weight", ""), "")
            chunked = "chunked" in request.headers.get("Transfer-Encoding", "")
            answer_chunked = "chunked" in response.headers.get("Transfer-Encoding", "")
            seen.append((owner, sender, chunked, answer_chunked))
            return response

        return record

    config = AveragingConfig(codec=Codec.NONE, clip_multiple=0, subframe_elements=30_000)
    peers = [await start_peer(f"big{i}", config, middlewares=(recorder(f"big{i}"),)) for i in range(4)]
    n = 4 * 70_000 + 3  # parts of ~280 KB: judged on a sample; sub-frames of uneven sizes
    outs = [np.empty(n, np.float32) for _ in peers]
    try:
        for round_no in range(2):
            rng = np.random.default_rng(round_no)
            vectors = [rng.standard_normal(n).astype(np.float32) for _ in peers]
            vectors[3][rng.random(n) < 0.9] = 0.0  # big3's values are 90 % zeros: zstd pays
            assignment = assign(peers, weights)
            results = await asyncio.gather(
                *(
                    p.averager.allreduce(assignment, v, float(w), out=o)
                    for p, v, w, o in zip(peers, vectors, weights, outs, strict=True)
                )
            )
            expected = weighted_mean(vectors, weights)
            for r, o in zip(results, outs, strict=True):
                assert r.values is o and r.failed_parts == () and r.rejected == ()
                np.testing.assert_allclose(r.values, expected, rtol=2e-6, atol=2e-6 * np.abs(expected).max())
                np.testing.assert_array_equal(r.values, results[0].values)
    finally:
        for p in peers:
            await p.stop()
    ids = {p.peer_id for p in peers}
    assert len(seen) == 2 * 4 * 3
    for owner, sender, request_chunked, answer_chunked in seen:
        assert sender in ids and sender != owner
        if sender == "big1":  # weight 0: sends no values at all
            assert not request_chunked
        else:
            assert request_chunked == (sender == "big3"), (owner, sender)
        assert answer_chunked == (owner == "big3"), owner  # the answer follows the owner's own copy


async def test_a_result_buffer_that_does_not_fit_is_refused_with_a_sentence():
    peers = await start_peers(2, AveragingConfig(clip_multiple=0.0), prefix="out-")
    try:
        v = np.ones(10, np.float32)
        with pytest.raises(
            AveragingError, match="out must be flat float32 of 10 values, the vector itself or apart from it"
        ):
            await peers[0].averager.allreduce(assign(peers, [1, 1]), v, 1.0, out=np.empty(9, np.float32))
        with pytest.raises(AveragingError, match="the vector itself or apart from it"):
            await peers[0].averager.allreduce(assign(peers, [1, 1]), v, 1.0, out=v[:])  # overlaps, not v
    finally:
        for p in peers:
            await p.stop()


@pytest.mark.parametrize("codec", [Codec.NONE, Codec.INT8])
async def test_averaging_in_place_gives_bit_for_bit_what_averaging_into_another_buffer_gives(codec):
    # In place, each peer's vector is overwritten with the mean while the round runs: a part owner reduces
    # its part slice by slice (several sub-frames here) over its own copy, which is one of the terms and not
    # always the first. The engine averages every step's gradient this way (no buffer of the model's size).
    config = AveragingConfig(clip_multiple=0.0, codec=codec, subframe_elements=1000)
    peers = await start_peers(4, config, prefix=f"inplace-{codec.label}-")
    try:
        rng = np.random.default_rng(5)
        vectors = [rng.standard_normal(10_007).astype(np.float32) for _ in peers]
        weights = [3, 1, 2, 5]
        assignment = assign(peers, weights)
        apart = await run_round(peers, assignment, vectors, weights, tag="apart")
        copies = [v.copy() for v in vectors]
        in_place = await asyncio.gather(
            *(
                p.averager.allreduce(assignment, c, float(w), tag="inplace", out=c)
                for p, c, w in zip(peers, copies, weights, strict=True)
            )
        )
        for a, r, c in zip(apart, in_place, copies, strict=True):
            assert r.values is c and r.failed_parts == ()
            np.testing.assert_array_equal(c, a.values)
    finally:
        for p in peers:
            await p.stop()


# ------------------------------------------------------------------ lossy codecs


@pytest.mark.parametrize(
    ("codec", "tolerance"), [(Codec.FP16, 2e-3), (Codec.BF16, 1.6e-2), (Codec.INT8, 3e-2)]
)
async def test_lossy_codecs_stay_within_tolerance_and_the_group_agrees(codec, tolerance):
    config = AveragingConfig(clip_multiple=0.0, codec=codec, subframe_elements=5000)
    peers = await start_peers(3, config)
    try:
        rng = np.random.default_rng(3)
        vectors = [rng.standard_normal(20011).astype(np.float32) for _ in peers]
        weights = [2, 1, 4]
        results = await run_round(peers, assign(peers, weights), vectors, weights)
        expected = weighted_mean(vectors, weights)
        scale = np.abs(expected).max()
        for r in results:
            assert np.abs(r.values - expected).max() <= tolerance * scale
            np.testing.assert_array_equal(r.values, results[0].values)
            assert r.bytes_sent < r.raw_bytes  # compression happened
    finally:
        for p in peers:
            await p.stop()


async def test_int8_error_feedback_makes_the_running_sum_converge():
    config = AveragingConfig(clip_multiple=0.0, codec=Codec.INT8)
    peers = await start_peers(3, config)
    try:
        rng = np.random.default_rng(4)
        vectors = [rng.standard_normal(9000).astype(np.float32) for _ in peers]
        weights = [1, 1, 1]
        expected = weighted_mean(vectors, weights)
        rounds = 24
        total = np.zeros_like(expected)
        first_error = None
        assignment_parts = [0, 1, 2]
        for _ in range(rounds):
            results = await run_round(peers, assign(peers, weights, assignment_parts), vectors, weights)
            total += results[0].values
            if first_error is None:
                first_error = np.abs(results[0].values - expected).max()
        drift = np.abs(total / rounds - expected).max()
        # the senders' error feedback spreads their rounding out; the answers carry none (issue 48: an answer's
        # rounding is its own, which its receipt bounds), so what is left is one answer's rounding, not more:
        # at most half a step of the answer's block (absmax / 127 / 2), never growing with the rounds
        step = np.abs(expected).max() / 127
        assert first_error > 0
        assert drift <= step / 2 + first_error / 5, (drift, first_error, step)
    finally:
        for p in peers:
            await p.stop()


async def test_sparse_error_feedback_loses_nothing_when_parts_change_owners():
    """Sparse sends 8 values of 256 a round: the senders' and the part owners' residuals hold the rest. Parts
    change owners from round to round (groups are re-drawn), and what an owner held back of a part must
    still reach the group later: after every round, what the group received plus every residual left is
    exactly the rounds' true means (int8 could drop an owner's residual when its part moved: under half a
    quantisation step; sparse would drop most of the update)."""
    config = AveragingConfig(codec=Codec.SPARSE, clip_multiple=0.0)
    peers = await start_peers(3, config)
    try:
        rng = np.random.default_rng(5)
        vectors = [rng.standard_normal(3000).astype(np.float32) for _ in peers]
        weights = [1, 1, 1]
        mean = weighted_mean(vectors, weights)
        received = np.zeros_like(mean)
        for r in range(1, 13):
            parts = [(i + r) % 3 for i in range(3)]  # each part has a new owner every round
            results = await run_round(peers, assign(peers, weights, parts), vectors, weights)
            for res in results[1:]:
                np.testing.assert_array_equal(res.values, results[0].values)
            received += results[0].values
            ups = np.stack([p.averager.sender._residuals["grad"].values() for p in peers])
            downs = np.stack([p.averager.owner._down_residuals["grad"][1].values() for p in peers])
            held = ups.mean(axis=0) + downs.sum(axis=0)
            # (float32 sums over rounds; each residual is kept as bfloat16, within 2^-8 of itself each round)
            tolerance = 1e-4 * r + 2**-8 * r * (np.abs(ups).mean(axis=0) + np.abs(downs).sum(axis=0))
            assert np.all(np.abs(received + held - r * mean) <= tolerance), f"round {r}"
    finally:
        for p in peers:
            await p.stop()


async def test_a_kept_copy_is_its_values_when_they_are_far_smaller_than_its_senders_last_ones():
    """Issue 51, point 3: two members swap parts, as two volunteers' parts of a step often do. p1 sends part 0
    with large values, owns it a round (its residual of those values waits), then sends it with values
    1000x smaller (a gradient after a spike, or early in training, shrinks that fast). Its residual, half a
    step of the large values' blocks, was added whole: the copy its owner kept for a spot-check was that old
    rounding error, ~8x the values' norm away from them (two volunteers: honest checks 0.99 and 9.7 apart;
    two mismatches bar a key). An encode adds at most half a step of the values' own blocks."""
    config = AveragingConfig(clip_multiple=0.0, codec=Codec.INT8)
    peers = await start_peers(2, config)
    try:
        rng = np.random.default_rng(51)
        size, weights = 20000, [1, 1]
        early = [10 * rng.standard_normal(size).astype(np.float32) for _ in peers]
        late = [0.01 * rng.standard_normal(size).astype(np.float32) for _ in peers]
        await run_round(peers, assign(peers, weights, [0, 1]), early, weights)  # p1 sends part 0: big values
        await run_round(peers, assign(peers, weights, [1, 0]), early, weights)  # p1 owns part 0
        checked = assign(peers, weights, [0, 1])  # p1 sends part 0 again: small values
        peers[0].averager.wanted[checked.round_id] = (peers[1].peer_id, asyncio.Event())
        await run_round(peers, checked, late, weights)
        a, b, copy = peers[0].averager.kept.pop(checked.round_id)
        sent = np.concatenate(
            [copy.values(x, min(x + copy.step, copy.length)) for x in range(0, b - a, copy.step)]
        )
        truth = late[1][a:b]
        # what the checker measures (volunteer/spotcheck.py): beyond a step of each value's block, ÷ ‖truth‖;
        # honest copies were within 0.34, its tolerance is 0.5, and a copy of other data is ~1 to 1.3 away
        sums = squares(sent, truth, "int8")
        assert np.sqrt(sums[2] / sums[0]) <= 0.05, np.sqrt(sums[2] / sums[0])
    finally:
        for p in peers:
            await p.stop()


def test_averaging_does_not_import_torch_or_rich():
    code = "import sys, crowdtrain.volunteer.averaging; print(sorted({'torch', 'rich'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


async def test_declared_weights_below_the_assignment_are_used_and_early_requests_wait_for_the_owner():
    config = AveragingConfig(clip_multiple=0.0)
    peers = await start_peers(3, config)
    try:
        rng = np.random.default_rng(12)
        vectors = [rng.standard_normal(5000).astype(np.float32) for _ in peers]
        assignment = assign(peers, [4, 4, 4])
        declared = [1.0, 3.0, 0.0]
        early = [
            asyncio.create_task(p.averager.allreduce(assignment, v, w))
            for p, v, w in zip(peers[:2], vectors[:2], declared[:2], strict=True)
        ]
        await asyncio.sleep(0.3)  # the others' copies of p2's part reach p2 before p2 has the assignment
        last = await peers[2].averager.allreduce(assignment, vectors[2], declared[2])
        results = [*(await asyncio.gather(*early)), last]
        expected = weighted_mean(vectors, declared)
        for r in results:
            assert r.failed_parts == () and r.dropped == ()
            np.testing.assert_allclose(r.values, expected, rtol=1e-6, atol=1e-6)
    finally:
        for p in peers:
            await p.stop()
