"""A member asleep inside a round is cut by the group, through the tracker (issue 27; tracker/cuts.py,
volunteer/averaging/cutting.py).

The rules alone (:class:`~crowdtrain.tracker.cuts.Cuts`), then real Averagers behind real HTTP servers with a
real tracker deciding: a sleeper is a part owner whose port takes connections and never answers (what a
SIGSTOPped process looks like from the network: the kernel completes the handshake and buffers what comes),
or a real Averager that joins its round only after the others gave up on it (it woke up).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time
from asyncio.subprocess import PIPE

import numpy as np
import pytest
from aiohttp import web

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import SigningKey, sign_assignment
from crowdtrain.protocol.errors import TrackerError
from crowdtrain.protocol.messages import AveragingSpec, CutCall, GroupAssignment, GroupMember, encode
from crowdtrain.tracker.cuts import FORGET_AFTER_S, Cuts
from crowdtrain.volunteer.averaging import Averager, AveragingConfig, part_bounds
from crowdtrain.volunteer.averaging.cutting import QUIET_ROUNDS, tracker_referee
from tests.faults import subprocess_env as child_env
from tests.sim import SimVolunteer, make_run_create

# ---------------------------------------------------------------- the rules


def _assignment(
    members: list[str], *, deadline: float, round_id: str = "r1", weights: list[int] | None = None
) -> GroupAssignment:
    return GroupAssignment(
        run_id="run",
        round_id=round_id,
        step=5,
        members=[
            GroupMember(
                peer_id=m,
                address=f"127.0.0.1:{i + 1}",
                public_key="",
                weight=1 if not weights else weights[i],
                part=i,
            )
            for i, m in enumerate(members)
        ],
        parts=len(members),
        average_params=False,
        deadline=deadline,
        seed=0,
        signature="",
    )


async def test_an_owner_is_cut_only_when_every_other_member_voted_before_it_claimed():
    cut: list[tuple[str, int]] = []
    cuts = Cuts(lambda owner, step: cut.append((owner, step)))
    now = time.time()
    a = _assignment(["a", "b", "c", "s"], deadline=now + 30)
    votes = [asyncio.create_task(cuts.call(a, "grad", m, "s", now)) for m in ("a", "b")]
    await asyncio.sleep(0.05)
    assert not any(v.done() for v in votes)  # (two of three: a vote waits for the decision)
    assert await cuts.call(a, "grad", "c", "s", now) == "cut"
    assert await asyncio.gather(*votes) == ["cut", "cut"]
    assert await cuts.call(a, "grad", "s", "s", now) == "cut"  # the sleeper, awake, hears it was cut
    assert cut == [("s", 5)]  # once
    # another tag of the same round, and another owner, are their own cases: a claim first keeps it
    assert await cuts.call(a, "params", "s", "s", now) == "kept"
    assert await cuts.call(a, "params", "a", "s", now) == "kept"  # (at once: decided)
    assert cuts.decided == {"cut": 1, "kept": 1}


async def test_an_undecided_vote_is_kept_at_the_deadline_and_late_calls_decide_nothing_new():
    cuts = Cuts()
    now = time.time()
    a = _assignment(["a", "b", "s"], deadline=now + 0.2)
    assert await cuts.call(a, "grad", "a", "s", now) == "kept"  # b never voted: kept at the deadline
    assert await cuts.call(a, "grad", "b", "s", now + 1) == "kept"  # (decided)
    late = _assignment(["a", "b", "s"], deadline=now - 1, round_id="r2")
    assert await cuts.call(late, "grad", "a", "s", now) == "kept"  # a vote past the deadline: nothing to cut
    # a claim so late that its case would be forgotten: every member gave up on that answer long ago
    assert await cuts.call(late, "grad", "s", "s", now + FORGET_AFTER_S + 5) == "cut"
    assert len(cuts) == 1


async def test_a_member_that_voted_is_awake_and_never_cut_from_that_round_so_someone_always_applies_it():
    cut: list[tuple[str, int]] = []
    cuts = Cuts(lambda owner, step: cut.append((owner, step)))
    now = time.time()
    # two members each waiting on the other (both slow, each ping lost): the first vote cuts, the second is moot
    pair = _assignment(["a", "b"], deadline=now + 30)
    assert await cuts.call(pair, "grad", "a", "b", now) == "cut"
    assert await cuts.call(pair, "grad", "b", "a", now) == "kept"  # a voted: awake
    assert await cuts.call(pair, "grad", "a", "a", now) == "kept"  # a applies the round, b replays from it
    assert await cuts.call(pair, "grad", "b", "b", now) == "cut"
    # a vote keeps an open case on the voter: its waiting voters hear "kept" at once (the round's deadline is
    # 3 s away: the vote on b, which only c casts, waits for it and is then "kept")
    trio = _assignment(["a", "b", "c"], deadline=now + 3, round_id="r2")
    on_c = asyncio.create_task(cuts.call(trio, "grad", "a", "c", now))
    await asyncio.sleep(0.05)
    assert await cuts.call(trio, "grad", "c", "b", now) == "kept"  # (b: only c voted on it)
    assert await asyncio.wait_for(on_c, 1) == "kept"
    # once cut, every other member voted: the round has no second cut, not even on the sleeper's vote
    votes = [asyncio.create_task(cuts.call(trio, "params", m, "c", now)) for m in ("a", "b")]
    assert await asyncio.wait_for(asyncio.gather(*votes), 1) == ["cut", "cut"]
    assert await cuts.call(trio, "params", "c", "a", now) == "kept"
    assert await cuts.call(trio, "params", "c", "b", now) == "kept"
    assert cut == [("b", 5), ("c", 5)]
    # members catching up (weight 0) do not cut the one that trains: nobody would be left to fetch from
    behind = _assignment(["a", "b", "s"], deadline=now + 30, round_id="r3", weights=[0, 0, 24])
    votes = [asyncio.create_task(cuts.call(behind, "grad", m, "s", now)) for m in ("a", "b")]
    assert await asyncio.wait_for(asyncio.gather(*votes), 1) == ["kept", "kept"]
    assert cut == [("b", 5), ("c", 5)]


# ---------------------------------------------------------------- real averagers, a real tracker


class _Member:
    def __init__(self, sim: SimVolunteer, averager: Averager, runner: web.AppRunner) -> None:
        self.sim, self.averager, self.runner = sim, averager, runner

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.runner.addresses[0][1]}"

    def member(self, part: int, weight: int) -> GroupMember:
        return GroupMember(
            peer_id=self.sim.peer_id,
            address=self.address,
            public_key=self.sim.key.public_hex,
            weight=weight,
            part=part,
        )


async def _members(tracker, client: TrackerClient, run_id: str, n: int) -> list[_Member]:
    config = AveragingConfig(clip_multiple=0.0, assignment_wait_s=30.0)
    out = []
    for _ in range(n):
        sim = SimVolunteer(client, run_id)
        joined = await sim.join()
        averager = Averager(
            run_id=run_id,
            tracker_public_key=tracker.public_key,
            peer_id=joined.peer_id,
            key=sim.key,
            credential=joined.credential,
            config=config,
            referee=tracker_referee(client, run_id, joined.peer_id, sim.key, joined.credential),
        )
        app = web.Application()
        app.add_routes(averager.routes())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        out.append(_Member(sim, averager, runner))
    return out


def _unsigned(run_id: str, round_id: str, members: list[GroupMember]) -> GroupAssignment:
    return GroupAssignment(
        run_id=run_id,
        round_id=round_id,
        step=3,
        members=members,
        parts=len(members),
        average_params=False,
        deadline=time.time() + 60,
        seed=0,
        signature="",
    )


def _signed(tracker, run_id: str, round_id: str, members: list[GroupMember]) -> GroupAssignment:
    return sign_assignment(tracker.signer, _unsigned(run_id, round_id, members))


async def _warm_up(tracker, run_id: str, live: list[_Member]) -> None:
    """QUIET_ROUNDS rounds among the live members: each measures how long its rounds take."""
    for i in range(QUIET_ROUNDS):
        a = _signed(tracker, run_id, f"warm{i}", [m.member(j, 1) for j, m in enumerate(live)])
        v = np.ones(1000, dtype=np.float32)
        await asyncio.gather(*(m.averager.allreduce(a, v.copy(), 1.0) for m in live))


@pytest.fixture
async def run(admin):
    spec = make_run_create(target_batch_size=64, averaging=AveragingSpec(group_size=8))
    return (await admin.create_run(spec)).run_id


def _asleep_member(sleeper: SimVolunteer, port: int, weight: int) -> GroupMember:
    """The sleeper's entry in a round of three live members and it: part 3, at ``port`` on loopback."""
    return GroupMember(
        peer_id=sleeper.peer_id,
        address=f"127.0.0.1:{port}",
        public_key=sleeper.key.public_hex,
        weight=weight,
        part=3,
    )


