"""One libtorrent session per process, living beside asyncio: seed data sets, stream them chunk by chunk.

* Alerts are polled off the event loop (``asyncio.to_thread(ses.wait_for_alert, ms)``) by one pump task,
  which hands each to its torrent's :class:`Download`; its failure is kept and re-raised by :meth:`Download.wait_complete`, :meth:`TorrentSession.close` and
  every later call, so nobody loses it.
* A streaming download gives every chunk a priority ≥ 1 (never 0: a torrent with unwanted files becomes
  "finished" and drops its seeds) in a per-peer random order: the first six chunks of a seeded shuffle get
  priorities 7..2, the rest 1, so the swarm holds different chunks at once.
* A chunk is announced (:class:`ChunkReady`) only after libtorrent reported the file complete, the disk
  cache was flushed (reading at ``file_completed_alert`` time returned stale blocks on this machine) and
  its sha256 matched the manifest. A periodic scan of ``file_progress`` catches completions whose alerts
  were dropped.
* Restart: resume data is saved on close into ``<data_dir>/.resume-<infohash>``; without it libtorrent
  re-checks the files on disk. Either way complete chunks are verified and announced without download.
* Settings measured on loopback (:func:`_settings`): TCP only (uTP was several times slower there), several
  connections per IP (peers on one host are dropped as duplicates otherwise), no DHT/LSD/UPnP/NAT-PMP, short
  announce intervals, and rate limits applied to local peers when configured.
* A session on every interface listens on loopback alone while all its torrents' trackers are on loopback:
  libtorrent announces from each interface, and the network card's announces to 127.0.0.1 left by the card.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import libtorrent as lt

from crowdtrain.datasets.chunks import sha256_file
from crowdtrain.datasets.torrent import check_torrent_matches, infohash_of, read_manifest
from crowdtrain.protocol.errors import ConfigError, DatasetError
from crowdtrain.protocol.messages import DatasetManifest

log = logging.getLogger(__name__)

RESUME_PREFIX = ".resume-"
PRIORITY_TIERS = (7, 6, 5, 4, 3, 2)
STOP_TRACKER_TIMEOUT_S = 1  # how long a close waits for the trackers to answer its "stopped" announces
RECV_TRACKER = "net.recv_tracker_bytes"  # libtorrent's counters (session stats) a close watches
QUEUED_ANNOUNCES = "tracker.num_queued_tracker_announces"


@dataclass(frozen=True, slots=True)
class ChunkReady:
    """A chunk's file is complete on disk and matched the manifest's sha256."""

    index: int
    name: str
    samples: int
    held: int = 0  # chunks verified so far, this one included
    total: int = 0  # chunks in the data set


def listen_address(host: str, port: int) -> str:
    """``host:port`` for listening, with an IPv6 host in brackets (``[::]:6881``)."""
    return f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class SessionConfig:
    listen: str = "0.0.0.0:0"  # host:port; every interface by default, as BitTorrent clients do; port 0 = any
    upload_rate_limit: int = 0  # bytes/s for the whole session, 0 = unlimited
    download_rate_limit: int = 0
    limit_local_peers: bool = True  # apply the rate limits to peers on loopback/LAN too
    min_announce_interval_s: int = 5
    alert_poll_ms: int = 200
    scan_interval_s: float = 1.0  # how often file progress and per-peer stats are polled
    check_timeout_s: float = 300.0  # adding a torrent and checking the files on disk
    close_timeout_s: float = 10.0  # saving resume data on close
    # ask the router (UPnP-IGD and NAT-PMP) to forward the listen port, and the ports given to
    # :meth:`TorrentSession.map_port`, as BitTorrent clients do; never from a loopback listener
    port_mapping: bool = False

    def __post_init__(self) -> None:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError("listen", f"{self.listen!r} is not host:port (e.g. 127.0.0.1:0)")
        for name in ("upload_rate_limit", "download_rate_limit"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must be ≥ 0 bytes/s (0 = unlimited)")
        if self.min_announce_interval_s < 1:
            raise ConfigError("min_announce_interval_s", "must be at least 1 s")
        if not 10 <= self.alert_poll_ms <= 5000:
            raise ConfigError("alert_poll_ms", "must be between 10 and 5000 ms")
        for name in ("scan_interval_s", "check_timeout_s", "close_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be a positive number of seconds")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen interface) is a loopback address: nothing there is behind a router."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower().rstrip(".") == "localhost"


def is_wildcard(host: str) -> bool:
    """Whether ``host`` (a listen interface) means every interface: ``0.0.0.0`` or ``::``."""
    return host.strip("[]") in ("0.0.0.0", "::")


def tracker_hosts(torrent_bytes: bytes) -> list[str]:
    """The hosts of a torrent's announce URLs (a torrent parsed and bounded before)."""
    return [urlsplit(url).hostname or "" for url in lt.load_torrent_buffer(torrent_bytes).trackers]


