"""Collaborative steps and matchmaking through a real tracker: when a step closes, who gets which group,
late and absent peers, and the durable step history."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import verify_assignment
from crowdtrain.protocol.errors import TrackerError
from crowdtrain.protocol.messages import AveragingSpec, RunSpec
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.peers import Peer, Share
from crowdtrain.tracker.policy import answer_wait
from crowdtrain.tracker.server import serve
from tests.harness import until
from tests.sim import PingServer, SimVolunteer, make_run_create


@pytest.fixture
def client(admin):
    """The conftest ``admin`` client: every test here speaks as the run's admin and its peers."""
    return admin


async def new_run(client, target=100, **averaging):
    spec = make_run_create(target_batch_size=target, averaging=AveragingSpec(**averaging))
    return (await client.create_run(spec)).run_id


_serving: list[SimVolunteer] = []


@pytest.fixture(autouse=True)
async def _close_ping_servers():
    yield
    while _serving:
        await _serving.pop().close()


async def joined(client, run_id, n, *, reachable=True):
    """n joined peers; reachable ones answer the tracker's check (and are verified before this returns)."""
    peers = [SimVolunteer(client, run_id) for _ in range(n)]
    for v in peers:
        if reachable:
            _serving.append(v)
            await v.serve()
        await v.join()
    if reachable:
        for v in peers:
            await v.wait_reachable()
    return peers


async def test_step_closes_at_the_target_and_ready_peers_get_signed_groups(tracker, client):
    run_id = await new_run(client, target=30, group_size=4, average_state_every=1, gather_s=5.0)
    peers = await joined(client, run_id, 3)
    assert (await peers[0].heartbeat(0, 10)).step_closed is False
    assert (await peers[1].heartbeat(0, 10)).step_closed is False
    reply = await peers[2].heartbeat(0, 10)
    assert (reply.samples, reply.step_closed, reply.eta_s) == (30, True, 0.0)
    replies = await asyncio.gather(*(v.ready(0, 10 + i) for i, v in enumerate(peers)))
    assert [r.status for r in replies] == ["group"] * 3
    a = replies[0].assignment
    assert all(r.assignment == a for r in replies)
    verify_assignment(a, tracker.public_key)
    assert a.step == 0 and a.run_id == run_id
    assert sorted((m.peer_id, m.weight) for m in a.members) == sorted(
        (v.peer_id, 10 + i) for i, v in enumerate(peers)
    )
    assert sorted(m.part for m in a.members) == [0, 1, 2]  # all reachable: each owns a part
    assert all(m.address.startswith("127.0.0.1:") for m in a.members)  # ":PORT" at the host it came from
    assert a.parts == 3
    assert a.average_params is True  # (0 + 1) % 1 == 0
    status = await client.status(run_id)
    assert status.global_step == 1
    assert status.samples == 0  # nobody heartbeated step 1 yet
    [record] = status.recent_steps
    # credited with the weights the ready peers averaged (10 + 11 + 12), not the heartbeats' 30
    assert (record.step, record.samples, record.peers, record.groups, record.seed) == (0, 33, 3, 1, a.seed)
    async with aiohttp.ClientSession() as s, s.get(tracker.url + "/metrics") as r:
        metrics = await r.text()
    assert "crowdtrain_tracker_steps_total 1.0" in metrics
    assert "crowdtrain_tracker_round_size_count 1.0" in metrics
    assert "crowdtrain_tracker_round_size_sum 3.0" in metrics
    assert "crowdtrain_tracker_peers_online 3.0" in metrics


@pytest.mark.parametrize("part_sizes", ["upload", "equal"])
async def test_parts_follow_the_owners_measured_upload_rates_within_the_spread(tracker, client, part_sizes):
    """One fast uplink and two slow ones (and one not measured yet, counted at the median): with "upload" the
    fast owner's part is 8× a slow one's (a claim 100× the median counts as 8×: PART_RATE_SPREAD);
    "equal" keeps one size. The weights are in the signed assignment every member cuts by."""
    run_id = await new_run(client, target=40, group_size=4, part_sizes=part_sizes)
    peers = await joined(client, run_id, 4)
    rates = [2.5e8, 2.5e6, 2.5e6, None]  # bytes/s: 2 Gbit/s, 20 Mbit/s, 20 Mbit/s, unknown
    for v, rate in zip(peers, rates, strict=True):
        await v.heartbeat(0, 10, upload_bps=rate)
    replies = await asyncio.gather(*(v.ready(0, 10) for v in peers))
    a = replies[0].assignment
    verify_assignment(a, tracker.public_key)
    by_part = {m.part: m.peer_id for m in a.members}
    rate_of = {v.peer_id: r for v, r in zip(peers, rates, strict=True)}
    if part_sizes == "equal":
        assert a.part_weights == []
        return
    weight_of = {by_part[i]: w for i, w in enumerate(a.part_weights)}
    fast, slow = peers[0].peer_id, peers[1].peer_id
    assert weight_of[fast] == pytest.approx(8 * weight_of[slow], rel=1e-3)
    unknown = next(p for p, r in rate_of.items() if r is None)
    assert weight_of[unknown] == weight_of[slow]  # the median of the known rates
    assert sum(a.part_weights) == pytest.approx(1 << 16, abs=4)
    shown = {p.peer_id: p.upload_bps for p in (await client.status(run_id)).peers}  # status shows the rates
    assert shown == rate_of


async def test_ready_before_the_close_waits_then_gets_its_group(client):
    run_id = await new_run(client, target=20, gather_s=5.0)
    a, b = await joined(client, run_id, 2)
    await a.heartbeat(0, 10)
    assert (await a.ready(0, 10, wait_s=0.05)).status == "wait"
    early = asyncio.create_task(a.ready(0, 10, wait_s=20))
    await asyncio.sleep(0)
    assert (await b.heartbeat(0, 10)).step_closed is True
    late = await b.ready(0, 10)
    assert late.status == "group"
    assert (await early).assignment == late.assignment