async def _stop(members: list[_Member]) -> None:
    for m in members:
        await m.averager.close()
        await m.runner.cleanup()


async def test_an_owner_asleep_in_the_round_is_cut_and_the_others_apply_one_mean_without_it(
    tracker, admin, run
):
    """Three awake members and one asleep: the three vote, the tracker cuts it; each zeroes its part and
    averages the rest without its copies, all alike; nobody waits for the deadline (60 s here)."""
    live = await _members(tracker, admin, run, 3)
    sleeper = SimVolunteer(admin, run)
    await sleeper.join()
    asleep = socket.socket()  # takes connections, never answers: a stopped process
    asleep.bind(("127.0.0.1", 0))
    asleep.listen(16)
    try:
        await _warm_up(tracker, run, live)
        members = [m.member(j, 10 * (j + 1)) for j, m in enumerate(live)]
        members.append(_asleep_member(sleeper, asleep.getsockname()[1], 40))
        a = _signed(tracker, run, "asleep", members)
        rng = np.random.default_rng(1)
        vectors = [rng.standard_normal(4000).astype(np.float32) for _ in live]
        results = await asyncio.gather(
            *(
                m.averager.allreduce(a, v.copy(), float(10 * (j + 1)))
                for j, (m, v) in enumerate(zip(live, vectors, strict=True))
            )
        )
        assert time.time() < a.deadline - 30  # (the cut, not the deadline, ended it)
        for r in results:
            assert r.failed_parts == (3,), r.reasons
            assert "cut from the round" in r.reasons["part 3"]
            assert not r.late
        lo = part_bounds(4000, 4)[3][0]  # parts 0-2, then the sleeper's
        np.testing.assert_array_equal(results[0].values[:lo], results[1].values[:lo])
        np.testing.assert_array_equal(results[0].values[:lo], results[2].values[:lo])
        w = np.array([10, 20, 30], dtype=np.float64)
        mean = sum(v.astype(np.float64) * wi for v, wi in zip(vectors, w, strict=True)) / w.sum()
        np.testing.assert_allclose(results[0].values[:lo], mean[:lo], rtol=1e-5, atol=1e-6)
        # the sleeper's part keeps each one's own values (the engine zeroes a failed part, alike for all)
        for r, v in zip(results, vectors, strict=True):
            np.testing.assert_array_equal(r.values[lo:], v[lo:])
        assert tracker.runs.get(run).state.cuts.decided["cut"] == 1
    finally:
        asleep.close()
        await _stop(live)


