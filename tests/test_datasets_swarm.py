"""Data sets over BitTorrent with real libtorrent sessions on loopback and the real tracker.

Every peer is its own libtorrent session in this process; they find each other only through the
tracker's /announce (the data set is registered with the admin token first, as `dataset seed` does).
Seeders are rate-limited so that the downloads take a few seconds and overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from crowdtrain.commands.tracker import this_machine_addresses
from crowdtrain.datasets.chunks import MANIFEST_NAME
from crowdtrain.datasets.make import make_dataset
from crowdtrain.datasets.sampler import Sampler
from crowdtrain.datasets.session import RESUME_PREFIX, ChunkReady, Download, SessionConfig, TorrentSession
from crowdtrain.datasets.torrent import find_torrent, infohash_of
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import DatasetError
from crowdtrain.protocol.messages import DatasetManifest
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import Tracker, serve
from tests.harness import until

KiB = 1024
SEQ = 64
WAIT_S = 60  # generous bound for anything on this shared 2-core machine; tests finish in seconds


@dataclass
class Published:
    manifest: DatasetManifest
    torrent: bytes
    src: Path
    announce_url: str
    tracker: Tracker


@contextlib.asynccontextmanager
async def published(tmp_path: Path, *, size: int, chunk: int) -> AsyncIterator[Published]:
    """A real tracker and a data set made for it and registered with it."""
    async with serve(TrackerConfig()) as tracker:
        src = tmp_path / "published"
        manifest = await asyncio.to_thread(
            make_dataset, "builtin:stdlib", src, chunk_bytes=chunk, max_bytes=size,
            announce_url=tracker.announce_url,
        )  # fmt: skip
        torrent = find_torrent(src).read_bytes()
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
            await client.register_dataset(infohash_of(torrent), manifest.name)
        yield Published(manifest, torrent, src, tracker.announce_url, tracker)
        # libtorrent's shutdown leaves its "stopped" announce connections to close on their own; a tracker
        # stopped in the middle of one leaks its server-side transport (ResourceWarning), so let them finish
        await asyncio.sleep(0.5)
    await asyncio.sleep(0.1)  # asyncio closes a transport one loop iteration after close()


class Learner:
    """A downloader feeding a sampler the way the volunteer does, recording what it saw."""

    def __init__(self, manifest: DatasetManifest, data_dir: Path, seed: int) -> None:
        self.sampler = Sampler(manifest, data_dir, seed=seed, seq_len=SEQ)
        self.events: list[ChunkReady] = []
        self.first_batch_progress: float | None = None
        self.download: Download | None = None

    def on_chunk(self, event: ChunkReady) -> None:
        self.events.append(event)
        self.sampler.add_chunk(event.index)
        if self.first_batch_progress is None and self.download is not None:
            batch = self.sampler.batch(8)
            assert batch.x.shape == (8, SEQ)
            self.first_batch_progress = self.download.handle.status().progress


def top_tier(download) -> set[int]:
    """The chunks a streaming download asked for first (file priority above 1), as libtorrent holds them."""
    return {i for i, p in enumerate(download.handle.get_file_priorities()[:-1]) if p > 1}


async def test_two_downloaders_train_early_finish_verified_and_share_with_each_other(tmp_path):
    async with published(tmp_path, size=2 * 1024 * KiB, chunk=128 * KiB) as pub:
        n = len(pub.manifest.chunks)
        async with (
            TorrentSession(SessionConfig(upload_rate_limit=384 * KiB)) as seeder,
            TorrentSession() as ses_a,
            TorrentSession() as ses_b,
        ):
            await seeder.seed(pub.src, pub.torrent)
            a = Learner(pub.manifest, tmp_path / "a", seed=1)
            a.download = await ses_a.stream(
                pub.torrent, tmp_path / "a", pub.manifest, seed=1, on_chunk=a.on_chunk
            )
            # the second volunteer arrives once the first holds a few chunks it can share
            await until(
                lambda: len(a.events) >= 3, WAIT_S, "the first downloader getting chunks", every_s=0.05
            )
            b = Learner(pub.manifest, tmp_path / "b", seed=2)
            b.download = await ses_b.stream(
                pub.torrent, tmp_path / "b", pub.manifest, seed=2, on_chunk=b.on_chunk
            )
            async with asyncio.timeout(WAIT_S):
                await a.download.wait_complete()
                await b.download.wait_complete()
            # what the first uploaded: the seeder holds every piece and takes none, so only the second took it
            uploaded_by_a = a.download.stats().uploaded
            # each asked libtorrent for chunks in its own order: the top of its priorities (tiers 7..2)
            tops = [top_tier(learner.download) for learner in (a, b)]
            view = ses_b.stats()
            assert (view.chunks_held, view.chunks_total, view.progress) == (n, n, 1.0)
            assert view.downloaded >= sum(c.bytes for c in pub.manifest.chunks)
            # the swarm as the tracker (and its page) counts it: the seeder and both downloaders, not the peers
            # this session happens to be connected to (seeds that all hold the data set connect to no one)
            await until(
                lambda: ses_b.stats().peers == 3, WAIT_S, "the tracker's count of the swarm", every_s=0.1
            )

        # A trained on its first chunk while most of the torrent was still missing.
        assert a.first_batch_progress is not None and a.first_batch_progress < 0.5
        for learner, folder in ((a, "a"), (b, "b")):
            assert sorted(e.index for e in learner.events) == list(range(n))  # each chunk verified once
            assert [(e.held, e.total) for e in learner.events] == [(k, n) for k in range(1, n + 1)]
            assert learner.sampler.held == set(range(n))
            for info in pub.manifest.chunks:
                assert hashlib.sha256((tmp_path / folder / info.name).read_bytes()).hexdigest() == info.sha256
        # random, per-peer download orders: each began with chunks of its own top tier (the whole orders may
        # coincide on a loaded machine, where the alerts of many finished pieces are handled at once)
        assert tops[0] != tops[1], tops
        assert a.events[0].index in tops[0], ([e.index for e in a.events], tops[0])
        # the second downloader also got pieces from the first, per the first's own swarm stats
        assert uploaded_by_a > 0, uploaded_by_a


async def test_a_chunk_corrupted_on_the_seeder_never_reaches_the_sampler(tmp_path):
    async with published(tmp_path, size=1024 * KiB, chunk=128 * KiB) as pub:
        bad = 3
        info = pub.manifest.chunks[bad]
        original = (pub.src / info.name).read_bytes()
        corrupt_dir = tmp_path / "corrupt-seeder"
        corrupt_dir.mkdir()
        for p in pub.src.iterdir():
            (corrupt_dir / p.name).write_bytes(p.read_bytes())
        async with TorrentSession() as liar, TorrentSession() as honest, TorrentSession() as ses:
            await liar.seed(corrupt_dir, pub.torrent)  # checked while intact: it believes it has every piece
            raw = bytearray(original)
            raw[4096:4196] = b"X" * 100
            (corrupt_dir / info.name).write_bytes(bytes(raw))

            learner = Learner(pub.manifest, tmp_path / "dl", seed=5)
            learner.download = dl = await ses.stream(
                pub.torrent, tmp_path / "dl", pub.manifest, seed=5, on_chunk=learner.on_chunk
            )
            await until(
                lambda: dl.hash_failures >= 1,
                WAIT_S,
                "libtorrent rejecting the corrupted piece",
                every_s=0.05,
            )
            # the rejected chunk is not in the sampler, and no batch can come from it
            assert bad not in learner.sampler.held
            assert bad not in {e.index for e in learner.events}
            if learner.sampler.ready:
                assert all(c != bad for c, _ in learner.sampler.batch(256).provenance)

            # an honest seeder appears; the chunk now arrives intact
            await honest.seed(pub.src, pub.torrent)
            dl.handle.force_reannounce()
            async with asyncio.timeout(WAIT_S):
                await dl.wait_complete()
        assert [e.index for e in learner.events].count(bad) == 1
        assert (tmp_path / "dl" / info.name).read_bytes() == original
        loaded = np.asarray(learner.sampler.rebuild([(bad, 0)]).x[0]).astype(np.uint8).tobytes()
        header = len(original) - info.samples
        assert loaded == original[header : header + SEQ]


async def test_a_restarted_downloader_does_not_fetch_verified_chunks_again(tmp_path):
    async with published(tmp_path, size=2 * 1024 * KiB, chunk=128 * KiB) as pub:
        n = len(pub.manifest.chunks)
        async with TorrentSession(SessionConfig(upload_rate_limit=384 * KiB)) as seeder:
            await seeder.seed(pub.src, pub.torrent)

            first = Learner(pub.manifest, tmp_path / "dl", seed=9)
            async with TorrentSession() as ses:
                first.download = await ses.stream(
                    pub.torrent, tmp_path / "dl", pub.manifest, seed=9, on_chunk=first.on_chunk
                )
                await until(
                    lambda: len(first.events) >= n // 3,
                    WAIT_S,
                    "a third of the chunks arriving",
                    every_s=0.05,
                )
            # closing saved resume data; the session is gone
            held_before = {e.index for e in first.events}
            assert len(held_before) < n
            assert (tmp_path / "dl" / f"{RESUME_PREFIX}{infohash_of(pub.torrent)}").is_file()

            second = Learner(pub.manifest, tmp_path / "dl", seed=9)
            async with TorrentSession() as ses:
                second.download = dl = await ses.stream(
                    pub.torrent, tmp_path / "dl", pub.manifest, seed=9, on_chunk=second.on_chunk
                )
                # what was verified before is announced again at once, from disk
                assert held_before <= dl.verified
                async with asyncio.timeout(WAIT_S):
                    await dl.wait_complete()
                fetched = dl.stats().downloaded

        assert sorted(e.index for e in second.events) == list(range(n))
        missing_bytes = sum(c.bytes for i, c in enumerate(pub.manifest.chunks) if i not in held_before)
        missing_bytes += (pub.src / MANIFEST_NAME).stat().st_size
        assert 0 < fetched <= missing_bytes, (fetched, missing_bytes)


async def test_a_closing_session_leaves_the_loop_free_and_its_tracker_hears_it_leave(tmp_path):
    """Regression (a CI failure): libtorrent's destructor waited for the "stopped" announce holding the GIL, so a
    tracker on the same event loop could not answer it: every close froze the whole process for the announce's
    timeout (1 s), every volunteer of a test with it, and a step closed without one that could not say "ready"
    meanwhile. A close now removes its torrents and waits for the trackers' answers with the loop free: the
    tracker has dropped the peer from the swarm by the time ``close`` returns."""
    async with published(tmp_path, size=256 * KiB, chunk=64 * KiB) as pub:
        ses = await TorrentSession().start()
        await ses.seed(pub.src, pub.torrent)
        swarm = pub.tracker.swarms.get(bytes.fromhex(infohash_of(pub.torrent)))
        mine = ses.fingerprint.encode()
        listed = lambda: any(p.peer_id.startswith(mine) for p in swarm.peers)  # noqa: E731
        await until(listed, WAIT_S, "the seeder's first announce")
        await ses.close()
        assert not listed(), "the tracker did not hear the seeder's stopped announce while it closed"


async def test_a_session_on_every_interface_announces_to_a_loopback_tracker_from_loopback_alone(tmp_path):
    """libtorrent announces from each interface it listens on, bound to that interface's device: to a tracker
    on 127.0.0.1 the network card's connection left by the card (SYNs to 127.0.0.1 seen on eth0) and timed
    out, a warning each. A session on every interface whose trackers are all on loopback listens there
    alone: a swarm such a tracker keeps is on this machine."""
    if not this_machine_addresses():
        pytest.skip("this machine has no interface but loopback: no announce can leave by another")
    async with published(tmp_path, size=256 * KiB, chunk=64 * KiB) as pub:
        async with TorrentSession() as ses:  # every interface, as a volunteer's default
            dl = await ses.seed(pub.src, pub.torrent)
            swarm = pub.tracker.swarms.get(bytes.fromhex(infohash_of(pub.torrent)))
            mine = ses.fingerprint.encode()
            await until(lambda: any(p.peer_id.startswith(mine) for p in swarm.peers), WAIT_S, "an announce")
            ends = [e["local_address"][0] for t in dl.handle.trackers() for e in t["endpoints"]]
            assert ends and all(ipaddress.ip_address(a).is_loopback for a in ends), ends


async def test_seeding_an_incomplete_folder_is_refused(tmp_path):
    async with published(tmp_path, size=256 * KiB, chunk=64 * KiB) as pub:
        (pub.src / pub.manifest.chunks[1].name).unlink()
        async with TorrentSession() as ses:
            with pytest.raises(
                DatasetError, match=r"\(1 chunk\(s\) missing or damaged\); run `dataset make` again"
            ):
                await ses.seed(pub.src, pub.torrent)


@pytest.mark.slow
async def test_cli_seed_registers_with_the_tracker_and_serves_a_downloader(tmp_path, python, cli_env):
    import json
    import signal

    async with serve(TrackerConfig()) as tracker:
        src = tmp_path / "published"
        manifest = await asyncio.to_thread(
            make_dataset, "builtin:stdlib", src, chunk_bytes=64 * KiB, max_bytes=512 * KiB,
            announce_url=tracker.announce_url,
        )  # fmt: skip
        torrent = find_torrent(src).read_bytes()
        proc = await asyncio.create_subprocess_exec(
            python, "-m", "crowdtrain", "dataset", "seed", str(src), "--tracker", tracker.url,
            "--admin-token", tracker.admin_token, "--host", "127.0.0.1", "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env,
        )  # fmt: skip
        try:
            async with asyncio.timeout(WAIT_S):
                first = json.loads(await proc.stdout.readline())
            assert first["event"] == "Seeding" and first["infohash"] == infohash_of(torrent)
            async with TorrentSession() as ses:
                # the tracker only serves registered info-hashes: this works because `dataset seed` registered it
                dl = await ses.stream(torrent, tmp_path / "dl", manifest, seed=0)
                async with asyncio.timeout(WAIT_S):
                    await dl.wait_complete()
        finally:
            proc.send_signal(signal.SIGINT)
            async with asyncio.timeout(WAIT_S):
                _, err = await proc.communicate()
        assert proc.returncode == 130, err.decode()
    await asyncio.sleep(0.1)


@pytest.mark.parametrize("open_tracker", [False, True])
async def test_cli_seed_without_the_admin_token_needs_a_tracker_that_serves_the_data_set(
    tmp_path, python, cli_env, open_tracker
):
    """Without --admin-token nothing is registered: the seeder asks the tracker (a scrape) whether it serves
    the info-hash already; a tracker that does not is named with what to do, an --open one is fine."""
    import signal
    import subprocess

    env = {k: v for k, v in cli_env.items() if k != "CROWDTRAIN_ADMIN_TOKEN"}
    async with serve(TrackerConfig(open=open_tracker)) as tracker:
        src = tmp_path / "published"
        await asyncio.to_thread(
            make_dataset, "builtin:stdlib", src, chunk_bytes=64 * KiB, max_bytes=128 * KiB,
            announce_url=tracker.announce_url,
        )  # fmt: skip
        args = [python, "-m", "crowdtrain", "dataset", "seed", str(src), "--tracker", tracker.url, "--json"]
        # a thread-made process: asyncio's child watcher lost this one when it exited on its own (rc 255)
        proc = await asyncio.to_thread(
            subprocess.Popen,
            [*args, "--host", "127.0.0.1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            first = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT_S)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            _, err = await asyncio.to_thread(proc.communicate, timeout=WAIT_S)
    if open_tracker:
        assert b'"Seeding"' in first and proc.returncode == 130, err.decode()
    else:
        assert first == b"" and proc.returncode == 1, err.decode()
        assert "does not serve data set 'python-stdlib'" in err.decode()
        assert "pass --admin-token to register it" in err.decode()


async def test_a_bep19_web_seed_alone_serves_the_whole_data_set(tmp_path):
    from aiohttp import web

    app = web.Application()
    runner = web.AppRunner(app)
    published_root = tmp_path / "www"
    src = published_root / "python-stdlib"  # web seeds are asked for <url><torrent name>/<file>
    published_root.mkdir()
    app.router.add_static("/data/", published_root)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        manifest = await asyncio.to_thread(
            make_dataset, "builtin:stdlib", src, chunk_bytes=64 * KiB, max_bytes=512 * KiB,
            web_seed=f"http://127.0.0.1:{port}/data/",
        )  # fmt: skip
        torrent = find_torrent(src).read_bytes()
        learner = Learner(manifest, tmp_path / "dl", seed=3)
        async with TorrentSession() as ses:  # no tracker, no peers: only the web server has the data
            learner.download = dl = await ses.stream(
                torrent, tmp_path / "dl", manifest, seed=3, on_chunk=learner.on_chunk
            )
            async with asyncio.timeout(WAIT_S):
                await dl.wait_complete()
        assert learner.sampler.held == set(range(len(manifest.chunks)))
    finally:
        await runner.cleanup()
    await asyncio.sleep(0.1)


async def test_a_failing_chunk_callback_surfaces_instead_of_hanging(tmp_path):
    async with published(tmp_path, size=256 * KiB, chunk=64 * KiB) as pub:
        async with TorrentSession() as seeder:
            await seeder.seed(pub.src, pub.torrent)
            ses = await TorrentSession().start()

            def on_chunk(event: ChunkReady) -> None:
                raise RuntimeError(f"the trainer could not take chunk {event.index}")

            # On loopback a chunk may already be complete when the torrent is added: the callback then fails
            # inside stream() itself, which raises its error as it is; else the alert loop fails the session
            # and the wait says so. Either way it surfaces, and the session is closed without hanging.
            try:
                dl = await ses.stream(pub.torrent, tmp_path / "dl", pub.manifest, seed=0, on_chunk=on_chunk)
            except RuntimeError as exc:
                assert "the trainer could not take chunk" in str(exc)
                with contextlib.suppress(DatasetError):  # (the alert loop may have met another chunk)
                    await asyncio.wait_for(ses.close(), WAIT_S)
                return
            with pytest.raises(DatasetError, match="session failed: the trainer could not take chunk"):
                async with asyncio.timeout(WAIT_S):
                    await dl.wait_complete()
            with pytest.raises(DatasetError, match="session failed"):
                await ses.close()
