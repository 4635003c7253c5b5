"""Serving and fetching state between real aiohttp servers on 127.0.0.1:0 (no mocks of the network)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
import zstandard
from aiohttp import web

from crowdtrain.protocol.credentials import SigningKey, issue_credential
from crowdtrain.protocol.errors import ConfigError, StateSyncError
from crowdtrain.protocol.messages import Donor, StateManifest, decode, replace
from crowdtrain.protocol.peerauth import sign_headers
from crowdtrain.volunteer.events import DonorBanned, Event, StateLoaded, StateSyncProgress, StateSyncStarted
from crowdtrain.volunteer.state.config import StateConfig
from crowdtrain.volunteer.state.fetch import fetch_state
from crowdtrain.volunteer.state.serve import StateServer
from crowdtrain.volunteer.state.snapshot import Snapshot, load_snapshot
from tests.harness import closed_port
from tests.snapshots import content, make_snapshot, manifest_of, snapshot_file

KiB = 1 << 10
RUN = "run-state"
TRACKER = SigningKey()
CONFIG = StateConfig(range_bytes=64 * KiB, connect_timeout_s=2.0, read_timeout_s=10.0, range_timeout_s=30.0)


def snapshot(
    directory: Path, *, params: int = 150_000, seed: int = 0, zeros: bool = False, noise: bool = False
) -> Snapshot:
    """A small state, in a file in ``directory``; ``zeros`` compresses well, ``noise`` (uniform random bytes)
    not at all."""
    gen = torch.Generator().manual_seed(seed)
    if noise:
        w = torch.randint(0, 256, (params * 4,), dtype=torch.uint8, generator=gen)
    else:
        w = torch.zeros(params) if zeros else torch.randn(params, generator=gen)
    model = {"w": w, "b": torch.ones(7)}
    exp_avg = (
        torch.zeros(params)
        if not noise
        else torch.randint(0, 256, (params * 4,), dtype=torch.uint8, generator=gen)
    )
    opt = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": exp_avg}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}],
    }
    return make_snapshot(
        directory,
        run_id=RUN,
        step=12,
        recipe="tiny",
        args={"n": params},
        model_state=model,
        optimizer_state=opt,
        scheduler_state=None,
        range_bytes=64 * KiB,
    )


@dataclasses.dataclass
class Watch:
    """A donor's state (not manifest) answers, as its middleware sees them from outside the server."""

    uploading: int = 0  # requests being answered now
    bodies: list[int] = dataclasses.field(default_factory=list)  # body bytes of each range or state answered
    refused: int = 0  # 503 "busy" answers


@dataclasses.dataclass
class Peer:
    peer_id: str
    server: StateServer
    runner: web.AppRunner
    port: int
    key: SigningKey
    watch: Watch

    @property
    def donor(self) -> Donor:
        return Donor(peer_id=self.peer_id, address=f"127.0.0.1:{self.port}", public_key=self.key.public_hex)

    async def stop(self) -> None:
        await self.runner.cleanup()


class Peers:
    def __init__(self) -> None:
        self.started: list[Peer] = []

    async def start(
        self, peer_id: str, config: StateConfig = CONFIG, publish: Snapshot | None = None
    ) -> Peer:
        server = StateServer(run_id=RUN, tracker_public_key=TRACKER.public_hex, config=config)
        if publish is not None:
            server.publish(publish)
        watch = Watch()

        @web.middleware
        async def count_uploads(request: web.Request, handler):
            """Watches the donor from outside: a state range is in flight while its handler runs; an answer
            counts its body (as declared: a body cut short by the client counts whole) once it is sent."""
            if request.path.endswith("/manifest"):
                return await handler(request)
            watch.uploading += 1
            try:
                response = await handler(request)
            except web.HTTPServiceUnavailable:
                watch.refused += 1
                raise
            finally:
                watch.uploading -= 1
            if response.status in (200, 206) and response.content_length is not None:
                watch.bodies.append(response.content_length)
            return response

        app = web.Application(middlewares=[count_uploads])
        app.add_routes(server.routes())
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        peer = Peer(peer_id, server, runner, port, SigningKey(), watch)
        self.started.append(peer)
        return peer


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    p = Peers()
    yield p
    for peer in p.started:
        await peer.stop()