async def test_a_peer_that_never_says_ready_does_not_block_the_round_past_gather(client):
    run_id = await new_run(client, target=30, gather_s=0.3)
    peers = await joined(client, run_id, 3)
    for v in peers:
        await v.heartbeat(0, 10)
    replies = await asyncio.gather(peers[0].ready(0, 10), peers[1].ready(0, 10))
    assert [r.status for r in replies] == ["group", "group"]
    assert sorted(m.peer_id for m in replies[0].assignment.members) == sorted(v.peer_id for v in peers[:2])
    # the absent one asks later: it missed step 0 and is told the current step
    late = await peers[2].ready(0, 10)
    assert (late.status, late.global_step, late.assignment) == ("missed", 1, None)
    # a member asking again gets the same assignment
    again = await peers[0].ready(0, 10)
    assert again.assignment == replies[0].assignment


async def test_step_closes_on_timeout_with_min_group_size(client):
    run_id = await new_run(client, target=10_000, step_timeout_s=0.2, min_group_size=2, gather_s=5.0)
    a, b = await joined(client, run_id, 2)
    await a.heartbeat(0, 5)
    # one contributor is below min_group_size: the step stays open past its timeout
    assert (await a.ready(0, 5, wait_s=0.4)).status == "wait"
    assert (await a.heartbeat(0, 6)).step_closed is False
    await b.heartbeat(0, 1)

    async def closed() -> bool:
        return (await a.heartbeat(0, 6)).step_closed

    await until(closed, 5, "the step's close on its timeout", every_s=0.02)
    ra, rb = await asyncio.gather(a.ready(0, 6), b.ready(0, 1))
    assert ra.status == rb.status == "group"
    [record] = (await client.status(run_id)).recent_steps
    assert (record.samples, record.peers) == (7, 2)


async def test_ready_for_a_future_step_waits_for_it(client):
    run_id = await new_run(client, target=10, gather_s=5.0)
    [a] = await joined(client, run_id, 1)
    assert (await a.ready(1, 0, wait_s=0.05)).status == "wait"
    await a.heartbeat(0, 10)
    assert (await a.ready(0, 10)).status == "group"
    await a.heartbeat(1, 10)
    reply = await a.ready(1, 10)
    assert (reply.status, reply.assignment.step, reply.global_step) == ("group", 1, 2)
    history = (await client.status(run_id)).recent_steps
    assert [r.step for r in history] == [1, 0]
    assert history[0].seed != history[1].seed


@pytest.mark.parametrize(("n", "sizes"), [(1, [1]), (2, [2]), (7, [3, 4]), (20, [4, 4, 4, 4, 4])])
async def test_groups_of_g4_cover_every_ready_peer_once(client, n, sizes):
    run_id = await new_run(client, target=n, group_size=4, gather_s=10.0)
    peers = await joined(client, run_id, n)
    for v in peers:
        await v.heartbeat(0, 1)
    replies = await asyncio.gather(*(v.ready(0, 1) for v in peers))
    assert all(r.status == "group" for r in replies)
    groups = {r.assignment.round_id: r.assignment for r in replies}
    assert sorted(len(g.members) for g in groups.values()) == sizes
    members = [m.peer_id for g in groups.values() for m in g.members]
    assert sorted(members) == sorted(v.peer_id for v in peers)
    for v, r in zip(peers, replies, strict=True):
        assert v.peer_id in [m.peer_id for m in r.assignment.members]


async def test_reachable_peers_own_parts_and_are_spread_over_groups(client):
    run_id = await new_run(client, target=8, group_size=4, gather_s=10.0)
    servers = [PingServer() for _ in range(2)]
    for s in servers:
        await s.__aenter__()
    try:
        reachable = [SimVolunteer(client, run_id) for _ in servers]
        for v, s in zip(reachable, servers, strict=True):
            await v.join(address=s.address)
            s.peer_id = v.peer_id
        for v in reachable:
            await v.wait_reachable()
        others = await joined(client, run_id, 6, reachable=False)
        everyone = reachable + others
        for v in everyone:
            await v.heartbeat(0, 1)
        replies = await asyncio.gather(*(v.ready(0, 1) for v in everyone))
    finally:
        for s in servers:
            await s.__aexit__(None, None, None)
    groups = {r.assignment.round_id: r.assignment for r in replies}
    assert sorted(len(g.members) for g in groups.values()) == [4, 4]
    by_id = {v.peer_id: s.address for v, s in zip(reachable, servers, strict=True)}
    for g in groups.values():
        owners = [m for m in g.members if m.part >= 0]
        assert g.parts == 1 and len(owners) == 1
        assert owners[0].part == 0 and owners[0].address == by_id[owners[0].peer_id]
        assert all(m.address is None for m in g.members if m.part < 0)


@pytest.mark.tracker_config(long_poll_s=0.2)
async def test_every_ready_answer_is_bounded_by_long_poll(client):
    run_id = await new_run(client, target=100)
    [a] = await joined(client, run_id, 1)
    reply = await a.ready(0, 1, wait_s=60)  # the tracker caps the wait at its long_poll_s
    assert (reply.status, reply.global_step) == ("wait", 0)