class _AsleepMidAnswer:
    """A part owner that fell asleep halfway through its answer, as the network shows it: it read each member's
    copy whole, sent the status line, the headers and the first bytes of its answer, and nothing since; a
    ping (``GET /v1/awake``) gets no answer (a stopped process: the kernel takes the connection)."""

    def __init__(self) -> None:
        self.answered = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.drains: list[asyncio.Task[bytes]] = []

    async def serve(self) -> asyncio.Server:
        return await asyncio.start_server(self._peer, "127.0.0.1", 0)

    async def _peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)  # (kept open: never closed while "asleep")
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"POST /v1/allreduce/"):
            return  # a ping: never answered
        self.drains.append(asyncio.create_task(reader.read(-1)))  # (its copy: the kernel takes it all)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 4096\r\n\r\n"
        )
        writer.write(b"\x00" * 4)  # (less than a frame header: the rest never comes)
        await writer.drain()
        self.answered += 1


async def test_an_owner_asleep_halfway_through_its_answer_is_cut_like_one_asleep_before_it(
    tracker, admin, run
):
    """Regression (issue 27, a heavy-tail bench run): an owner stopped after it began streaming its answer held
    every member to the round's deadline, because a member with part of an answer never voted. Now a member
    votes on any owner whose answer has not come whole once the round has been quiet and the owner answers
    no ping: the group cuts it, each member drops what it had of that part (all alike), and nobody waits for
    the deadline (60 s here)."""
    live = await _members(tracker, admin, run, 3)
    sleeper = SimVolunteer(admin, run)
    await sleeper.join()
    fake = _AsleepMidAnswer()
    server = await fake.serve()
    try:
        await _warm_up(tracker, run, live)
        members = [m.member(j, 10) for j, m in enumerate(live)]
        members.append(_asleep_member(sleeper, server.sockets[0].getsockname()[1], 10))
        a = _signed(tracker, run, "mid-answer", members)
        vectors = [np.full(4000, float(j + 1), dtype=np.float32) for j in range(3)]
        results = await asyncio.gather(
            *(m.averager.allreduce(a, v.copy(), 10.0) for m, v in zip(live, vectors, strict=True))
        )
        assert fake.answered == 3  # every member had the first bytes of its answer
        assert time.time() < a.deadline - 30  # (the cut, not the deadline, ended it)
        lo = part_bounds(4000, 4)[3][0]
        for r, v in zip(results, vectors, strict=True):
            assert r.failed_parts == (3,) and "cut from the round" in r.reasons["part 3"], r.reasons
            assert not r.late
            np.testing.assert_allclose(r.values[:lo], 2.0)  # (1 + 2 + 3) / 3: without the sleeper's copies
            np.testing.assert_array_equal(r.values[lo:], v[lo:])  # its part: each one's own (then zeroed)
        assert tracker.runs.get(run).state.cuts.decided["cut"] == 1
    finally:
        for w in fake.writers:
            w.close()
        for t in fake.drains:
            t.cancel()
        server.close()
        await _stop(live)