def newcomer() -> tuple[SigningKey, object]:
    key = SigningKey()
    return key, issue_credential(TRACKER, RUN, "newcomer", key.public_hex, ttl_s=600)


async def fetch(
    snap: Snapshot, donors: list[Donor], config: StateConfig = CONFIG, events: list[Event] | None = None
) -> bytes:
    key, cred = newcomer()
    return await fetch_state(
        donors=donors,
        version=snap.version,
        run_id=RUN,
        key=key,
        credential=cred,
        config=config,
        emit=(events.append if events is not None else lambda e: None),
    )


# ------------------------------------------------------------------ fetching


async def test_fetch_from_three_donors_equals_the_original_and_emits_events(peers, tmp_path):
    snap = snapshot(tmp_path)
    donors = [(await peers.start(f"d{i}", publish=snap)) for i in range(3)]
    events: list[Event] = []
    data = await fetch(snap, [d.donor for d in donors], events=events)
    assert data == content(snap)
    assert len(snap.manifest.range_sha256) > 6
    kinds = [type(e) for e in events]
    assert kinds[0] is StateSyncStarted and kinds[-1] is StateLoaded and StateSyncProgress in kinds
    started, loaded = events[0], events[-1]
    assert started.total_bytes == len(content(snap)) and len(started.donors) == 3
    assert loaded.step == 12 and loaded.content_hash == snap.content_hash
    assert load_snapshot(data).step == 12


async def test_ranges_are_spread_over_donors_with_the_same_rate(peers, tmp_path):
    snap = snapshot(tmp_path, params=200_000)
    slow = dataclasses.replace(CONFIG, upload_rate=1 << 20)
    donors = [(await peers.start(f"d{i}", config=slow, publish=snap)) for i in range(3)]
    events: list[Event] = []
    assert await fetch(snap, [d.donor for d in donors], events=events) == content(snap)
    assert len(events[-1].donors_used) == 3
    assert all(d.watch.bodies for d in donors)  # each answered ranges


async def test_donor_stopped_mid_transfer_the_others_complete_it(peers, tmp_path):
    snap = snapshot(tmp_path, params=300_000)
    slow = dataclasses.replace(CONFIG, upload_rate=512 * KiB)
    donors = [(await peers.start(f"d{i}", config=slow, publish=snap)) for i in range(3)]
    victim = donors[0]

    async def stop_when_uploading() -> None:
        while sum(victim.watch.bodies) < 128 * KiB or not victim.watch.uploading:
            await asyncio.sleep(0.01)
        assert victim.watch.uploading > 0  # it is stopped with ranges in flight
        await victim.stop()

    events: list[Event] = []
    async with asyncio.timeout(90):
        stopper = asyncio.create_task(stop_when_uploading())
        data = await fetch(snap, [d.donor for d in donors], events=events)
        await stopper
    assert data == content(snap)
    assert len(victim.watch.bodies) < len(snap.manifest.range_sha256)  # the others sent the rest
    assert hashlib.sha256(data).hexdigest() == snap.content_hash


async def test_donor_flipping_one_byte_is_banned_and_state_is_still_correct(peers, tmp_path):
    snap = snapshot(tmp_path)
    flipped = bytearray(content(snap))
    flipped[1000] ^= 0x01  # in range 0
    liar = await peers.start("liar", publish=snapshot_file(tmp_path, bytes(flipped), snap.manifest))
    honest = [(await peers.start(f"d{i}", publish=snap)) for i in range(2)]
    # Workers start in donor order and take ranges from the front of the queue: the liar's first worker
    # asks for range 0 before any other worker runs.
    events: list[Event] = []
    data = await fetch(snap, [liar.donor] + [d.donor for d in honest], events=events)
    assert data == content(snap)
    banned = [e for e in events if isinstance(e, DonorBanned)]
    assert [e.donor for e in banned] == [f"liar at 127.0.0.1:{liar.port}"]
    assert banned[0].reason == "sent range 0 with a wrong sha256"
    assert isinstance(events[-1], StateLoaded)