async def test_rates_that_went_back_to_zero_give_no_eta_not_one_divided_by_float_dust(client):
    """Issue 25: the run's rate is a running sum (each heartbeat takes the peer's old rate off and adds its
    new one); 0.1 + 0.2 - 0.1 - 0.2 leaves 5.6e-17, and what was left of the step divided by it gave ETAs
    like 2**47 s. Once no peer has a rate, the run has none, and no ETA."""
    run_id = await new_run(client, target=100)
    a, b = await joined(client, run_id, 2, reachable=False)
    await a.heartbeat(0, 0, samples_per_s=0.1)
    await b.heartbeat(0, 0, samples_per_s=0.2)
    await a.heartbeat(0, 0, samples_per_s=0.0)
    reply = await b.heartbeat(0, 0, samples_per_s=0.0)
    assert reply.eta_s is None
    status = await client.status(run_id)
    assert (status.samples_per_s, status.eta_s) == (0.0, None)
    await a.heartbeat(0, 0, samples_per_s=4.0)
    assert (await client.status(run_id)).eta_s == pytest.approx(25.0)


async def test_expired_peer_leaves_the_pending_set_and_the_round_forms(client):
    run_id = await new_run(client, target=20, gather_s=30.0)
    a, b = await joined(client, run_id, 2)
    await a.heartbeat(0, 10)
    await b.heartbeat(0, 10)
    waiting = asyncio.create_task(a.ready(0, 10))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # b is online at step 0 and not ready yet
    await b.leave()
    reply = await waiting
    assert reply.status == "group"
    assert [m.peer_id for m in reply.assignment.members] == [a.peer_id]


async def test_shutdown_answers_waiting_long_polls_instead_of_hanging():
    async with serve(TrackerConfig()) as t:
        c = TrackerClient(t.url, admin_token=t.admin_token)
        await c.__aenter__()
        run_id = await new_run(c, target=100)
        [a] = await joined(c, run_id, 1)
        waiting = asyncio.create_task(a.ready(0, 1, wait_s=20))
        await asyncio.sleep(0.05)
        assert not waiting.done()
    reply = await waiting
    assert (reply.status, reply.global_step) == ("wait", 0)
    await c.close()


async def test_step_watch_answers_within_a_round_trip_of_the_close(client):
    """Regression: volunteers heard of a close only at their next heartbeat (2 s), after the round had
    formed without them. A watch of the step now answers as soon as it closes."""
    run_id = await new_run(client, target=20, gather_s=5.0)
    a, b = await joined(client, run_id, 2)
    await a.heartbeat(0, 10)
    watch = asyncio.create_task(client.watch_step(run_id, 0, wait_s=20))
    await asyncio.sleep(0.05)
    assert not watch.done()  # the step is open: the watch waits
    await b.heartbeat(0, 10)  # the target is reached: the step closes
    answer = await asyncio.wait_for(watch, 2)
    assert (answer.global_step, answer.step_closed) == (0, True)
    await asyncio.gather(a.ready(0, 10), b.ready(0, 10))
    answer = await client.watch_step(run_id, 0, wait_s=20)  # a step the run passed: at once
    assert (answer.global_step, answer.step_closed) == (1, False)
    with pytest.raises(TrackerError, match="step must be a whole number"):
        await client._request("GET", f"/api/v1/runs/{run_id}/step?step=x")


async def test_step_watch_answers_when_samples_of_the_open_step_are_freed_so_a_peer_at_its_share_needs_no_polling(
    client,
):
    """A peer at its allotment waits on the step watch and asks nothing. When a peer holding the rest of the
    step leaves, the watch answers at once with how many samples are free (the step still open), and the
    waiting peer's next heartbeat is allotted them; a heartbeat that frees nothing leaves the watch waiting."""
    run_id = await new_run(client, target=120, gather_s=5.0)
    a, b, c = await joined(client, run_id, 3)
    for v in (a, b, c):
        await v.heartbeat(0, 0, samples_per_s=10.0)
    reply = await a.heartbeat(0, 40, samples_per_s=10.0)  # a is at its share (and could compute more)
    assert (reply.allotment, reply.step_closed) == (40, False)
    watch = asyncio.create_task(client.watch_step(run_id, 0, wait_s=20))
    await asyncio.sleep(0.05)
    await c.heartbeat(0, 10, samples_per_s=10.0)  # progress, nothing freed
    await asyncio.sleep(0.05)
    assert not watch.done()
    await b.leave()  # b's 40 samples are nobody's now
    answer = await asyncio.wait_for(watch, 2)
    assert (answer.global_step, answer.step_closed, answer.free) == (0, False, 40)
    reply = await a.heartbeat(0, 40, samples_per_s=10.0)
    assert reply.allotment is not None and reply.allotment > 40
    # once the freed samples are allotted again, a new watch waits (and says nothing freed when it times out)
    assert (await client.watch_step(run_id, 0, wait_s=0.2)).free is None


@pytest.mark.tracker_config(heartbeat_interval_s=0.2, peer_ttl_s=30.0)
async def test_a_straggler_silent_while_it_owes_samples_loses_them_to_the_others_and_the_step_closes(client):
    """Issue 27: b owes most of its allotment and falls silent (a laptop asleep). a and c, done with their
    shares, do not wait for b to expire: its rest is shared with them while it is still on time (the shared
    rest: they would idle seconds for it; the watch says samples are free), and what it still owes once it
    has said nothing for the straggler limit is freed too. The step closes on their samples and b's 8
    without b speaking again; b is a straggler, not gone."""
    run_id = await new_run(client, target=120, gather_s=0.5)
    a, b, c = await joined(client, run_id, 3)
    for v in (a, b, c):
        await v.heartbeat(0, 0, samples_per_s=10.0)
    assert (await b.heartbeat(0, 8, samples_per_s=10.0)).allotment == 40  # b owes 32: 3.2 s of its work
    held = {}
    for v in (a, c):
        held[v] = (await v.heartbeat(0, 40, samples_per_s=10.0)).allotment
        assert held[v] == 40  # at their shares
    loop = asyncio.get_running_loop()
    started, first_free, reply = loop.time(), None, None
    while not (reply is not None and reply.step_closed):  # a and c compute what they are given; b is silent
        answer = await client.watch_step(run_id, 0, wait_s=10)
        assert loop.time() - started < 10, "b's samples were never shared nor freed"
        if answer.step_closed:
            break
        first_free = first_free if first_free is not None else loop.time() - started
        for v in (a, c):
            held[v] = (await v.heartbeat(0, held[v], samples_per_s=10.0)).allotment  # its part of them
        for v in (a, c):
            reply = await v.heartbeat(0, held[v], samples_per_s=10.0)
    assert first_free is not None and first_free < 1.0  # (shared at once, not after b's silence limit)
    assert 8 + sum(held.values()) >= 120
    status = await client.status(run_id)
    assert status.peers_online == 3  # b is a straggler, not gone


