"""Hostile input the other suites leave out: per-IP rate limits on the tracker's announces, a live
tracker fuzzed through its announce and scrape query strings (only bencoded ``failure reason``s, never a
500), ``crowdtrain dataset info`` on mutated manifests and torrents (a sentence, never a traceback), and a
flood of bogus all-reduce POSTs against a real peer server (refused, nothing retained, memory bounded).

Unit-level fuzzing of frames and JSON messages lives in ``test_fuzz_protocol.py``; parse-level fuzzing of
announce strings in ``test_tracker_announce.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import json
import os
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote_from_bytes

import aiohttp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from crowdtrain.cli import app
from crowdtrain.datasets.make import make_dataset
from crowdtrain.protocol import bencode
from crowdtrain.protocol.credentials import SigningKey, issue_credential
from crowdtrain.protocol.errors import CrowdtrainError, ProtocolError
from crowdtrain.protocol.messages import DatasetManifest, decode
from crowdtrain.protocol.peerauth import sign_headers
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from crowdtrain.volunteer.averaging import Averager, AveragingConfig
from crowdtrain.volunteer.averaging.wire import HEADER_ELEMENTS, HEADER_WEIGHT
from crowdtrain.volunteer.peer_server import PeerServer
from tests.sim import make_torrent

FUZZ = settings(
    max_examples=int(os.environ.get("CROWDTRAIN_FUZZ_EXAMPLES", "120")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
INFO_HASH = bencode.infohash_v1(make_torrent("fuzz", b"y" * 20000))


# ---------------------------------------------------------------------------------------------- rate limits


async def test_announces_beyond_the_per_address_rate_get_a_failure_reason_and_others_are_not_affected():
    config = TrackerConfig(open=True, announce_rate_per_s=0.01, announce_burst=5)
    async with serve(config) as tracker, aiohttp.ClientSession() as http:
        query = (
            f"info_hash={quote_from_bytes(bytes.fromhex(INFO_HASH))}&peer_id={'-CT0001-' + 'a' * 12}"
            "&port=6881&uploaded=0&downloaded=0&left=0&compact=1"
        )

        async def announce() -> dict:
            async with http.get(f"{tracker.url}/announce?{query}") as resp:
                assert resp.status == 200
                return bencode.decode(await resp.read())

        replies = [await announce() for _ in range(8)]
        assert all(b"interval" in r for r in replies[:5]), replies[:5]
        for r in replies[5:]:
            assert b"too many announces from your address" in r[b"failure reason"], r
        async with http.get(
            f"{tracker.url}/scrape?info_hash={quote_from_bytes(bytes.fromhex(INFO_HASH))}"
        ) as r:
            assert b"too many scrapes" in bencode.decode(await r.read())[b"failure reason"]
        # the limit is per address: a request from another client address is served
        tracker.announce_limit.state.pop("127.0.0.1")
        assert b"interval" in await announce()
        assert len(tracker.announce_limit.state) == 1


# ---------------------------------------------------------------------------------------------- live announce fuzz


@pytest.fixture(scope="module")
def threaded_tracker() -> Iterator[tuple[str, int]]:
    """A real tracker in a thread of its own, for the whole module: hypothesis drives it with blocking HTTP
    requests from a plain test, which the ``tracker`` fixture (served by the test's own event loop) cannot
    answer."""
    ready: list = []
    started = threading.Event()
    loop_box: list[asyncio.AbstractEventLoop] = []
    stop_box: list[asyncio.Event] = []

    async def main() -> None:
        stop = asyncio.Event()
        stop_box.append(stop)
        loop_box.append(asyncio.get_running_loop())
        async with serve(TrackerConfig(announce_rate_per_s=0)) as tracker:
            tracker.registered.add(bytes.fromhex(INFO_HASH))
            ready.append(tracker)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(30), "the tracker did not start"
    tracker = ready[0]
    yield "127.0.0.1", tracker.port
    loop_box[0].call_soon_threadsafe(stop_box[0].set)
    thread.join(30)
    assert tracker.metrics is not None


def get(host: str, port: int, target: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", target)
        resp = conn.getresponse()
        return resp.status, resp.read(1 << 20)
    finally:
        conn.close()


def escaped(raw: bytes) -> str:
    return quote_from_bytes(raw, safe="")


KEYS = ["info_hash", "peer_id", "port", "uploaded", "downloaded", "left", "compact", "event", "numwant"]
KEYS += ["ip", "key", "trackerid", "no_peer_id", "ipv6", "ipv4", ""]
values = st.one_of(
    st.binary(max_size=30).map(escaped),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["started", "stopped", "completed", "paused", "1", "0", "nan", "inf", "-0", "%", "%zz"]),
    st.just(escaped(bytes.fromhex(INFO_HASH))),
    st.text(alphabet="abcdefXYZ0123456789%+-._~", max_size=40),
)
pairs = st.lists(
    st.tuples(st.one_of(st.sampled_from(KEYS), st.text(alphabet="abz_%=&", max_size=8)), values), max_size=14
)
junk = st.text(alphabet="".join(chr(c) for c in range(0x21, 0x7F)), max_size=400)


@FUZZ
@given(query=st.one_of(pairs.map(lambda ps: "&".join(f"{k}={v}" for k, v in ps)), junk))
def test_live_announce_answers_any_query_with_bencode_never_a_500(threaded_tracker, query):
    host, port = threaded_tracker
    for path in ("/announce", "/scrape"):
        status, body = get(host, port, f"{path}?{query}")
        assert status == 200, (path, query, status, body[:200])
        reply = bencode.decode(body)
        assert isinstance(reply, dict)
        if b"failure reason" in reply:
            reason = reply[b"failure reason"].decode()
            assert len(reason.split()) >= 3 and "Traceback" not in reason, reason
        elif path == "/announce":
            assert b"interval" in reply and b"peers" in reply, reply


def test_oversized_announce_line_is_refused_by_http_not_by_a_crash(threaded_tracker):
    host, port = threaded_tracker
    status, _ = get(host, port, "/announce?" + "a" * 20_000)
    assert status in (200, 400, 414, 431)
    assert get(host, port, "/healthz")[0] == 200  # still serving


# ---------------------------------------------------------------------------------------------- dataset info


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz-dataset") / "ds"
    make_dataset("builtin:stdlib", out, chunk_bytes=64 * 1024, name="fuzz", max_bytes=200 * 1024)
    return out


runner = CliRunner()


def dataset_info(path: Path) -> tuple[int, str]:
    """``crowdtrain dataset info PATH --json`` in this process; (exit code, output). The root's ``main``
    turns a CrowdtrainError into one sentence and exit 1, so that is the only exception allowed here."""
    result = runner.invoke(app, ["dataset", "info", str(path), "--json"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        assert isinstance(result.exception, CrowdtrainError), (
            f"dataset info crashed with {type(result.exception).__name__}: {result.exception}"
        )
        text = str(result.exception)
        assert len(text.split()) >= 4 and "Traceback" not in text, text
        return 1, text
    return result.exit_code, result.output


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    buf = bytearray(data)
    for pos, byte in edits:
        if buf:
            buf[pos % len(buf)] = byte
    return bytes(buf[:cut] if cut is not None else buf)


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 4000)),
)
def test_mutated_manifest_is_a_protocol_error_or_a_manifest(dataset, edits, cut):
    data = mutate((dataset / "manifest.json").read_bytes(), edits, cut)
    try:
        m = decode(data, DatasetManifest)
    except ProtocolError as exc:
        assert str(exc)
        return
    assert isinstance(m, DatasetManifest)


@settings(FUZZ, max_examples=min(FUZZ.max_examples, 40))
@given(
    edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 4000)),
    which=st.sampled_from(["manifest", "torrent"]),
)
def test_dataset_info_on_a_mutated_folder_prints_info_or_one_sentence(
    dataset, tmp_path_factory, edits, cut, which
):
    folder = tmp_path_factory.mktemp("mutated")
    for f in dataset.iterdir():
        if f.name == "manifest.json" or f.suffix == ".torrent":
            data = f.read_bytes()
            hit = (which == "manifest") == (f.name == "manifest.json")
            (folder / f.name).write_bytes(mutate(data, edits, cut) if hit else data)
    code, out = dataset_info(folder)
    if code == 0:
        assert json.loads(out)["name"]
    else:
        assert code == 1 and out


@settings(FUZZ, max_examples=min(FUZZ.max_examples, 60))
@given(
    data=st.one_of(
        st.binary(max_size=2000),
        st.builds(
            mutate,
            st.just(make_torrent("fuzz", b"z" * 50000)),
            st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4),
            st.one_of(st.none(), st.integers(0, 400)),
        ),
        st.integers(1, 100_000).map(lambda depth: b"l" * depth + b"e" * depth),  # deep nesting
        st.integers(0, 2**62).map(
            lambda n: b"d4:infod6:lengthi%de4:name1:x12:piece lengthi16384e6:pieces0:ee" % n
        ),
    )
)
def test_dataset_info_on_a_hostile_torrent_prints_info_or_one_sentence(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("torrent") / "x.torrent"
    path.write_bytes(data)
    code, out = dataset_info(path)
    assert code in (0, 1), out
    if code == 0:
        assert json.loads(out)["infohash"]


def test_dataset_info_refuses_a_huge_file_before_reading_it(tmp_path):
    path = tmp_path / "huge.torrent"
    with path.open("wb") as f:
        f.truncate(200 << 20)  # sparse: costs no disk
    code, text = dataset_info(path)
    assert code == 1 and "larger than" in text, text


# ---------------------------------------------------------------------------------------------- peer-server flood


async def test_flood_of_bogus_allreduce_posts_is_refused_and_retains_nothing():
    tracker_key = SigningKey()
    run_id = "run-flood"
    key = SigningKey()
    credential = issue_credential(tracker_key, run_id, "owner", key.public_hex, 3600)
    averager = Averager(
        run_id=run_id,
        tracker_public_key=tracker_key.public_hex,
        peer_id="owner",
        key=key,
        credential=credential,
        config=AveragingConfig(assignment_wait_s=0.2),
    )
    server = PeerServer("127.0.0.1", 0)
    server.add_routes(averager.routes())
    port = await server.start()
    attacker = SigningKey()
    member = issue_credential(tracker_key, run_id, "member", attacker.public_hex, 3600)
    body = np.random.default_rng(0).bytes(1 << 20)  # 1 MiB of noise per request
    statuses: dict[int, int] = {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as http:

            async def post(i: int) -> None:
                headers = {HEADER_WEIGHT: "1.0", HEADER_ELEMENTS: str(1 << 18)}
                if i % 2:  # half are signed by a real run member, for rounds this peer never had
                    fields = (f"r{i}/grad", 0, "1.0", str(1 << 18))
                    headers |= sign_headers(attacker, member, "allreduce", *fields)
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.post(
                        f"http://127.0.0.1:{port}/v1/allreduce/r{i}/grad/0", data=body, headers=headers
                    ) as r:
                        statuses[r.status] = statuses.get(r.status, 0) + 1
                        assert len(await r.read()) < 4096

            await asyncio.gather(*(post(i) for i in range(8)))  # warm up allocators and the connection pool
            gc.collect()
            tracemalloc.start()
            try:
                await asyncio.gather(*(post(i) for i in range(8, 208)))
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    finally:
        await averager.close()
        await server.stop()
    # 200 MiB were posted; the server never held more than a few bodies' worth of buffers at once
    assert peak < 48 << 20, f"peak traced memory during the flood was {peak / 2**20:.1f} MiB"
    assert statuses.get(401, 0) >= 100 and statuses.get(404, 0) >= 100, statuses
    assert set(statuses) <= {401, 404}, statuses
    assert averager.owner.rounds == {} and len(averager.owner.finished) == 0


@pytest.mark.tracker_config(peer_ttl_s=3.0, heartbeat_interval_s=1.0)
async def test_a_slowloris_trickling_header_bytes_is_closed_and_others_are_answered_meanwhile(tracker):
    """A client that opens connections and sends header bytes now and then, never finishing a request, is
    disconnected once it completed no request for ``peer_ttl_s`` (aiohttp's default held it an hour); the
    tracker answers others all along. A volunteer's peer server does the same after IDLE_S."""
    host, port = tracker.url.removeprefix("http://").split(":")
    slow = [await asyncio.open_connection(host, int(port)) for _ in range(5)]
    for _, writer in slow:
        writer.write(b"GET /api/v1/runs HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # a header line that never ends
    closed: set[int] = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(200):  # (a bound against a hang, not a timing: each turn is ~0.1 s)
            for i, (reader, writer) in enumerate(slow):
                if i in closed:
                    continue
                with contextlib.suppress(ConnectionError):
                    writer.write(b"a")  # (a byte at a time: far from any header size limit)
                    await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1024), 0.02) == b"":
                        closed.add(i)
                except ConnectionError:  # (reset: a byte was written after the tracker closed it)
                    closed.add(i)
                except TimeoutError:
                    pass
            if len(closed) == len(slow):
                break
            async with session.get(tracker.url + "/healthz") as resp:  # others are answered meanwhile
                assert resp.status == 200
    for _, writer in slow:
        writer.close()
    assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow connections were still open"


async def _healthz_over(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """The first line of the answer to ``GET /healthz`` over an open connection."""
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    return await asyncio.wait_for(reader.readline(), 10)


async def test_connections_beyond_the_per_address_bound_get_a_sentence_and_other_addresses_are_served(
    tracker,
):
    """Issue 29: one address holds at most MAX_CONNECTIONS_PER_ADDRESS open connections (many slow ones
    would each be held until their idle limit); the next is answered 503 with a sentence and closed, while
    another address is served, a connection closed frees a place, and this machine's own (127.0.0.1) are
    not counted. (Each side sends from its own loopback address.)"""
    from crowdtrain.protocol.serving import MAX_CONNECTIONS_PER_ADDRESS

    host, port = tracker.url.removeprefix("http://").split(":")

    async def connect(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, int(port), local_addr=(source, 0))

    held = [await connect("127.0.0.2") for _ in range(MAX_CONNECTIONS_PER_ADDRESS)]
    mine = [await connect("127.0.0.1") for _ in range(MAX_CONNECTIONS_PER_ADDRESS + 1)]
    try:
        assert await _healthz_over(*held[-1]) == b"HTTP/1.1 200 OK\r\n"  # the last one within the bound
        reader, writer = await connect("127.0.0.2")
        answer = await asyncio.wait_for(reader.read(), 10)  # (then closed)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        sentence = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert f"more than {MAX_CONNECTIONS_PER_ADDRESS} connections are open from your address" in sentence
        held.append(await connect("127.0.0.3"))
        assert await _healthz_over(*held[-1]) == b"HTTP/1.1 200 OK\r\n"  # another address
        assert await _healthz_over(*mine[-1]) == b"HTTP/1.1 200 OK\r\n"  # (127.0.0.1: not counted)
        held.pop(0)[1].close()  # one of 127.0.0.2's closed: a place is free again
        for _ in range(100):  # (a bound against a hang: the server sees the close within a loop turn or two)
            reader, writer = await connect("127.0.0.2")
            first = await _healthz_over(reader, writer)
            if first == b"HTTP/1.1 200 OK\r\n":
                held.append((reader, writer))
                break
            writer.close()
            await asyncio.sleep(0.05)
        assert first == b"HTTP/1.1 200 OK\r\n", first
    finally:
        for _, writer in held + mine:
            writer.close()


@pytest.mark.slow
async def test_a_volunteers_peer_server_closes_a_slowloris_after_its_idle_limit():
    """The same on a volunteer's peer server (its limit is IDLE_S, 30 s; here 3 s, the same mechanism)."""
    from crowdtrain.volunteer.peer_server import PeerServer

    server = PeerServer("127.0.0.1", 0, idle_s=3.0)
    port = await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/allreduce/r/grad/0 HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        closed = False
        for _ in range(int(4 * server.idle_s)):  # (a bound against a hang: each turn is ~0.5 s)
            with contextlib.suppress(ConnectionError):
                writer.write(b"a")
                await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1024), 0.5) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionError:
                closed = True
                break
        writer.close()
        assert closed, "the peer server still held the slow connection"
    finally:
        await server.stop()