async def test_donor_flipping_a_byte_in_every_range_it_sends_is_banned(peers, tmp_path):
    snap = snapshot(tmp_path)
    bad = bytes(b ^ 0xFF if i % (64 * KiB) == 5 else b for i, b in enumerate(content(snap)))
    liar = await peers.start("liar", publish=snapshot_file(tmp_path, bad, snap.manifest))
    honest = await peers.start("honest", publish=snap)
    events: list[Event] = []
    data = await fetch(snap, [liar.donor, honest.donor], events=events)
    assert data == content(snap)
    banned = [e for e in events if isinstance(e, DonorBanned)]
    assert [e.donor for e in banned] == [f"liar at 127.0.0.1:{liar.port}"]
    assert "wrong sha256" in banned[0].reason
    loaded = next(e for e in events if isinstance(e, StateLoaded))
    assert loaded.donors_used == (f"honest at 127.0.0.1:{honest.port}",)


async def test_donor_with_a_manifest_of_its_own_is_outvoted_and_banned(peers, tmp_path):
    snap = snapshot(tmp_path)
    bad = bytes(b ^ 0xFF if i % (64 * KiB) == 5 else b for i, b in enumerate(content(snap)))
    # The liar's manifest matches its own bad bytes range by range, under the real content hash.
    own = manifest_of(bad, run_id=RUN, step=12, range_bytes=64 * KiB)
    fake_manifest = replace(own, content_hash=snap.content_hash)
    liar = await peers.start("liar", publish=snapshot_file(tmp_path, bad, fake_manifest))
    honest = [(await peers.start(f"d{i}", publish=snap)) for i in range(2)]
    events: list[Event] = []
    data = await fetch(snap, [liar.donor] + [d.donor for d in honest], events=events)
    assert data == content(snap)
    banned = [e.donor for e in events if isinstance(e, DonorBanned)]
    assert banned == [f"liar at 127.0.0.1:{liar.port}"]


async def test_two_donors_with_different_manifests_the_true_one_wins(peers, tmp_path):
    """No majority: whichever manifest is tried first, the liar ends banned and the state is correct."""
    snap = snapshot(tmp_path)
    bad = bytes(b ^ 0xFF if i % (64 * KiB) == 5 else b for i, b in enumerate(content(snap)))
    own = manifest_of(bad, run_id=RUN, step=12, range_bytes=64 * KiB)
    fake_manifest = replace(own, content_hash=snap.content_hash)
    liar = await peers.start("liar", publish=snapshot_file(tmp_path, bad, fake_manifest))
    honest = await peers.start("honest", publish=snap)
    for order in ([liar.donor, honest.donor], [honest.donor, liar.donor]):
        events: list[Event] = []
        data = await fetch(snap, order, events=events)
        assert data == content(snap)
        banned = [e.donor for e in events if isinstance(e, DonorBanned)]
        assert banned == [f"liar at 127.0.0.1:{liar.port}"]


async def test_donor_that_never_answers_does_not_stall_the_fetch(peers, tmp_path):
    """A donor that accepts connections and then stays silent: the manifest vote does not wait for it
    beyond the grace, and the ranges it holds are raced on the other donor."""
    snap = snapshot(tmp_path)
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        mute = Donor(peer_id="mute", address=f"127.0.0.1:{port}", public_key=SigningKey().public_hex)
        honest = await peers.start("honest", publish=snap)
        # Time-outs far beyond the test's own limit: finishing at all shows the fetch did not wait for them.
        cfg = dataclasses.replace(
            CONFIG, manifest_timeout_s=600.0, read_timeout_s=600.0, range_timeout_s=600.0
        )
        events: list[Event] = []
        async with asyncio.timeout(110):
            data = await fetch(snap, [mute, honest.donor], config=cfg, events=events)
        assert data == content(snap)
        assert len(accepted) >= 2  # the mute donor was asked (manifest and ranges)
        loaded = events[-1]
        assert isinstance(loaded, StateLoaded) and loaded.donors_used == (
            f"honest at 127.0.0.1:{honest.port}",
        )
    finally:
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


async def test_state_sync_error_names_every_donor_when_none_works(peers, tmp_path):
    snap = snapshot(tmp_path)
    other = snapshot(tmp_path, seed=1)
    wrong = await peers.start("wrong-state", publish=other)  # 404 for the wanted hash
    bad = bytes(b ^ 0x55 for b in content(snap))
    liar = await peers.start("liar", publish=snapshot_file(tmp_path, bad, snap.manifest))
    dead = Donor(peer_id="dead", address=f"127.0.0.1:{closed_port()}", public_key=SigningKey().public_hex)
    with pytest.raises(StateSyncError) as info:
        await fetch(snap, [wrong.donor, liar.donor, dead])
    text = str(info.value)
    for name in ("wrong-state at", "liar at", f"dead at {dead.address}"):
        assert name in text
    assert "404" in text and "banned" in text
    assert len(info.value.donors) == 3