@dataclass(frozen=True, slots=True)
class PortMap:
    """What a router answered to one port mapping: ``external_port`` on success, else ``error``."""

    what: str  # "BitTorrent" (the session's listen port) or the name given to map_port
    port: int  # the local port
    via: str  # "UPnP" or "NAT-PMP"
    external_port: int | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SwarmStats:
    """What the view shows about one torrent."""

    chunks_held: int
    chunks_total: int
    download_rate: float  # payload bytes/s
    upload_rate: float
    # the swarm as the tracker counts it (its page too: every peer announced, this one included, and the seeds
    # among them); until the tracker answered, the peers this session is connected to
    peers: int
    seeds: int
    downloaded: int  # payload bytes since this session added the torrent
    uploaded: int
    progress: float  # 0..1, libtorrent's view of the bytes held
    hash_failures: int


def _settings(cfg: SessionConfig, fingerprint: str) -> lt.settings_pack:
    mask = (
        lt.alert_category.error
        | lt.alert_category.status
        | lt.alert_category.storage
        | lt.alert_category.tracker
        | lt.alert_category.file_progress
        | lt.alert_category.port_mapping
    )
    # (a loopback listener has no router: it sends no discovery packets at all)
    mapping = cfg.port_mapping and not is_loopback(cfg.listen.rpartition(":")[0])
    return {
        "listen_interfaces": cfg.listen,
        "outgoing_interfaces": "",
        "enable_dht": False,
        "enable_lsd": False,
        "enable_upnp": mapping,
        "enable_natpmp": mapping,
        "enable_outgoing_utp": False,
        "enable_incoming_utp": False,
        "allow_multiple_connections_per_ip": True,
        "alert_mask": int(mask),
        "alert_queue_size": 10000,
        "min_announce_interval": cfg.min_announce_interval_s,
        "tracker_backoff": 50,
        "tick_interval": 100,
        "stop_tracker_timeout": STOP_TRACKER_TIMEOUT_S,  # seconds a close waits for "stopped" announces
        "initial_picker_threshold": 0,
        "ignore_limits_on_local_network": not cfg.limit_local_peers,
        "upload_rate_limit": cfg.upload_rate_limit,
        "download_rate_limit": cfg.download_rate_limit,
        "peer_fingerprint": fingerprint,
        "user_agent": "crowdtrain",
        "validate_https_trackers": True,
    }


