"""The volunteer's data: the run's chunks streamed over BitTorrent into the training sampler (and the
held-out one), and the torrent's figures for the view."""

from __future__ import annotations

import asyncio
import contextlib

from crowdtrain.datasets.sampler import Sampler
from crowdtrain.datasets.session import Download
from crowdtrain.protocol.aio import wait_at_most
from crowdtrain.protocol.errors import CrowdtrainError, DatasetError
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.heldout import HeldOut
from crowdtrain.volunteer.joined import JoinedRun

STATS_INTERVAL_S = 1.0


class DataFeed:
    """Verified chunks into the samplers, as they arrive; training starts with the first."""

    def __init__(self, run: JoinedRun) -> None:
        self.run = run
        cut = run.sample_cut()
        self.sampler = Sampler(run.spec.dataset.manifest, run.config.data_dir, seed=run.sampler_seed, **cut)
        self.heldout = HeldOut(run, cut)
        self.chunks_held = 0
        self.error: DatasetError | None = None  # a verified chunk the sampler refused
        self.download: Download | None = None

    def _on_chunk(self, chunk) -> None:
        try:
            if not self.heldout.add_chunk(chunk.index):
                self.sampler.add_chunk(chunk.index)
        except DatasetError as exc:  # (called by the torrent session's alert loop: not raised there)
            self.error = self.error or exc  # a chunk the run's model cannot take: the train loop ends the
            return  # volunteer with this sentence
        self.chunks_held += 1
        self.run.emit(
            ev.ChunkVerified(
                index=chunk.index,
                name=chunk.name,
                samples=chunk.samples,
                held=self.chunks_held,
                total=len(self.run.spec.dataset.manifest.chunks),
            )
        )

    async def stream(self) -> None:
        run = self.run
        self.download = await run.torrent.stream(
            run.torrent_file,
            run.config.data_dir,
            run.spec.dataset.manifest,
            seed=run.sampler_seed,
            on_chunk=self._on_chunk,
        )

    async def stats(self) -> None:
        """The torrent's figures for the view, every STATS_INTERVAL_S."""
        stop = self.run.me.stop
        while not stop.is_set():
            if self.download is None:
                await asyncio.sleep(0.1)
                continue
            # libtorrent answers a status query from its network thread: a busy one must not stall the event
            # loop (heartbeats, rounds, Ctrl-C)
            s = await asyncio.to_thread(self.download.stats)
            self.run.emit(
                ev.TorrentStats(
                    chunks_held=s.chunks_held,
                    chunks_total=s.chunks_total,
                    download_rate=s.download_rate,
                    upload_rate=s.upload_rate,
                    peers=s.peers,
                    seeds=s.seeds,
                    downloaded=s.downloaded,
                    uploaded=s.uploaded,
                    progress=s.progress,
                )
            )
            await wait_at_most(stop, STATS_INTERVAL_S)

    def bt_port(self) -> int | None:
        """The BitTorrent port others connect to: the one the home router forwards to it, if it does; None
        until the run's torrent is in the session (the tracker's check is a handshake for it)."""
        with contextlib.suppress(CrowdtrainError, RuntimeError):
            torrent = self.run.torrent
            if not torrent.downloads:
                return None
            forwarded = [
                m.external_port for (what, _), m in torrent.port_maps.items() if what == "BitTorrent"
            ]
            return next((p for p in forwarded if p), None) or torrent.listen_port or None
        return None
