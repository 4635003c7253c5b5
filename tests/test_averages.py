"""Averages kept for peers that missed a few steps (issue 27; ``volunteer/averaging/averages.py``): kept as
applied, within a byte budget, served to signed run members, and taken only where two peers sent the same
bytes. Real averagers behind real HTTP servers on 127.0.0.1:0 (``tests/test_allreduce.py``'s peers)."""

from __future__ import annotations

import asyncio

import numpy as np

from crowdtrain.protocol.credentials import SigningKey, issue_credential
from crowdtrain.protocol.messages import Donor
from crowdtrain.volunteer.averaging import AveragingConfig
from crowdtrain.volunteer.averaging.averages import ABSENT, KEEP_BYTES, KEEP_STEPS, AverageLog, fetch_average
from tests.test_allreduce import RUN, TRACKER, start_peers

N = 5_000


def donor(peer) -> Donor:
    return Donor(peer_id=peer.peer_id, address=peer.address, public_key=peer.key.public_hex)


def test_the_log_keeps_the_last_steps_and_none_of_a_model_beyond_its_byte_budget():
    log = AverageLog(RUN, TRACKER.public_hex)
    for step in range(10):
        kept = log.copy(np.full(8, step, np.float32))
        assert kept is not None
        log.applied(step, kept, None)
    assert log.steps() == list(range(10 - KEEP_STEPS, 10))
    log.forget_from(8)
    assert log.steps() == list(range(10 - KEEP_STEPS, 8))
    big = AverageLog(RUN, TRACKER.public_hex)
    assert big.copy(np.zeros(KEEP_BYTES // 4 + 1, np.float32)) is None  # (calloc'd: nothing is touched)
    assert big.keep == 0 and big.steps() == []


async def test_an_average_is_taken_only_where_two_peers_sent_the_same_bytes():
    peers = await start_peers(3, AveragingConfig(clip_multiple=0.0), prefix="d")
    key = SigningKey()
    credential = issue_credential(TRACKER, RUN, "late", key.public_hex, 3600)
    try:
        rng = np.random.default_rng(27)
        mean, params = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
        for p in peers[:2]:
            log = p.averager.averages
            log.applied(5, log.copy(mean), params)
        liar = peers[2].averager.averages
        liar.applied(5, liar.copy(mean + np.float32(1e-3)), None)  # one that lies (or diverged)
        original = mean.copy()
        mean += 1.0  # (the kept one is a copy: applying an average clips and zeroes its buffer)
        honest, both = [donor(p) for p in peers[:2]], [donor(peers[0]), donor(peers[2])]
        np.testing.assert_array_equal(await fetch_average(honest, 5, "grad", N, key, credential), original)
        np.testing.assert_array_equal(await fetch_average(honest, 5, "params", N, key, credential), params)
        assert await fetch_average(both, 5, "grad", N, key, credential) is None  # they differ
        # one keeps them and one does not (yet: the step's round may be under way there): ask again later
        assert await fetch_average(both, 5, "params", N, key, credential) == ABSENT
        # both keep none: of a step they did not apply, or parameters they did not average (they kept theirs)
        assert await fetch_average(honest, 6, "grad", N, key, credential) == ABSENT
        assert await fetch_average([donor(peers[2])] * 2, 5, "params", N, key, credential) == ABSENT
        assert await fetch_average(honest, 5, "grad", N + 1, key, credential) is None  # another model's size
        # a donor asleep itself (its kernel takes the connection, nothing answers) holds nothing up
        held: list[asyncio.StreamWriter] = []
        asleep = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)
        port = asleep.sockets[0].getsockname()[1]
        sleeper = Donor(peer_id="zz", address=f"127.0.0.1:{port}", public_key=key.public_hex)
        got = await asyncio.wait_for(fetch_average([sleeper, *honest], 5, "grad", N, key, credential), 10.0)
        np.testing.assert_array_equal(
            got, original
        )  # (FETCH_TIMEOUT_S is 30 s: the sleeper was not waited for)
        asleep.close()
        for w in held:
            w.close()
        stranger = issue_credential(SigningKey(), RUN, "late", key.public_hex, 3600)  # another tracker's
        assert await fetch_average(honest, 5, "grad", N, key, stranger) is None
    finally:
        for p in peers:
            await p.stop()