class Download:
    """One torrent in a :class:`TorrentSession`: the chunks verified so far and its stats.

    The session feeds it the torrent's libtorrent alerts (:meth:`on_alert`) and calls :meth:`scan`
    periodically, both on the event loop. A chunk is held only once libtorrent reported its file complete,
    the disk cache was flushed (a file read at ``file_completed_alert`` time can still hold stale blocks)
    and the file's sha256 matched the manifest; ``on_chunk`` then gets a :class:`ChunkReady`.
    """

    def __init__(
        self,
        handle: lt.torrent_handle,
        infohash: str,
        manifest: DatasetManifest,
        data_dir: Path,
        on_chunk: Callable[[ChunkReady], None] | None,
    ) -> None:
        self.handle = handle
        self.infohash = infohash
        self.manifest = manifest
        self.data_dir = data_dir
        self.verified: set[int] = set()
        self.hash_failures = 0  # pieces libtorrent rejected (SHA-1) and fetches again
        self.error: str | None = None  # why libtorrent cannot use the torrent or its files
        self._on_chunk = on_chunk
        self._checked = asyncio.Event()  # libtorrent checked the files on disk, or gave up with an error
        self._complete = asyncio.Event()
        self._failed: BaseException | None = None  # the session's alert loop died
        self._awaiting_flush: set[int] = set()  # complete files to verify once the disk cache is flushed
        self._verify_lock = asyncio.Lock()
        self._tries: dict[int, int] = {}  # sha256 mismatches per chunk
        self._resume: asyncio.Future[bytes | None] | None = None

    # -------------------------------------------------------------- views

    @property
    def chunks_total(self) -> int:
        return len(self.manifest.chunks)

    @property
    def complete(self) -> bool:
        return len(self.verified) == self.chunks_total

    def stats(self) -> SwarmStats:
        st = self.handle.status()
        # (a swarm of seeds that all hold the data set connects to no one: connected, it read "0 peers")
        counted = st.num_complete >= 0 and st.num_incomplete >= 0
        return SwarmStats(
            chunks_held=len(self.verified),
            chunks_total=self.chunks_total,
            download_rate=float(st.download_payload_rate),
            upload_rate=float(st.upload_payload_rate),
            peers=int(st.num_complete + st.num_incomplete) if counted else int(st.num_peers),
            seeds=int(st.num_complete) if counted else int(st.num_seeds),
            downloaded=int(st.total_payload_download),
            uploaded=int(st.total_payload_upload),
            progress=float(st.progress),
            hash_failures=self.hash_failures,
        )

    async def wait_checked(self) -> None:
        await self._checked.wait()
        self._raise_failed()

    async def wait_complete(self) -> None:
        """Return once every chunk is verified (the caller bounds this with its own timeout)."""
        await self._complete.wait()
        self._raise_failed()

    # -------------------------------------------------------------- driven by the session

    async def on_alert(self, alert: lt.alert) -> None:
        """Act on one of this torrent's alerts."""
        if isinstance(alert, lt.torrent_checked_alert):
            self._checked.set()
        elif isinstance(alert, lt.file_completed_alert):
            if alert.index < self.chunks_total and alert.index not in self.verified:
                self._verify_after_flush({alert.index})
        elif isinstance(alert, lt.cache_flushed_alert):
            pending, self._awaiting_flush = self._awaiting_flush, set()
            await self._verify(pending)
        elif isinstance(alert, lt.hash_failed_alert):
            self.hash_failures += 1
            log.info(
                "piece %d of %s failed its hash check and will be fetched again",
                alert.piece_index,
                self.manifest.name,
            )
        elif isinstance(alert, lt.save_resume_data_alert):
            if self._resume is not None and not self._resume.done():
                self._resume.set_result(bytes(lt.write_resume_data_buf(alert.params)))
        elif isinstance(alert, lt.save_resume_data_failed_alert):
            if self._resume is not None and not self._resume.done():
                self._resume.set_result(None)
        elif isinstance(alert, (lt.torrent_error_alert, lt.file_error_alert)):
            self.error = alert.message()
            log.error("%s: %s", self.manifest.name, self.error)
            self._checked.set()
        elif isinstance(alert, lt.tracker_error_alert):
            if "skipping tracker announce" in alert.message():
                # listening on every interface, libtorrent has a socket per interface and announces from
                # each that can reach the tracker; the others (loopback, for a tracker on the network)
                # report this, which is expected and not a failure
                log.debug("tracker: %s", alert.message())
            else:
                log.warning("tracker: %s", alert.message())

    def scan(self) -> None:
        """The periodic poll, once the files are checked: complete files whose ``file_completed_alert`` was
        dropped."""
        if not self._checked.is_set():
            return
        missed = self._complete_files() - self.verified - self._awaiting_flush
        if missed:
            self._verify_after_flush(missed)

    async def verify_complete_files(self) -> None:
        """Verify every file libtorrent holds complete now (after the check of the files on disk)."""
        await self._verify(self._complete_files())

    def fail(self, exc: BaseException) -> None:
        """The session's alert loop died: wake the waiters, who raise a :class:`DatasetError` for it."""
        self._failed = exc
        self._complete.set()
        self._checked.set()

    def request_resume_data(self) -> bool:
        """Ask libtorrent for resume data, its disk cache flushed first; False if it no longer has the torrent.

        :meth:`resume_data` waits for the answer."""
        if not self.handle.is_valid():
            return False
        self._resume = asyncio.get_running_loop().create_future()
        self.handle.save_resume_data(lt.torrent_handle.flush_disk_cache | lt.torrent_handle.save_info_dict)
        return True

    async def resume_data(self) -> bytes | None:
        """The resume data asked for by :meth:`request_resume_data`; None if libtorrent could not save it."""
        if self._resume is None:
            raise RuntimeError("Download.resume_data() called before request_resume_data()")
        return await self._resume

    # -------------------------------------------------------------- internals

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise DatasetError(f"The BitTorrent session failed: {self._failed}") from self._failed

    def _verify_after_flush(self, indices: set[int]) -> None:
        """Have libtorrent flush its disk cache; the files are verified when ``cache_flushed_alert`` comes."""
        self._awaiting_flush |= indices
        self.handle.flush_cache()

    async def _verify(self, indices: set[int]) -> None:
        """Hash the given complete files against the manifest; announce each that matches."""
        # the alert loop (after a flush) and `verify_complete_files` (when the torrent is added) may both
        # verify: the lock makes the later caller find the earlier one's results (so a chunk is announced
        # once, and `verify_complete_files` returns with all of them known)
        async with self._verify_lock:
            for index in sorted(indices - self.verified):
                await self._verify_one(index)
        if self.complete:
            self._complete.set()

    async def _verify_one(self, index: int) -> None:
        if index in self.verified:
            return
        info = self.manifest.chunks[index]
        path = self.data_dir / info.name
        try:
            digest = await asyncio.to_thread(sha256_file, path)
        except OSError as exc:
            digest = f"unreadable: {exc}"
        if digest != info.sha256:
            # libtorrent said the file is complete, so its pieces passed SHA-1: either we read before the
            # data reached the disk (flush and read again), or the torrent and the manifest disagree or the
            # disk changed under us (after a few tries, make libtorrent re-check the files)
            tries = self._tries[index] = self._tries.get(index, 0) + 1
            if tries < 3:
                self._verify_after_flush({index})
            elif tries == 3:
                log.warning("chunk %s does not match the manifest's sha256; re-checking the files", info.name)
                self.handle.force_recheck()
            else:
                log.error("chunk %s still does not match the manifest's sha256; it is not used", info.name)
            return
        self.verified.add(index)
        if self._on_chunk is not None:
            self._on_chunk(
                ChunkReady(
                    index=index,
                    name=info.name,
                    samples=info.samples,
                    held=len(self.verified),
                    total=self.chunks_total,
                )
            )

    def _complete_files(self) -> set[int]:
        progress = self.handle.file_progress(lt.torrent_handle.piece_granularity)
        return {i for i, c in enumerate(self.manifest.chunks) if i < len(progress) and progress[i] == c.bytes}