@pytest.mark.tracker_config(heartbeat_interval_s=10.0, peer_ttl_s=60.0)
async def test_a_late_peer_is_revoked_long_before_its_silence_limit_and_a_round_does_not_wait_for_it(client):
    """Backup workers (issue 27): a and c reach their shares; b, allotted the same at the same rate, says
    nothing more (frozen as it began computing). Its silence limit is 15 s (1.5 intervals of 10 s), but once a
    and c have waited and b is past 1.5 × its own expected time, b is late: what it owes is freed, a and c
    compute it, and the round forms on their ready calls without waiting ``gather_s`` (30 s) for b, which holds
    nothing of the step. Waking, b hears it missed the step."""
    run_id = await new_run(client, target=120, gather_s=30.0)
    a, b, c = await joined(client, run_id, 3)
    for v in (a, b, c):
        await v.heartbeat(0, 0, samples_per_s=40.0)
    assert (await b.heartbeat(0, 0, samples_per_s=40.0)).allotment == 40  # 1 s of its work
    await asyncio.sleep(
        1.0
    )  # (a and c compute theirs meanwhile: b frozen at its start is due as they finish)
    for v in (a, c):
        assert (await v.heartbeat(0, 40, samples_per_s=40.0)).allotment == 40
    answer = await client.watch_step(run_id, 0, wait_s=12)  # (well inside b's 15 s of silence)
    assert (answer.step_closed, answer.free) == (False, 40), answer
    more = [await v.heartbeat(0, 40, samples_per_s=40.0) for v in (a, c)]
    assert sum(r.allotment - 40 for r in more) == 40, [r.allotment for r in more]
    closing = [
        await v.heartbeat(0, r.allotment, samples_per_s=40.0) for v, r in zip((a, c), more, strict=True)
    ]
    assert closing[-1].step_closed
    replies = await asyncio.wait_for(
        asyncio.gather(*(v.ready(0, r.allotment) for v, r in zip((a, c), more, strict=True))), 12
    )
    assert [r.status for r in replies] == ["group", "group"]  # not held for b's ready call
    assert {m.peer_id for m in replies[0].assignment.members} | {
        m.peer_id for p in replies[0].later_phases for m in p.members
    } <= {a.peer_id, c.peer_id}
    late = await b.ready(0, 0, wait_s=1)
    assert (late.status, late.global_step) == ("missed", 1)


@pytest.mark.tracker_config(heartbeat_interval_s=10.0, peer_ttl_s=60.0)
async def test_spares_close_the_step_on_its_target_while_a_peer_sleeps_and_its_ready_is_awaited_as_long_as_its_answers_take(
    client,
):
    """Backup workers (issue 27): at step 1, b reports 8 of its 40 samples and falls asleep. Once a and c are
    done and b is past its time, spares open: the step watch answers, a and c are allotted b's 32 once more
    and close the step on its target. At the close b holds samples, so its ready call is awaited, but for as
    long as its answers to closes took (step 0: within a round trip), not ``gather_s`` (30 s): the round forms
    on a and c. Waking, b hears it missed the step."""
    run_id = await new_run(client, target=120, gather_s=30.0)
    a, b, c = await joined(client, run_id, 3)
    vols = (a, b, c)
    for v in vols:  # step 0: every peer answers the close at once (timed)
        await v.heartbeat(0, 0, samples_per_s=40.0)
    for v in vols:
        await v.heartbeat(0, 40, samples_per_s=40.0)
    formed = await asyncio.wait_for(asyncio.gather(*(v.ready(0, 40) for v in vols)), 12)
    assert [r.status for r in formed] == ["group"] * 3
    for v in vols:
        assert (await v.heartbeat(1, 0, samples_per_s=40.0)).allotment == 40
    await b.heartbeat(1, 8, samples_per_s=40.0)  # then asleep: its rest (32) should take 0.8 s
    await asyncio.sleep(0.8)  # (a and c compute their last 32 meanwhile: they finish when b should)
    for v in (a, c):
        await v.heartbeat(1, 40, samples_per_s=40.0)
    answer = await client.watch_step(run_id, 1, wait_s=12)  # (b's silence limit is 15 s)
    assert (answer.step_closed, answer.free) == (False, 32), answer
    more = [(await v.heartbeat(1, 40, samples_per_s=40.0)).allotment for v in (a, c)]
    assert more == [56, 56]
    assert (await a.heartbeat(1, 56, samples_per_s=40.0)).step_closed is False
    assert (await c.heartbeat(1, 56, samples_per_s=40.0)).step_closed  # 8 (b's) + 112: the target
    replies = await asyncio.wait_for(asyncio.gather(a.ready(1, 56), c.ready(1, 56)), 12)
    assert [r.status for r in replies] == ["group", "group"]  # not held gather_s for b's ready call
    members = {m.peer_id for m in replies[0].assignment.members}
    members |= {m.peer_id for p in replies[0].later_phases for m in p.members}
    assert members == {a.peer_id, c.peer_id}
    [record] = [r for r in (await client.status(run_id)).recent_steps if r.step == 1]
    assert record.samples == 112  # b's 8 are not in it
    late = await b.ready(1, 8, wait_s=1)
    assert (late.status, late.global_step) == ("missed", 2)


