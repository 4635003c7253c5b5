"""Time to the first training batch vs time to the whole torrent, for data sets of different sizes.

One run, side by side: for each size a synthetic token data set is made (random bytes written to a
``.npy`` and cut by ``make_dataset`` into 4 MiB chunks), registered with a real in-process tracker, seeded
by a rate-limited libtorrent session and streamed by a second session on loopback. The downloader's
sampler is fed exactly as the volunteer feeds it; "first batch" is the moment ``Sampler.batch`` returned
a batch, measured from the moment the downloader added the torrent.

    .venv/bin/python bench/time_to_first_batch.py                    # 64 MiB and 512 MiB, seeder at 16 MiB/s
    .venv/bin/python bench/time_to_first_batch.py --sizes 64,256 --rate 8MiB

Time to first batch should not grow with the data set (the issue asks for 64 MiB vs 512 MiB within 1.5x);
time to the whole torrent grows with it, bounded by the seeder's rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from crowdtrain.datasets.make import make_dataset
from crowdtrain.datasets.sampler import Sampler
from crowdtrain.datasets.session import ChunkReady, SessionConfig, TorrentSession
from crowdtrain.datasets.torrent import find_torrent, infohash_of
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve

MiB = 1 << 20


def write_tokens(path: Path, size: int, seed: int) -> None:
    """``size`` random uint8 tokens as a .npy, written in 16 MiB slices (little memory)."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(size,))
    rng = np.random.default_rng(seed)
    for start in range(0, size, 16 * MiB):
        stop = min(size, start + 16 * MiB)
        out[start:stop] = rng.integers(0, 256, stop - start, dtype=np.uint8)
    out.flush()
    del out


async def one(size_mib: int, rate: int, chunk: int, seq_len: int, work: Path) -> dict:
    src_npy = work / f"tokens-{size_mib}.npy"
    await asyncio.to_thread(write_tokens, src_npy, size_mib * MiB, size_mib)
    async with serve(TrackerConfig()) as tracker:
        published = work / f"published-{size_mib}"
        t0 = time.perf_counter()
        manifest = await asyncio.to_thread(
            make_dataset, src_npy, published, chunk_bytes=chunk, name=f"synthetic-{size_mib}",
            announce_url=tracker.announce_url,
        )  # fmt: skip
        make_s = time.perf_counter() - t0
        src_npy.unlink()
        torrent = find_torrent(published).read_bytes()
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
            await client.register_dataset(infohash_of(torrent), manifest.name)

        async with (
            TorrentSession(SessionConfig(upload_rate_limit=rate)) as seeder,
            TorrentSession() as downloader,
        ):
            await seeder.seed(published, torrent)
            sampler = Sampler(manifest, work / f"dl-{size_mib}", seed=0, seq_len=seq_len)
            first: dict[str, float] = {}
            start = time.perf_counter()

            def on_chunk(event: ChunkReady) -> None:
                sampler.add_chunk(event.index)
                if "batch" not in first:
                    sampler.batch(8)
                    first["batch"] = time.perf_counter() - start
                    first["progress"] = dl.handle.status().progress

            dl = await downloader.stream(
                torrent, work / f"dl-{size_mib}", manifest, seed=1, on_chunk=on_chunk
            )
            async with asyncio.timeout(3600):
                await dl.wait_complete()
            whole = time.perf_counter() - start
        await asyncio.sleep(0.1)
    shutil.rmtree(published)
    shutil.rmtree(work / f"dl-{size_mib}")
    return {
        "size_mib": size_mib,
        "chunks": len(manifest.chunks),
        "make_s": round(make_s, 2),
        "first_batch_s": round(first["batch"], 3),
        "progress_at_first_batch": round(first["progress"], 4),
        "whole_torrent_s": round(whole, 2),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,512", help="data set sizes in MiB, comma-separated")
    ap.add_argument("--rate", default=16, type=int, help="seeder upload limit in MiB/s")
    ap.add_argument("--chunk", default=4, type=int, help="chunk size in MiB")
    ap.add_argument("--seq-len", default=256, type=int)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ttfb-") as tmp:
        for size in sizes:
            rows.append(await one(size, args.rate * MiB, args.chunk * MiB, args.seq_len, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nseeder limited to {args.rate} MiB/s, {args.chunk} MiB chunks, loopback, one downloader")
    print(f"{'size':>9} {'chunks':>7} {'first batch':>12} {'(progress)':>11} {'whole torrent':>14}")
    for r in rows:
        print(
            f"{r['size_mib']:>5} MiB {r['chunks']:>7} {r['first_batch_s']:>10.3f} s {r['progress_at_first_batch']:>10.1%}"
            f" {r['whole_torrent_s']:>12.2f} s"
        )
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        print(
            f"first batch {b['size_mib']} MiB / {a['size_mib']} MiB = {b['first_batch_s'] / a['first_batch_s']:.2f}x; "
            f"whole torrent {b['whole_torrent_s'] / a['whole_torrent_s']:.2f}x"
        )


if __name__ == "__main__":
    asyncio.run(main())