class TorrentSession:
    """The process's libtorrent session. Use ``async with TorrentSession(cfg) as ses`` or call
    :meth:`start` and :meth:`close`."""

    def __init__(self, config: SessionConfig | None = None) -> None:
        self.config = config or SessionConfig()
        self.fingerprint = f"-CT{secrets.token_hex(3)}-"  # 10 bytes: the prefix of our peer-id
        self._ses: lt.session | None = None
        self._downloads: dict[str, Download] = {}
        self._pump: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._closing = False
        self._stats_asked: asyncio.Future[dict[str, int]] | None = None  # see _session_stats
        self._listen = self.config.listen  # what it listens on once started (the port taken when 0)
        self._trackers: dict[str, list[str]] = {}  # infohash -> the hosts it announces to
        self._mapped: dict[int, tuple[str, int]] = {}  # libtorrent's mapping index -> (what, local port)
        self.port_maps: dict[tuple[str, str], PortMap] = {}  # (what, via) -> the router's last answer
        self.on_port_map: Callable[[PortMap], None] | None = None  # called with each new answer

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> TorrentSession:
        if self._ses is None:
            config = self.config
            host, _, port = config.listen.rpartition(":")
            if port == "0":
                # libtorrent opens one socket per interface for a wildcard host, and with port 0 each gets
                # its own port, so peers and the tracker would see a port other than the one announced on
                # their interface: take one free port for all of them
                config = replace(config, listen=f"{host}:{_free_port(host)}")
            self._listen = config.listen
            self._ses = await asyncio.to_thread(lt.session, _settings(config, self.fingerprint))
            self._pump = asyncio.get_running_loop().create_task(self._run_pump(), name="libtorrent-alerts")
            self._pump.add_done_callback(self._pump_done)
        return self

    async def __aenter__(self) -> TorrentSession:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def listen_port(self) -> int:
        return self._session().listen_port()

    @property
    def downloads(self) -> list[Download]:
        return list(self._downloads.values())

    def stats(self) -> SwarmStats:
        """The view's numbers, summed over this session's torrents (a volunteer has one)."""
        parts = [d.stats() for d in self._downloads.values()]
        return SwarmStats(
            chunks_held=sum(p.chunks_held for p in parts),
            chunks_total=sum(p.chunks_total for p in parts),
            download_rate=sum(p.download_rate for p in parts),
            upload_rate=sum(p.upload_rate for p in parts),
            peers=sum(p.peers for p in parts),
            seeds=sum(p.seeds for p in parts),
            downloaded=sum(p.downloaded for p in parts),
            uploaded=sum(p.uploaded for p in parts),
            progress=min((p.progress for p in parts), default=0.0),
            hash_failures=sum(p.hash_failures for p in parts),
        )

    def _session(self) -> lt.session:
        self._raise_failure()
        if self._ses is None:
            raise RuntimeError("TorrentSession used before start() or after close()")
        return self._ses

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise DatasetError(f"The BitTorrent session failed: {self._failure}") from self._failure

    def _pump_done(self, task: asyncio.Task[None]) -> None:
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            self._failure = failure
            log.error("libtorrent alert loop failed", exc_info=failure)
            for d in self._downloads.values():  # wake waiters so they see the failure
                d.fail(failure)

    async def close(self) -> None:
        """Save resume data of unfinished downloads, stop the alert loop, shut libtorrent down."""
        if self._ses is None:
            return
        try:
            if self._failure is None:
                await self._save_all_resume()
                await self._stop_announcing()
        finally:
            self._closing = True
            if self._pump is not None:
                # let the pump leave on its own: a cancelled pump would leave its `wait_for_alert` thread
                # holding the session, which then dies later, behind our back, instead of below
                done, _ = await asyncio.wait({self._pump}, timeout=5 + self.config.alert_poll_ms / 1000)
                if not done:
                    self._pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._pump
            for index in self._mapped:  # (libtorrent also removes its own listen port's mappings)
                self._ses.delete_port_mapping(index)
            self._mapped.clear()
            holder, self._ses = [self._ses], None
            self._downloads.clear()
            self._trackers.clear()
            # the last reference goes away in the worker thread: libtorrent's destructor blocks while it
            # sends the "stopped" announces, which a tracker on this very event loop must be free to answer
            await asyncio.to_thread(_shutdown, holder)
        self._raise_failure()

    # -------------------------------------------------------------- port mapping

    @property
    def port_mapping(self) -> bool:
        """Whether this session asks the router for mappings (the config's ``port_mapping``, not on loopback)."""
        return bool(self._session().get_settings()["enable_upnp"])

    def map_port(self, what: str, port: int) -> None:
        """Ask the router to forward TCP ``port`` (the same port outside) to this machine while the session
        lives; answers arrive in :attr:`port_maps` and :attr:`on_port_map`. Nothing when mapping is off."""
        if not self.port_mapping:
            return
        for index in self._session().add_port_mapping(lt.portmap_protocol.tcp, port, port):
            self._mapped[int(index)] = (what, port)

    def _on_port_map(self, alert: lt.portmap_alert | lt.portmap_error_alert) -> None:
        via = "NAT-PMP" if alert.map_transport == lt.portmap_transport.natpmp else "UPnP"
        what, port = self._mapped.get(int(alert.mapping), ("BitTorrent", self.listen_port))
        if isinstance(alert, lt.portmap_alert):
            if alert.map_protocol != lt.portmap_protocol.tcp:
                return  # (libtorrent maps its UDP port too; crowdtrain's BitTorrent speaks TCP only)
            answer = PortMap(what, port, via, int(alert.external_port))
        else:
            answer = PortMap(what, port, via, None, alert.error.message())
        if self.port_maps.get((what, via)) != answer:
            self.port_maps[(what, via)] = answer
            if self.on_port_map is not None:
                self.on_port_map(answer)

    # -------------------------------------------------------------- adding torrents

    async def seed(
        self,
        data_dir: str | os.PathLike,
        torrent_bytes: bytes,
        *,
        manifest: DatasetManifest | None = None,
    ) -> Download:
        """Seed the data set in ``data_dir`` (a folder made by ``dataset make`` or fully downloaded).

        libtorrent checks every piece on disk first; a folder that is not whole is refused with a sentence
        naming how much is missing.
        """
        data_dir = Path(data_dir)
        manifest = manifest or read_manifest(data_dir / "manifest.json")
        dl = await self._add(data_dir, torrent_bytes, manifest, None, priorities=None)
        if not dl.complete:
            st = dl.handle.status()
            missing = dl.chunks_total - len(dl.verified)
            raise DatasetError(
                f"{data_dir} holds {st.progress:.0%} of data set {manifest.name!r} ({missing} chunk(s) missing "
                "or damaged); run `dataset make` again or download it before seeding."
            )
        return dl

    async def stream(
        self,
        torrent_bytes: bytes,
        data_dir: str | os.PathLike,
        manifest: DatasetManifest,
        *,
        seed: int,
        on_chunk: Callable[[ChunkReady], None] | None = None,
    ) -> Download:
        """Start downloading into ``data_dir`` in a random chunk order drawn from ``seed``.

        Returns once the torrent is added and the files already on disk are checked; ``on_chunk`` is
        called (on the event loop) for every chunk verified from then on, including chunks found complete
        on disk. The torrent keeps seeding after it is complete.
        """
        n = len(manifest.chunks)
        order = list(range(n))
        random.Random(seed).shuffle(order)
        prio = [1] * (n + 1)  # + manifest.json
        for rank, index in enumerate(order[: len(PRIORITY_TIERS)]):
            prio[index] = PRIORITY_TIERS[rank]
        return await self._add(Path(data_dir), torrent_bytes, manifest, on_chunk, priorities=prio)

    async def _add(
        self,
        data_dir: Path,
        torrent_bytes: bytes,
        manifest: DatasetManifest,
        on_chunk: Callable[[ChunkReady], None] | None,
        *,
        priorities: list[int] | None,
    ) -> Download:
        ses = self._session()
        ti = check_torrent_matches(torrent_bytes, manifest)
        infohash = infohash_of(torrent_bytes)
        if infohash in self._downloads:
            raise DatasetError(f"Data set {manifest.name!r} ({infohash}) is already in this session.")
        await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
        atp = await asyncio.to_thread(_resume_params, data_dir, infohash)
        atp.ti = ti
        atp.save_path = str(data_dir)
        fs = ti.layout()
        atp.renamed_files = {i: os.path.basename(fs.file_path(i)) for i in range(fs.num_files())}
        if priorities is not None:
            atp.file_priorities = priorities
        # not auto-managed: libtorrent's queue must never pause a data set the volunteer trains on
        atp.flags &= ~(lt.torrent_flags.auto_managed | lt.torrent_flags.paused | lt.torrent_flags.seed_mode)
        self._trackers[infohash] = tracker_hosts(torrent_bytes)
        self._fit_listen()
        handle = ses.add_torrent(atp)
        # registered before the next await, so the alert loop finds it for the torrent's first alerts
        dl = self._downloads[infohash] = Download(handle, infohash, manifest, data_dir, on_chunk)
        try:
            if priorities is not None:  # resume data may carry other priorities
                handle.prioritize_files(priorities)
            async with asyncio.timeout(self.config.check_timeout_s):
                await dl.wait_checked()
            self._raise_failure()
            if dl.error:
                raise DatasetError(f"libtorrent could not use {data_dir}: {dl.error}")
            await dl.verify_complete_files()
        except TimeoutError:
            self._downloads.pop(infohash, None)
            self._trackers.pop(infohash, None)
            with contextlib.suppress(RuntimeError):
                ses.remove_torrent(handle)  # else adding the data set again would find it still there
            raise DatasetError(
                f"Checking the files of {manifest.name!r} in {data_dir} took more than "
                f"{self.config.check_timeout_s:.0f} s; is the disk very slow?"
            ) from None
        except BaseException:
            self._downloads.pop(infohash, None)
            self._trackers.pop(infohash, None)
            with contextlib.suppress(RuntimeError):
                ses.remove_torrent(handle)
            raise
        return dl

    def _fit_listen(self) -> None:
        """Listen on loopback alone while every tracker of this session's torrents is on loopback.

        On every interface, libtorrent announces from each one, bound to its device: to a tracker on
        127.0.0.1 the other interfaces' connections leave by the network card (SYNs to 127.0.0.1 seen on
        eth0 here) and time out, a warning each. A swarm whose tracker is on loopback is on this machine
        alone, so no other interface is worth listening on meanwhile."""
        host, _, port = self._listen.rpartition(":")
        if not is_wildcard(host):
            return
        hosts = [h for of_one in self._trackers.values() for h in of_one]
        local = bool(hosts) and all(is_loopback(h) for h in hosts)
        # (an IPv6 wildcard's trackers may be on either loopback)
        loopback = f"127.0.0.1:{port},[::1]:{port}" if ":" in host else f"127.0.0.1:{port}"
        want = loopback if local else self._listen
        ses = self._session()
        if want != ses.get_settings()["listen_interfaces"]:
            ses.apply_settings({"listen_interfaces": want})

    # -------------------------------------------------------------- alert loop

    async def _run_pump(self) -> None:
        # no local reference to the session: a failure's traceback keeps this frame alive, and the session
        # must die in close(), not whenever that traceback is collected
        next_scan = time.monotonic() + self.config.scan_interval_s
        while not self._closing and self._ses is not None:
            await asyncio.to_thread(self._ses.wait_for_alert, self.config.alert_poll_ms)
            if self._ses is None:
                break
            for alert in self._ses.pop_alerts():
                await self._dispatch(alert)
            if time.monotonic() >= next_scan:
                next_scan = time.monotonic() + self.config.scan_interval_s
                for dl in list(self._downloads.values()):
                    dl.scan()

    def _download_of(self, alert: lt.alert) -> Download | None:
        handle = getattr(alert, "handle", None)
        if handle is None:
            return None
        try:
            return self._downloads.get(str(handle.info_hashes().v1))
        except RuntimeError:
            return None

    async def _dispatch(self, alert: lt.alert) -> None:
        if isinstance(alert, lt.session_stats_alert):
            if self._stats_asked is not None and not self._stats_asked.done():
                self._stats_asked.set_result(dict(alert.values))
            return
        if isinstance(alert, lt.alerts_dropped_alert):
            log.warning("libtorrent dropped alerts; a file-progress scan will catch up")
            return
        if isinstance(alert, lt.portmap_alert | lt.portmap_error_alert):
            self._on_port_map(alert)
            return
        dl = self._download_of(alert)
        if dl is not None:
            await dl.on_alert(alert)

    # -------------------------------------------------------------- shutdown

    async def _stop_announcing(self) -> None:
        """Remove every torrent, which sends its "stopped" announces now, and give the trackers up to
        ``stop_tracker_timeout`` to answer while this event loop is free. Left to libtorrent's destructor,
        that wait holds the GIL: the whole process stalls for it (every volunteer and a tracker of the same
        process, which then cannot answer, so the stall lasts the whole timeout: 1 s per session measured
        here), and the tracker keeps the peer in its swarm until its entry expires."""
        if not self._downloads:
            return
        ses = self._session()
        before = await self._session_stats()
        for dl in self._downloads.values():
            ses.remove_torrent(dl.handle)
        if before is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_TRACKER_TIMEOUT_S
        while loop.time() < deadline:
            await asyncio.sleep(0.02)
            now = await self._session_stats()
            if now is None:
                return
            # (a reply came and no announce waits to go out: libtorrent's shutdown has nothing to wait for)
            if now[RECV_TRACKER] > before[RECV_TRACKER] and now[QUEUED_ANNOUNCES] == 0:
                return

    async def _session_stats(self) -> dict[str, int] | None:
        """libtorrent's counters (``session_stats_alert``, through the alert pump); None if none came in 1 s."""
        asked = self._stats_asked = asyncio.get_running_loop().create_future()
        self._session().post_session_stats()
        try:
            async with asyncio.timeout(1.0):
                return await asked
        except TimeoutError:
            return None
        finally:
            self._stats_asked = None

    # -------------------------------------------------------------- resume data

    async def _save_all_resume(self) -> None:
        asked = [dl for dl in self._downloads.values() if dl.request_resume_data()]
        for dl in asked:
            try:
                async with asyncio.timeout(self.config.close_timeout_s):
                    data = await dl.resume_data()
            except TimeoutError:
                log.warning(
                    "saving resume data of %s timed out; the next start re-checks its files", dl.manifest.name
                )
                continue
            if data:
                await _write_resume(dl.data_dir, dl.infohash, data)