@pytest.mark.tracker_config(heartbeat_interval_s=10.0, peer_ttl_s=60.0)
async def test_a_spare_left_untaken_by_a_peer_asleep_does_not_wake_every_watch_at_each_heartbeat(client):
    """Regression (issue 27, a heavy-tail run's tracker log): while a spare offered to a peer that fell
    asleep stayed untaken, each heartbeat woke every step watch, each watch's answer made its volunteer
    heartbeat at once, and two volunteers heartbeat every 2-5 ms for the rest of the step. A watch answers
    ``free`` when more is offered than before the change, not while an old offer waits."""
    run_id = await new_run(client, target=120, gather_s=30.0)
    a, b, c = await joined(client, run_id, 3)
    for v in (a, b, c):
        assert (await v.heartbeat(0, 0, samples_per_s=40.0)).allotment == 40
    await b.heartbeat(0, 8, samples_per_s=40.0)  # then asleep
    await asyncio.sleep(0.8)  # (a and c compute their last 32 meanwhile: they finish when b should)
    for v in (a, c):
        await v.heartbeat(0, 40, samples_per_s=40.0)
    answer = await client.watch_step(run_id, 0, wait_s=12)
    assert answer.free == 32, answer  # 16 each for a and c; c falls asleep and never takes its 16
    assert (await a.heartbeat(0, 40, samples_per_s=40.0)).allotment == 56
    held = (await b.heartbeat(0, 8, samples_per_s=40.0)).allotment  # awake (what it is allotted, by now)
    watch = asyncio.create_task(client.watch_step(run_id, 0, wait_s=1.0))
    for samples in (42, 44, 46):  # nothing more is offered: a computes its spare (slowly: it is not behind),
        await asyncio.sleep(0.2)  # b reports (not silent) what it holds
        await a.heartbeat(0, samples, samples_per_s=4.0)
        assert (await b.heartbeat(0, 8, samples_per_s=40.0)).allotment == held
    quiet = await watch
    assert (quiet.step_closed, quiet.free) == (False, None), quiet


def test_a_peer_is_awaited_at_a_close_for_its_own_answer_time_less_what_it_let_pass_unanswered():
    """policy.answer_wait: gather_s until its answers were timed, then 4 × its slowest recent answer (at
    least 0.15 s, at most gather_s); a micro-batch more only while one may be in flight; and what it already
    let pass since spares asked every volunteer to report counts against it."""
    create = make_run_create(target_batch_size=64, averaging=AveragingSpec(gather_s=2.0))
    fields = {f: getattr(create, f) for f in ("name", "model", "dataset", "target_batch_size", "averaging")}
    spec = RunSpec(run_id="r", tracker_public_key="00" * 32, micro_batch_size=8, **fields)
    peer = Peer(peer_id="p", public_key="k", share=Share(step=3, samples=16, samples_per_s=40.0))
    assert answer_wait(peer, 3, spec) == 2.0 + 8 / 40  # never timed: gather_s, and its micro-batch
    peer.answer_s = 0.01
    assert answer_wait(peer, 3, spec, in_flight=False) == 0.15  # (the floor)
    peer.answer_s = 0.2
    assert answer_wait(peer, 3, spec, in_flight=False) == 0.8
    peer.answer_s = 1.0
    assert answer_wait(peer, 3, spec, in_flight=False) == 2.0  # (at most gather_s)
    assert answer_wait(peer, 3, spec, in_flight=False, unanswered_s=0.5) == 1.5
    assert answer_wait(peer, 3, spec, in_flight=False, unanswered_s=5.0) == 0.0
    assert answer_wait(peer, 4, spec) == 2.0  # samples of another step: nothing of this one in flight


async def test_a_run_with_no_reachable_peer_closes_no_step_and_says_why(client):
    run_id = await new_run(client, target=20, gather_s=0.2)
    a, b = await joined(client, run_id, 2, reachable=False)  # both in client mode
    await a.heartbeat(0, 15)
    reply = await b.heartbeat(0, 15)  # 30 samples: above the target
    assert (reply.step_closed, reply.global_step) == (False, 0)
    assert reply.notice is not None and "no reachable volunteer" in reply.notice
    assert (await a.ready(0, 15, wait_s=0.3)).status == "wait"  # nothing forms
    status = await client.status(run_id)
    assert status.global_step == 0 and status.notice == reply.notice and not status.recent_steps
    # a reachable volunteer arrives: the next heartbeat closes the step, the notice is gone
    [c] = await joined(client, run_id, 1)
    reply = await c.heartbeat(0, 1)
    assert reply.step_closed and reply.notice is None
    replies = await asyncio.gather(a.ready(0, 15), b.ready(0, 15), c.ready(0, 1))
    assert [r.status for r in replies] == ["group"] * 3
    [owner] = [m for m in replies[0].assignment.members if m.part >= 0]
    assert owner.peer_id == c.peer_id


async def test_a_round_whose_part_owner_left_is_not_formed_and_the_step_opens_again(client):
    run_id = await new_run(client, target=20, gather_s=0.3)
    [owner] = await joined(client, run_id, 1)
    a, b = await joined(client, run_id, 2, reachable=False)
    await owner.heartbeat(0, 0)
    await a.heartbeat(0, 10)
    assert (await b.heartbeat(0, 10)).step_closed
    waiting = asyncio.gather(a.ready(0, 10), b.ready(0, 10))
    await asyncio.sleep(0.05)
    await owner.leave()  # the only part owner leaves before the round forms
    replies = await asyncio.wait_for(waiting, 5)
    assert [r.status for r in replies] == ["open", "open"]
    status = await client.status(run_id)
    assert status.global_step == 0 and not status.recent_steps
    assert "no reachable volunteer" in (await a.heartbeat(0, 10)).notice