class _Sleepy:
    """A real Averager in a process of its own (tests/sleepy_peer.py), to be stopped and woken."""

    def __init__(self, sim: SimVolunteer, proc: asyncio.subprocess.Process, port: int) -> None:
        self.sim, self.proc, self.port = sim, proc, port

    @classmethod
    async def start(cls, tracker, client: TrackerClient, run_id: str) -> _Sleepy:
        sim = SimVolunteer(client, run_id)
        joined = await sim.join()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.sleepy_peer", stdin=PIPE, stdout=PIPE, env=child_env()
        )
        setup = {
            "run_id": run_id,
            "tracker_url": tracker.url,
            "tracker_public_key": tracker.public_key,
            "peer_id": joined.peer_id,
            "key": sim.key.private_bytes().hex(),
            "credential": encode(joined.credential).decode(),
        }
        proc.stdin.write((json.dumps(setup) + "\n").encode())
        port = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))["port"]
        return cls(sim, proc, port)

    def member(self, part: int, weight: int) -> GroupMember:
        return GroupMember(
            peer_id=self.sim.peer_id,
            address=f"127.0.0.1:{self.port}",
            public_key=self.sim.key.public_hex,
            weight=weight,
            part=part,
        )

    def begin(self, a: GroupAssignment, fill: float, size: int, weight: int) -> None:
        job = {"assignment": json.loads(encode(a)), "fill": fill, "size": size, "weight": weight}
        self.proc.stdin.write((json.dumps(job) + "\n").encode())

    async def result(self) -> dict:
        return json.loads(await asyncio.wait_for(self.proc.stdout.readline(), 60))

    async def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def test_a_member_that_wakes_after_the_group_cut_it_hears_so_and_applies_nothing(tracker, admin, run):
    """The sleeper is a real Averager in its own process, stopped (SIGSTOP) before its round begins: the others'
    copies wait in its socket, its peer answers no ping, and the group cuts it. Woken, it runs its round: its
    copies are refused, its claim says it was cut, so its round is late (it rejoins by replay instead of
    applying what it reduced)."""
    live = await _members(tracker, admin, run, 3)
    sleeper = await _Sleepy.start(tracker, admin, run)
    try:
        await _warm_up(tracker, run, live)
        a = _signed(
            tracker, run, "woke", [*(m.member(j, 8) for j, m in enumerate(live)), sleeper.member(3, 8)]
        )
        sleeper.proc.send_signal(signal.SIGSTOP)
        sleeper.begin(a, 4.0, 2000, 8)  # (read once it wakes)
        vectors = [np.full(2000, float(j + 1), dtype=np.float32) for j in range(3)]
        results = await asyncio.gather(
            *(m.averager.allreduce(a, vectors[j], 8.0) for j, m in enumerate(live))
        )
        assert all(r.failed_parts == (3,) for r in results), [r.reasons for r in results]
        lo = part_bounds(2000, 4)[3][0]
        np.testing.assert_array_equal(results[0].values[:lo], results[2].values[:lo])
        np.testing.assert_allclose(results[0].values[:lo], 2.0)  # (1 + 2 + 3) / 3: without its copies
        sleeper.proc.send_signal(signal.SIGCONT)
        woke = await sleeper.result()
        assert woke["late"] is True  # cut: it must not apply what it reduced
    finally:
        await sleeper.stop()
        await _stop(live)