def _free_port(host: str) -> int:
    """A TCP port free on ``host`` (every interface for a wildcard host), as the kernel picks one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def _resume_path(data_dir: Path, infohash: str) -> Path:
    return data_dir / f"{RESUME_PREFIX}{infohash}"


def _resume_params(data_dir: Path, infohash: str) -> lt.add_torrent_params:
    path = _resume_path(data_dir, infohash)
    if path.is_file() and path.stat().st_size <= (16 << 20):
        try:
            atp = lt.read_resume_data(path.read_bytes())
            if str(atp.info_hashes.v1) == infohash:
                return atp
            log.warning("resume data in %s is for another torrent; checking the files instead", path)
        except (RuntimeError, OSError) as exc:
            log.warning("resume data in %s is unusable (%s); checking the files instead", path, exc)
    return lt.add_torrent_params()


async def _write_resume(data_dir: Path, infohash: str, data: bytes) -> None:
    path = _resume_path(data_dir, infohash)
    tmp = path.with_suffix(".tmp")
    await asyncio.to_thread(tmp.write_bytes, data)
    await asyncio.to_thread(os.replace, tmp, path)


def _shutdown(holder: list[lt.session]) -> None:
    ses = holder.pop()
    del ses  # the destructor waits for libtorrent's threads and the stop announces