async def test_a_contributor_still_in_its_micro_batch_is_waited_for_past_gather(client):
    """Regression (issue 13): with a micro-batch longer than the gather window, a contributor said "ready"
    after the round had formed without it, and steps closed into rounds its samples never reached. (Here
    the step closes on its timeout while slow owes samples; one at its allotment has nothing in flight.)"""
    run_id = await new_run(client, target=40, gather_s=0.2, step_timeout_s=1.0)
    fast, slow = await joined(client, run_id, 2)
    assert (await fast.heartbeat(0, 20, samples_per_s=100.0)).allotment == 20  # at its share
    await slow.heartbeat(0, 12, samples_per_s=4.0)  # 8 to go: a micro-batch of 8 samples, 2 s

    async def closed() -> bool:
        return (await fast.heartbeat(0, 20, samples_per_s=100.0)).step_closed

    await until(closed, 10, "the step's timeout closing it")
    early = asyncio.create_task(fast.ready(0, 20))
    await asyncio.sleep(1.0)  # far past gather_s
    assert not early.done()  # still waiting for the slow contributor
    late = await slow.ready(0, 20)
    assert late.status == "group" and (await early).assignment == late.assignment
    [record] = (await client.status(run_id)).recent_steps
    assert record.samples == 40 and record.peers == 2


async def test_no_round_is_formed_from_peers_that_computed_nothing(client):
    run_id = await new_run(client, target=10, gather_s=0.1)
    idle, worker = await joined(client, run_id, 2)
    await idle.heartbeat(0, 0, computing=False)  # (one computing would cap the worker at half the step)
    assert (await worker.heartbeat(0, 10)).step_closed
    waiting = asyncio.create_task(idle.ready(0, 0))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # the contributor is on its way: no empty round
    await worker.leave()  # and then it is gone: the step opens again instead of stepping on nothing
    reply = await asyncio.wait_for(waiting, 5)
    assert (reply.status, reply.global_step) == ("open", 0)
    assert not (await client.status(run_id)).recent_steps


async def test_a_step_every_peer_is_done_with_closes_and_samples_computed_ahead_count_for_the_next(
    tracker, client
):
    """Delay 1 (issue 14): a peer done with its share reports ``computing=false`` and computes the next
    step ahead. A step that no peer computes for any more closes on what it holds; the samples a ready
    call says were computed ahead are counted for the next step, whose allotment is never below them."""
    run_id = await new_run(client, target=100, group_size=4, gather_s=5.0, delay=1)
    a, b = await joined(client, run_id, 2)
    await a.heartbeat(0, 30, computing=False)
    assert (await b.heartbeat(0, 20)).step_closed is False  # b still computes
    reply = await b.heartbeat(0, 40, computing=False)  # done too: 70 of 100, nothing more will come
    assert (reply.step_closed, reply.samples) == (True, 70)
    replies = await asyncio.gather(a.ready(0, 30, ahead=12), b.ready(0, 40, ahead=5))
    assert [r.status for r in replies] == ["group", "group"]
    assert replies[0].next_allotment >= 12 and replies[1].next_allotment >= 5
    assert replies[0].next_allotment + replies[1].next_allotment <= 100
    status = await client.status(run_id)
    assert status.global_step == 1
    assert status.recent_steps[-1].samples == 70
    # the samples computed ahead are step 1's already
    assert (await a.heartbeat(1, 12)).samples == 12 + 5  # b's 5 are counted until it reports itself


async def test_what_is_left_of_a_step_is_shared_by_rate_so_peers_with_a_head_start_finish_with_the_others(
    tracker, client
):
    """Delay 1: a peer that computed 12 samples ahead holds them when the next step opens; the 108 left of
    the target are shared out by rate on top of what each holds, so three peers of one rate each have 36
    more to compute (and finish together), not a third of the target each (which would leave the peer with
    the head start waiting for the others)."""
    run_id = await new_run(client, target=120, group_size=3, gather_s=5.0, delay=1)
    peers = await joined(client, run_id, 3)
    for v in peers:
        await v.heartbeat(0, 0, samples_per_s=10.0)
    for v in peers:
        reply = await v.heartbeat(0, 40, samples_per_s=10.0, computing=False)
    assert reply.step_closed
    a, b, c = peers
    replies = await asyncio.gather(a.ready(0, 40, ahead=12), b.ready(0, 40), c.ready(0, 40))
    assert [r.status for r in replies] == ["group"] * 3
    assert [r.next_allotment for r in replies] == [12 + 36, 36, 36]


async def test_the_share_a_peer_may_compute_ahead_is_its_rate_share_with_room_for_peers_of_unknown_rate(
    tracker, client
):
    """Delay 1: a peer done with its share is told how many samples it may compute ahead for the next step:
    its share of a step by rate among the peers computing for the run, itself included though it is done,
    a peer of unknown rate counted at the mean (room for it), a peer that computes nothing (downloading)
    not at all. A ready call's samples ahead are credited up to that share even above the step's weight."""
    run_id = await new_run(client, target=120, group_size=4, gather_s=5.0, delay=1)
    a, b, c, d = await joined(client, run_id, 4)
    await d.heartbeat(0, 0, samples_per_s=0.0, computing=False)  # downloading: no room kept for it
    for v, rate in ((b, 10.0), (c, 20.0)):
        await v.heartbeat(0, 0, samples_per_s=rate)
    reply = await a.heartbeat(0, 10, samples_per_s=10.0, computing=False)
    assert reply.ahead_share == 120 * 10 // 40
    await d.heartbeat(0, 0, samples_per_s=0.0)  # has a chunk now, rate unknown: counted at the mean
    reply = await a.heartbeat(0, 10, samples_per_s=10.0, computing=False)
    assert reply.ahead_share == 120 * 10 * 3 // (40 * 4)
    assert (await c.heartbeat(0, 20, samples_per_s=20.0)).ahead_share == 120 * 20 * 3 // (40 * 4)
    # a ready call's samples ahead are credited up to the peer's share, above its weight (10) too, no more
    # (the next allotments: a's what it holds and its share of what is left, within its share cap; b, done
    # too and as fast as its rate says, may have computed its share of 60 ahead since its ready call)
    for ahead, credited, allotted in ((40, 40, [60, 60]), (100, 60, [60, 60])):
        run_id = await new_run(client, target=120, group_size=2, gather_s=5.0, delay=1)
        a, b = await joined(client, run_id, 2)
        await b.heartbeat(0, 0)
        assert (await a.heartbeat(0, 10, computing=False)).ahead_share == 60  # half the step, as b's rate
        assert (await b.heartbeat(0, 60, computing=False)).step_closed
        replies = await asyncio.gather(a.ready(0, 10, ahead=ahead), b.ready(0, 60))
        assert [r.next_allotment for r in replies] == allotted
        assert (await b.heartbeat(1, 0)).samples == credited