async def test_no_donors_is_a_state_sync_error(tmp_path):
    snap = snapshot(tmp_path, params=1000)
    with pytest.raises(StateSyncError, match="no donor serves state step 12"):
        await fetch(snap, [])


async def test_zstd_ranges_on_a_compressible_state(peers, tmp_path):
    snap = snapshot(tmp_path, zeros=True)
    donors = [(await peers.start(f"d{i}", publish=snap)) for i in range(2)]
    data = await fetch(snap, [d.donor for d in donors])
    assert data == content(snap)
    assert sum(sum(d.watch.bodies) for d in donors) < snap.size // 4


async def test_fetch_without_zstd_gets_identity_bytes(peers, tmp_path):
    snap = snapshot(tmp_path, zeros=True)
    donor = await peers.start("d0", publish=snap)
    data = await fetch(snap, [donor.donor], config=dataclasses.replace(CONFIG, accept_zstd=False))
    assert data == content(snap)
    assert sum(donor.watch.bodies) == snap.size


async def test_busy_donor_sends_503_and_fetch_moves_to_others(peers, tmp_path):
    snap = snapshot(tmp_path)
    busy_cfg = dataclasses.replace(CONFIG, max_uploads=1, upload_rate=64 * KiB)  # one slow upload at a time
    busy = await peers.start("busy", config=busy_cfg, publish=snap)
    free = await peers.start("free", publish=snap)
    cfg = dataclasses.replace(CONFIG, ranges_per_donor=3)
    assert await fetch(snap, [busy.donor, free.donor], config=cfg) == content(snap)
    assert busy.watch.refused > 0


# ------------------------------------------------------------------ serving, raw HTTP


def signed(content_hash: str, field: str, key: SigningKey | None = None, run: str = RUN) -> dict[str, str]:
    key = key or SigningKey()
    cred = issue_credential(TRACKER, run, "client", key.public_hex, ttl_s=600)
    headers = sign_headers(key, cred, "state", content_hash, field)
    if field != "manifest" and field:
        headers["Range"] = field
    return headers


async def test_range_requests_and_full_body(peers, tmp_path):
    snap = snapshot(tmp_path)
    data = content(snap)
    donor = await peers.start("d0", publish=snap)
    url = f"http://127.0.0.1:{donor.port}/v1/state/{snap.content_hash}"
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.get(url, headers=signed(snap.content_hash, "bytes=10-99")) as resp:
            assert resp.status == 206
            assert resp.headers["Content-Range"] == f"bytes 10-99/{len(data)}"
            assert await resp.read() == data[10:100]
        async with http.get(url, headers=signed(snap.content_hash, "bytes=-5")) as resp:
            assert resp.status == 206 and await resp.read() == data[-5:]
        async with http.get(url, headers=signed(snap.content_hash, f"bytes={len(data) - 3}-")) as resp:
            assert resp.status == 206 and await resp.read() == data[-3:]
        async with http.get(url, headers=signed(snap.content_hash, "")) as resp:
            assert resp.status == 200 and await resp.read() == data
        async with http.get(url + "/manifest", headers=signed(snap.content_hash, "manifest")) as resp:
            assert resp.status == 200
            assert decode(await resp.read(), StateManifest) == snap.manifest


@pytest.mark.parametrize("bad", ["bytes=5", "bytes=0-1,4-5", "lines=0-3", "bytes=9-2", "bytes=99999999-"])
async def test_bad_ranges_answer_416(peers, tmp_path, bad):
    snap = snapshot(tmp_path)
    donor = await peers.start("d0", publish=snap)
    url = f"http://127.0.0.1:{donor.port}/v1/state/{snap.content_hash}"
    async with aiohttp.ClientSession() as http, http.get(url, headers=signed(snap.content_hash, bad)) as resp:
        assert resp.status == 416
        assert resp.headers["Content-Range"] == f"bytes */{len(content(snap))}"
        assert "range" in (await resp.json())["error"].lower()


