"""BitTorrent announce and scrape on a real tracker: BEP 3/7/23/48 answers, every malformed announce as a
bencoded failure reason (never a 500), and a real libtorrent session announcing."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import socket
import time
from urllib.parse import quote_from_bytes

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain.protocol import bencode
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from tests.harness import until
from tests.sim import make_torrent

IH = hashlib.sha1(b"registered").digest()


@pytest.fixture
async def tracker(tracker):
    """The conftest ``tracker``, with the data set ``IH`` registered."""
    async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as c:
        await c.register_dataset(IH.hex(), "test set")
    return tracker


def q(**params) -> str:
    parts = []
    for k, v in params.items():
        raw = v if isinstance(v, bytes) else str(v).encode()
        parts.append(f"{k}={quote_from_bytes(raw, safe='')}")
    return "&".join(parts)


async def get(url: str, path: str, query: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}{path}?{query}" if query else f"{url}{path}") as r:
            return r.status, bencode.decode(await r.read())


def peer_id(i: int) -> bytes:
    return b"-CT0001-" + f"{i:012d}".encode()


async def announce(url, **params):
    base = {"info_hash": IH, "peer_id": peer_id(1), "port": 6881, "uploaded": 0, "downloaded": 0, "left": 100}
    base.update(params)
    return await get(url, "/announce", q(**{k: v for k, v in base.items() if v is not None}))


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"info_hash": None}, "the announce lacks the 'info_hash' parameter"),
        ({"info_hash": b"short"}, "info_hash must be 20 bytes, got 5"),
        ({"info_hash": b"x" * 21}, "info_hash must be 20 bytes, got 21"),
        ({"peer_id": b"abc"}, "peer_id must be 20 bytes, got 3"),
        ({"peer_id": None}, "the announce lacks the 'peer_id' parameter"),
        ({"port": None}, "the announce lacks the 'port' parameter"),
        ({"port": "http"}, "'port' must be a non-negative integer, got b'http'"),
        ({"port": 70000}, "'port' must be between 1 and 65535, got 70000"),
        ({"left": "-5"}, "'left' must be a non-negative integer, got b'-5'"),
        ({"numwant": "lots"}, "'numwant' must be a non-negative integer, got b'lots'"),
        ({"compact": 2}, "'compact' must be between 0 and 1, got 2"),
        ({"event": "exploded"}, "'event' must be started, stopped, completed or empty, got b'exploded'"),
        (
            {"info_hash": hashlib.sha1(b"nobody").digest()},
            f"info_hash {hashlib.sha1(b'nobody').hexdigest()} is not registered with this tracker",
        ),
    ],
)
async def test_malformed_announce_gets_a_failure_reason(tracker, params, reason):
    status, reply = await announce(tracker.url, **params)
    assert status == 200
    assert reply == {b"failure reason": reason.encode()}


async def test_oversized_query_is_a_failure_reason(tracker):
    status, reply = await get(tracker.url, "/announce", "x=" + "a" * 8100)
    assert status == 200
    assert reply == {b"failure reason": b"the query string is longer than 8000 bytes"}


async def test_compact_announce_returns_other_peers(tracker):
    status, first = await announce(tracker.url, event="started", peer_id=peer_id(1), port=1111)
    assert status == 200
    assert (first[b"interval"], first[b"min interval"], first[b"peers"]) == (30, 5, b"")
    assert (first[b"complete"], first[b"incomplete"]) == (0, 1)
    await announce(tracker.url, event="started", peer_id=peer_id(2), port=2222, left=0)
    _, third = await announce(tracker.url, event="started", peer_id=peer_id(3), port=3333)
    peers = third[b"peers"]
    assert len(peers) == 12
    got = {
        (str(ipaddress.IPv4Address(peers[i : i + 4])), int.from_bytes(peers[i + 4 : i + 6], "big"))
        for i in (0, 6)
    }
    assert got == {("127.0.0.1", 1111), ("127.0.0.1", 2222)}
    assert (third[b"complete"], third[b"incomplete"]) == (1, 2)
    _, limited = await announce(tracker.url, peer_id=peer_id(3), port=3333, numwant=1)
    assert len(limited[b"peers"]) == 6


async def test_non_compact_lists_dicts_and_honours_no_peer_id(tracker):
    await announce(tracker.url, peer_id=peer_id(1), port=1111)
    _, reply = await announce(tracker.url, peer_id=peer_id(2), port=2222, compact=0)
    assert reply[b"peers"] == [{b"ip": b"127.0.0.1", b"port": 1111, b"peer id": peer_id(1)}]
    _, reply = await announce(tracker.url, peer_id=peer_id(2), port=2222, compact=0, no_peer_id=1)
    assert reply[b"peers"] == [{b"ip": b"127.0.0.1", b"port": 1111}]


async def test_stopped_removes_and_completed_counts_in_scrape(tracker):
    await announce(tracker.url, peer_id=peer_id(1), event="started")
    await announce(tracker.url, peer_id=peer_id(2), event="started")
    await announce(tracker.url, peer_id=peer_id(2), event="completed", left=0)
    await announce(tracker.url, peer_id=peer_id(1), event="stopped")
    status, reply = await get(tracker.url, "/scrape", q(info_hash=IH))
    assert status == 200
    assert reply == {b"files": {IH: {b"complete": 1, b"incomplete": 0, b"downloaded": 1}}}
    # without info_hash: every registered set; unregistered hashes are left out
    _, everything = await get(tracker.url, "/scrape", "")
    assert list(everything[b"files"]) == [IH]
    _, none = await get(tracker.url, "/scrape", q(info_hash=hashlib.sha1(b"nobody").digest()))
    assert none == {b"files": {}}
    _, bad = await get(tracker.url, "/scrape", q(info_hash=b"short"))
    assert bad == {b"failure reason": b"info_hash must be 20 bytes, got 5"}


async def test_open_tracker_serves_any_info_hash():
    async with serve(TrackerConfig(open=True)) as t:
        other = hashlib.sha1(b"anything").digest()
        status, reply = await announce(t.url, info_hash=other)
        assert status == 200 and b"failure reason" not in reply
        assert reply[b"incomplete"] == 1


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
async def test_ipv6_peers_come_in_peers6():
    async with serve(TrackerConfig(host="::1", open=True)) as t:
        assert t.url.startswith("http://[::1]:")
        await announce(t.url, peer_id=peer_id(1), port=4444)
        _, reply = await announce(t.url, peer_id=peer_id(2), port=5555)
        assert reply[b"peers"] == b""
        assert reply[b"peers6"] == ipaddress.IPv6Address("::1").packed + (4444).to_bytes(2, "big")


async def test_run_creation_registers_its_info_hash(tracker):
    from tests.sim import make_run_create

    create = make_run_create()
    async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as c:
        await c.create_run(create)
    _, reply = await announce(tracker.url, info_hash=bytes.fromhex(create.dataset.infohash))
    assert b"failure reason" not in reply


async def test_a_real_libtorrent_session_announces(tracker, tmp_path):
    lt = pytest.importorskip("libtorrent")
    data = bytes(range(256)) * 400
    (tmp_path / "set.bin").write_bytes(data)
    torrent = make_torrent("set.bin", data, announce=tracker.announce_url)
    async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as c:
        await c.register_dataset(bencode.infohash_v1(torrent), "set.bin")
    ses = lt.session(
        {
            "listen_interfaces": "127.0.0.1:0",
            "enable_dht": False,
            "enable_lsd": False,
            "enable_upnp": False,
            "enable_natpmp": False,
            "allow_multiple_connections_per_ip": True,
            "enable_outgoing_utp": False,
            "enable_incoming_utp": False,
            "min_announce_interval": 5,
            "tick_interval": 100,
            "alert_mask": lt.alert_category.status | lt.alert_category.tracker | lt.alert_category.error,
        }
    )
    atp = lt.add_torrent_params()
    atp.ti = lt.torrent_info(torrent)
    atp.save_path = str(tmp_path)
    handle = ses.add_torrent(atp)
    replies: list[str] = []
    errors: list[str] = []
    deadline = time.monotonic() + 60
    while not replies and time.monotonic() < deadline:
        await asyncio.to_thread(ses.wait_for_alert, 250)
        for alert in ses.pop_alerts():
            if isinstance(alert, lt.tracker_reply_alert):
                replies.append(alert.message())
            elif isinstance(alert, lt.tracker_error_alert):
                errors.append(alert.message())
    assert replies, f"libtorrent never got a tracker reply (errors: {errors})"
    listen_port = ses.listen_port()
    # the tracker now knows the libtorrent peer: another client is told its address and port
    _, reply = await announce(
        tracker.url, info_hash=bytes.fromhex(bencode.infohash_v1(torrent)), peer_id=peer_id(9)
    )
    peers = reply[b"peers"]
    assert (peers[:4], int.from_bytes(peers[4:6], "big")) == (bytes([127, 0, 0, 1]), listen_port)
    # removed, it says "stopped": the tracker forgets it (and libtorrent's destructor, which holds the GIL while
    # it waits for that announce, up to 5 s, finds nothing left to wait for)
    ses.remove_torrent(handle)

    async def forgotten() -> bool:
        _, reply = await announce(
            tracker.url, info_hash=bytes.fromhex(bencode.infohash_v1(torrent)), peer_id=peer_id(9)
        )
        return reply[b"peers"] == b""

    await until(forgotten, 30, "the tracker forgetting the peer on its stopped announce")
    del ses


query_text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_=&%0123456789ABCDEF+-.", max_size=300)


@given(query_text)
def test_any_query_string_parses_or_fails_with_a_reason(raw):
    from crowdtrain.protocol.errors import ProtocolError
    from crowdtrain.tracker.announce import answer_announce, parse_announce
    from crowdtrain.tracker.swarm import Swarms

    try:
        req = parse_announce(raw, 200)
        answer_announce(req, "127.0.0.1", Swarms(100), 30, 5, 100)
    except ProtocolError as exc:
        assert str(exc)


def test_swarm_index_stays_consistent_and_samples_are_distinct():
    import random

    from crowdtrain.tracker.swarm import Swarm, SwarmPeer

    swarm = Swarm()
    rng = random.Random(5)
    alive: set[bytes] = set()
    for step in range(3000):
        pid = f"{rng.randrange(400):020d}".encode()
        if rng.random() < 0.3:
            swarm.remove(pid)
            alive.discard(pid)
        else:
            swarm.upsert(SwarmPeer(pid, "127.0.0.1", bytes(4), 1 + step % 60000, rng.random() < 0.5, 0.0))
            alive.add(pid)
        if step % 100 == 0 and alive:
            assert {p.peer_id for p in swarm.peers} == alive
            assert all(swarm.peers[i].peer_id == pid for pid, i in swarm.index.items())
            assert swarm.seeders == sum(p.seeding for p in swarm.peers)
            me = next(iter(alive))
            got = swarm.sample(50, exclude=me)
            assert len(got) == min(50, len(alive) - 1)
            assert len({p.peer_id for p in got}) == len(got) and me not in {p.peer_id for p in got}