async def test_peers_that_began_alone_and_computed_ahead_leave_room_for_those_that_come_after(
    tracker, client
):
    """Delay 1: two peers compute step 0 while two others download. Once those two have a chunk, the
    first two may compute ahead only their rate share of a step with the newcomers counted at the mean,
    and the newcomers are allotted the rest of step 1: no peer keeps the others out of the run by computing
    ahead."""
    run_id = await new_run(client, target=64, group_size=4, gather_s=5.0, delay=1)
    a, b, c, d = await joined(client, run_id, 4)
    for v in (c, d):
        await v.heartbeat(0, 0, samples_per_s=0.0, computing=False)
    await b.heartbeat(0, 0, samples_per_s=10.0)
    assert (await a.heartbeat(0, 32, samples_per_s=10.0, computing=False)).ahead_share == 32
    assert (await b.heartbeat(0, 32, samples_per_s=10.0, computing=False)).step_closed
    for v in (c, d):  # a chunk each now
        await v.heartbeat(0, 0, samples_per_s=0.0)
    for v in (a, b):  # (each hears it at its next heartbeat)
        assert (await v.heartbeat(0, 32, samples_per_s=10.0, computing=False)).ahead_share == 16
    replies = await asyncio.gather(
        a.ready(0, 32, ahead=16), b.ready(0, 32, ahead=16), c.ready(0, 0), d.ready(0, 0)
    )
    assert [r.status for r in replies] == ["group"] * 4
    # what is left (32) shared by rate, an unknown rate at the mean: a quarter each on top of what each holds
    assert [r.next_allotment for r in replies] == [16 + 8, 16 + 8, 8, 8]


async def test_a_peer_computing_ahead_is_allotted_what_it_may_have_computed_since_its_ready_call(
    tracker, client
):
    """Delay 1: a peer done with its step computes ahead, up to the share it was told, until it hears that
    the round formed: more than its ready call said. Each is allotted what it may have computed since (at
    its rate, within that share), before what is left is shared out; else a peer allotted less than it
    computed by then claims more than its allotment and the step overshoots its target (112 of 96 here,
    once: 48 to the one that said 24, and 24 each to the two that said 0 but had computed their 32)."""
    run_id = await new_run(client, target=96, group_size=4, gather_s=5.0, delay=1)
    peers = await joined(client, run_id, 3)
    for v in peers:
        await v.heartbeat(0, 0)
    for v in peers:
        reply = await v.heartbeat(0, 32, computing=False)
        assert reply.ahead_share == 32
    assert reply.step_closed
    a, b, c = peers
    replies = await asyncio.gather(a.ready(0, 32), b.ready(0, 32), c.ready(0, 32, ahead=24))
    assert [r.next_allotment for r in replies] == [32, 32, 32]
    for v in peers:
        reply = await v.heartbeat(1, 32, computing=False)
    assert (reply.samples, reply.step_closed) == (96, True)


async def test_samples_computed_ahead_by_a_peer_that_leaves_are_shared_out_to_the_others(tracker, client):
    """Delay 1: a peer whose samples computed ahead were counted for step 1 when the round formed, and
    which then leaves (or expires), takes them with it: step 1 does not close on samples nobody will
    average, and the others are allotted the whole target between them."""
    run_id = await new_run(client, target=120, group_size=4, gather_s=5.0, delay=1)
    a, b, c = await joined(client, run_id, 3)
    for v in (a, b, c):
        await v.heartbeat(0, 0, samples_per_s=10.0)
    for v in (a, b, c):
        reply = await v.heartbeat(0, 40, samples_per_s=10.0, computing=False)
    assert reply.step_closed
    replies = await asyncio.gather(a.ready(0, 40, ahead=30), b.ready(0, 40), c.ready(0, 40))
    assert [r.next_allotment for r in replies] == [30 + 30, 30, 30]
    assert (await b.heartbeat(1, 0, samples_per_s=10.0)).samples == 30
    await a.leave()
    reply = await b.heartbeat(1, 0, samples_per_s=10.0)
    assert (reply.samples, reply.allotment, reply.step_closed) == (0, 60, False)
    assert (await c.heartbeat(1, 0, samples_per_s=10.0)).allotment == 60