async def test_unknown_hash_answers_404(peers, tmp_path):
    snap = snapshot(tmp_path)
    donor = await peers.start("d0", publish=snap)
    unknown = "ab" * 32
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{donor.port}/v1/state/{unknown}"
        async with http.get(url, headers=signed(unknown, "bytes=0-9")) as resp:
            assert resp.status == 404
            assert "does not serve state" in (await resp.json())["error"]
        async with http.get(url + "/manifest", headers=signed(unknown, "manifest")) as resp:
            assert resp.status == 404


async def test_unauthenticated_requests_answer_401(peers, tmp_path):
    snap = snapshot(tmp_path)
    donor = await peers.start("d0", publish=snap)
    url = f"http://127.0.0.1:{donor.port}/v1/state/{snap.content_hash}"
    h = snap.content_hash
    forged = signed(h, "bytes=0-9")
    forged["Range"] = "bytes=0-99999"  # signature covers another range
    cases = [
        {"Range": "bytes=0-9"},  # no credential at all
        forged,
        signed(h, "bytes=0-9", run="another-run"),  # credential of another run
    ]
    async with aiohttp.ClientSession() as http:
        for headers in cases:
            async with http.get(url, headers=headers) as resp:
                assert resp.status == 401, headers
                assert "signature" in (await resp.json())["error"]
        async with http.get(url + "/manifest") as resp:
            assert resp.status == 401


async def test_uploads_beyond_the_limit_answer_503_with_retry_after(peers, tmp_path):
    snap = snapshot(tmp_path)
    cfg = dataclasses.replace(CONFIG, max_uploads=1, upload_rate=64 * KiB, retry_after_s=3)
    donor = await peers.start("d0", config=cfg, publish=snap)
    url = f"http://127.0.0.1:{donor.port}/v1/state/{snap.content_hash}"
    h = snap.content_hash
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=signed(h, "bytes=0-1048575")) as slow:
            assert slow.status == 206
            await slow.content.readexactly(1024)  # the first upload is under way
            async with http.get(url, headers=signed(h, "bytes=0-9")) as refused:
                assert refused.status == 503
                assert refused.headers["Retry-After"] == "3"
                assert "retry later" in (await refused.json())["error"]
            async with http.get(url + "/manifest", headers=signed(h, "manifest")) as manifest:
                assert manifest.status == 200  # manifests are not uploads
    assert donor.watch.refused == 1


async def test_zstd_per_range_when_asked_and_it_helps(peers, tmp_path):
    compressible = snapshot(tmp_path, zeros=True)
    random = snapshot(tmp_path, noise=True)
    donor = await peers.start("d0")
    donor.server.publish(random)
    donor.server.publish(compressible)
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        for snap, expect_zstd in ((compressible, True), (random, False)):
            rng = f"bytes={64 * KiB}-{128 * KiB - 1}"
            headers = signed(snap.content_hash, rng) | {"Accept-Encoding": "zstd"}
            url = f"http://127.0.0.1:{donor.port}/v1/state/{snap.content_hash}"
            async with http.get(url, headers=headers) as resp:
                assert resp.status == 206
                body = await resp.read()
                if expect_zstd:
                    assert resp.headers["Content-Encoding"] == "zstd"
                    assert len(body) < 64 * KiB // 10
                    body = zstandard.ZstdDecompressor().decompress(body)
                else:
                    assert "Content-Encoding" not in resp.headers
                assert body == content(snap)[64 * KiB : 128 * KiB]


async def test_publish_keeps_newest_and_previous_only(peers, tmp_path):
    snaps = [snapshot(tmp_path, params=1000, seed=s) for s in range(3)]
    donor = await peers.start("d0")
    for s in snaps:
        donor.server.publish(s)
    assert donor.server.versions[0] == snaps[2].version
    async with aiohttp.ClientSession() as http:
        for snap, status in zip(snaps, (404, 200, 200), strict=True):
            url = f"http://127.0.0.1:{donor.port}/v1/state/{snap.content_hash}/manifest"
            async with http.get(url, headers=signed(snap.content_hash, "manifest")) as resp:
                assert resp.status == status


def test_config_names_the_bad_field():
    with pytest.raises(ConfigError, match="range_bytes"):
        StateConfig(range_bytes=100)
    with pytest.raises(ConfigError, match="upload_rate"):
        StateConfig(upload_rate=10)
    with pytest.raises(ConfigError, match="read_timeout_s"):
        StateConfig(read_timeout_s=50, range_timeout_s=10)