async def test_two_members_asleep_in_a_round_and_woken_together_are_not_cut_nor_cut_anyone(
    tracker, admin, run
):
    """Two of four stopped inside their round: neither can be cut (each needs the other's vote), and the
    awake members, whose parts wait for the sleepers' copies, answer pings, so woken together the sleepers
    find everyone awake and cut no one: the round completes with one mean, nobody late."""
    live = await _members(tracker, admin, run, 2)
    sleepers = [await _Sleepy.start(tracker, admin, run) for _ in range(2)]
    try:
        members = [
            *(m.member(j, 4) for j, m in enumerate(live)),
            *(s.member(2 + k, 4) for k, s in enumerate(sleepers)),
        ]
        for i in range(QUIET_ROUNDS):  # (every member measures its rounds: the sleepers vote too)
            a = _signed(tracker, run, f"warm-all{i}", members)
            for s in sleepers:
                s.begin(a, 1.0, 800, 4)
            await asyncio.gather(*(m.averager.allreduce(a, np.ones(800, np.float32), 4.0) for m in live))
            assert [(await s.result())["late"] for s in sleepers] == [False, False]
        a = _signed(tracker, run, "both", members)
        for s in sleepers:
            s.begin(a, 3.0, 800, 4)
        await asyncio.sleep(0.005)
        for s in sleepers:
            s.proc.send_signal(signal.SIGSTOP)
        rounds = asyncio.gather(*(m.averager.allreduce(a, np.ones(800, np.float32), 4.0) for m in live))
        await asyncio.sleep(
            2.0
        )  # (the awake ones vote on the sleepers; no cut without the other sleeper's vote)
        for s in sleepers:
            s.proc.send_signal(signal.SIGCONT)
        results = await rounds
        woke = [await s.result() for s in sleepers]
        assert woke == [{"late": False, "failed": []}] * 2
        for r in results:
            assert not r.failed_parts and not r.late, r.reasons
            np.testing.assert_allclose(r.values, 2.0)  # (1 + 1 + 3 + 3) / 4
        assert tracker.runs.get(run).state.cuts.decided["cut"] == 0
    finally:
        for s in sleepers:
            await s.stop()
        await _stop(live)


async def test_with_everyone_awake_no_one_is_cut_and_every_owner_claims_its_part(tracker, admin, run):
    members = await _members(tracker, admin, run, 4)
    try:
        await _warm_up(tracker, run, members[:3])
        cuts = tracker.runs.get(run).state.cuts
        before = dict(cuts.decided)
        a = _signed(tracker, run, "all", [m.member(j, 5) for j, m in enumerate(members)])
        vectors = [np.full(3000, float(j), dtype=np.float32) for j in range(4)]
        results = await asyncio.gather(
            *(m.averager.allreduce(a, vectors[j].copy(), 5.0) for j, m in enumerate(members))
        )
        for r in results:
            assert not r.failed_parts and not r.late
            np.testing.assert_allclose(r.values, 1.5)
        assert cuts.decided == {"cut": before["cut"], "kept": before["kept"] + 4}  # one claim per owner
    finally:
        await _stop(members)


async def test_the_tracker_refuses_cut_calls_it_cannot_trust(tracker, admin, run):
    a, b = SimVolunteer(admin, run), SimVolunteer(admin, run)
    await a.join()
    await b.join()
    members = [
        GroupMember(
            peer_id=p.peer_id, address=f"127.0.0.1:{i + 1}", public_key=p.key.public_hex, weight=1, part=i
        )
        for i, p in enumerate((a, b))
    ]
    good = _signed(tracker, run, "g", members)
    forged = sign_assignment(SigningKey(), _unsigned(run, "g", members))

    async def call(assignment: GroupAssignment, owner: str, tag: str = "grad") -> str:
        msg = CutCall(peer_id=a.peer_id, assignment=assignment, tag=tag, owner=owner)
        return (await admin.cut(run, msg, a.key, a.joined.credential, 1.0)).decision

    with pytest.raises(TrackerError, match="not one this tracker signed"):
        await call(forged, b.peer_id)
    with pytest.raises(TrackerError, match="owns no part"):
        await call(good, "nobody")
    with pytest.raises(TrackerError, match="runs under grad and params, not grad-p3"):
        await call(good, b.peer_id, "grad-p3")  # (a tag of another phase: no cases out of thin air)
    stranger = SimVolunteer(admin, run)
    await stranger.join()
    with pytest.raises(TrackerError, match="not a member"):
        msg = CutCall(peer_id=stranger.peer_id, assignment=good, tag="grad", owner=b.peer_id)
        await admin.cut(run, msg, stranger.key, stranger.joined.credential, 1.0)
    assert await call(good, a.peer_id) == "kept"  # its own claim