async def test_a_heartbeat_for_the_step_before_neither_moves_a_peer_back_nor_frees_its_allotment(
    tracker, client
):
    """A heartbeat a volunteer sent for step 0 before its ready reply moved it to step 1 arrives after that
    reply: it must not move the peer back to step 0 (its step-1 allotment would be shared out to the others
    while it computes toward it, and the step would overshoot its target), nor, saying "not computing",
    close step 1 early."""
    run_id = await new_run(client, target=100, group_size=2, gather_s=5.0, delay=1, max_peer_share=1.0)
    a, b = await joined(client, run_id, 2)
    for v in (a, b):
        await v.heartbeat(0, 0, samples_per_s=10.0)
    await a.heartbeat(0, 50, samples_per_s=10.0, computing=False)
    assert (await b.heartbeat(0, 50, samples_per_s=10.0, computing=False)).step_closed
    replies = await asyncio.gather(a.ready(0, 50, ahead=10), b.ready(0, 50))
    allotted = replies[0].next_allotment
    assert allotted == 10 + 45
    stale = await a.heartbeat(0, 50, samples_per_s=10.0, computing=False)  # sent before the ready reply
    assert (stale.global_step, stale.step_closed, stale.samples) == (1, False, 10)
    # b asks for more: a's allotment still stands, so b gets none of it, and a keeps it
    assert (await b.heartbeat(1, 45, samples_per_s=10.0)).allotment == 45
    reply = await a.heartbeat(1, 14, samples_per_s=10.0)
    assert (reply.allotment, reply.samples) == (allotted, 14 + 45)


async def test_inflated_samples_and_weights_are_capped_so_a_liar_neither_closes_a_step_nor_outweighs(client):
    """Issue 16: a joined peer (its own key, hand-made numbers) heartbeats 10⁹ samples and asks to be
    averaged with weight 10¹²; the tracker credits what its rate allows and at most its share cap, and the
    honest peers' weights are those of a run without it."""

    async def honest_weights(with_liar: bool) -> tuple[dict[str, int], int | None]:
        run_id = await new_run(client, target=100, gather_s=0.3)
        a, b, liar = await joined(client, run_id, 3)
        for v in (a, b):
            await v.heartbeat(0, 0)  # taking part, nothing computed yet
        liar_weight = None
        if with_liar:
            # a modest rate: 10⁹ samples are not what it could have computed since it said so
            await liar.heartbeat(0, 0, samples_per_s=1.0)
            await liar.heartbeat(0, 10**9, samples_per_s=1.0)
            status = await client.status(run_id)
            # credited: its allotment (a third of the step, by the rate all three claimed when they
            # joined), the most an honest peer computes; never the 10⁹
            assert not status.recent_steps and status.samples <= 34
            # a rate as large as the lie: credited, but only up to half the step (others take part)
            reply = await liar.heartbeat(0, 10**9, samples_per_s=1e12)
            assert not reply.step_closed and reply.samples == 50
        else:
            await liar.leave()
        # each honest peer computed its 30 and is done with the step (it closes when nobody computes)
        await a.heartbeat(0, 30, computing=False)
        assert (await b.heartbeat(0, 30, computing=False)).step_closed
        callers = [a.ready(0, 30), b.ready(0, 30)]
        if with_liar:
            callers.append(liar.ready(0, 10**12))
        replies = await asyncio.gather(*callers)
        members = {m.peer_id: m.weight for m in replies[0].assignment.members}
        if with_liar:
            liar_weight = members.pop(liar.peer_id)
        names = {a.peer_id: "a", b.peer_id: "b"}
        return {names[p]: w for p, w in members.items()}, liar_weight

    alone, _ = await honest_weights(with_liar=False)
    beside, liar_weight = await honest_weights(with_liar=True)
    assert alone == beside == {"a": 30, "b": 30}  # their own samples, as without the liar
    assert liar_weight == 50  # never the 10¹² it asked for: half the target while others take part


async def test_a_ready_weight_above_what_the_peer_reported_is_credited_only_as_its_rate_allows(client):
    run_id = await new_run(client, target=20, gather_s=0.3)
    honest, liar = await joined(client, run_id, 2)
    await liar.heartbeat(0, 0, samples_per_s=1.0)
    await liar.heartbeat(0, 1, samples_per_s=1.0)  # reports one sample at one a second...
    await honest.heartbeat(0, 10)
    assert (await honest.heartbeat(0, 10, computing=False)).samples == 11
    # ...then asks to weigh 10¹² (its credited weight also counts toward closing the step)
    replies = await asyncio.gather(honest.ready(0, 10), liar.ready(0, 10**12))
    weights = {m.peer_id: m.weight for m in replies[0].assignment.members}
    assert weights[honest.peer_id] == 10
    # one sample plus what a rate of 1/s allows in the seconds since (×4 slack) plus two micro-batches
    assert 1 <= weights[liar.peer_id] <= 1 + 2 * 8 + 4 * 5


async def test_a_peer_still_at_the_step_before_is_not_awaited_at_a_close(client):
    """Issue 27 (a heavy-tail timeline): a peer that took no part in the last round (asleep through it) is
    still at the step before when the next step closes. It can bring nothing to that round, so its ready call
    is not awaited, not even for ``gather_s`` (30 s here: its answers were never timed)."""
    run_id = await new_run(client, target=20, gather_s=30.0)
    a, b = await joined(client, run_id, 2)
    for v in (a, b):
        await v.heartbeat(0, 10)
    first = await asyncio.wait_for(asyncio.gather(a.ready(0, 10), b.ready(0, 10)), 12)
    assert [r.status for r in first] == ["group", "group"]
    [c] = await joined(client, run_id, 1, reachable=False)
    reply = await c.heartbeat(0, 4)  # it reports step 0 (then sleeps): the run is at step 1
    assert (reply.global_step, reply.step_closed) == (1, False)
    for v in (a, b):
        await v.heartbeat(1, 10)
    second = await asyncio.wait_for(asyncio.gather(a.ready(1, 10), b.ready(1, 10)), 12)
    assert [r.status for r in second] == ["group", "group"]
    assert {m.peer_id for m in second[0].assignment.members} == {a.peer_id, b.peer_id}
    late = await c.ready(0, 4, wait_s=1)
    assert (late.status, late.global_step) == ("missed", 2)
