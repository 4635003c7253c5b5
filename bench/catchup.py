"""State catch-up from 1, 2 and 3 donors, each rate-limited to the same upload rate, on loopback.

A ~100M-parameter state (random fp32 tensors, ~400 MB) is snapshotted once into a file, as a volunteer
writes it (``save_snapshot``); each donor is its own process serving that file with ``StateServer`` under the
snapshot's manifest (upload paced to ``--rate`` MiB/s); the newcomer (this process)
fetches it with ``fetch_state`` from the first 1, 2, 3 donors and loads it with ``load_snapshot``.
Printed: MB/s of the download, time to the verified bytes, time to a loaded state, and the ratio to one
donor. A last scenario adds a donor at a quarter of the rate to show that work-stealing does not wait
for it.

    .venv/bin/python bench/catchup.py                 # defaults: 100M params, 20 MiB/s per donor
    .venv/bin/python bench/catchup.py --params 25000000 --rate 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
RUN_ID = "bench-catchup"


async def donor_main(args: argparse.Namespace) -> None:
    from aiohttp import web

    from crowdtrain.protocol.messages import StateManifest, decode
    from crowdtrain.volunteer.state.config import StateConfig
    from crowdtrain.volunteer.state.serve import StateServer
    from crowdtrain.volunteer.state.snapshot import Snapshot

    manifest = decode(await asyncio.to_thread(Path(args.manifest).read_bytes), StateManifest)
    snap = Snapshot.of(manifest, path=Path(args.file))
    config = StateConfig(range_bytes=args.range_mib * MiB, upload_rate=args.rate * MiB, max_uploads=16)
    server = StateServer(run_id=RUN_ID, tracker_public_key=args.tracker_key, config=config)
    server.publish(snap)
    app = web.Application()
    app.add_routes(server.routes())
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(json.dumps({"port": runner.addresses[0][1], "hash": snap.content_hash}), flush=True)
    try:
        # Serve until the parent closes our stdin (or dies).
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await runner.cleanup()


async def start_donor(
    file: Path, manifest: Path, rate: float, args: argparse.Namespace, tracker_key: str
) -> tuple[asyncio.subprocess.Process, int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--donor",
        "--file",
        str(file),
        "--manifest",
        str(manifest),
        "--rate",
        str(rate),
        "--range-mib",
        str(args.range_mib),
        "--step",
        str(args.step),
        "--tracker-key",
        tracker_key,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    async with asyncio.timeout(120):
        line = await proc.stdout.readline()
    info = json.loads(line)
    return proc, info["port"], info["hash"]


def make_state(file: Path, params: int, step: int, range_mib: int):
    import torch

    from crowdtrain.volunteer.state.snapshot import save_snapshot

    gen = torch.Generator().manual_seed(0)
    per = 4 * MiB
    model_state = {}
    left = params
    i = 0
    while left > 0:
        n = min(per, left)
        model_state[f"layers.{i}.weight"] = torch.randn(n, generator=gen)
        left -= n
        i += 1
    return save_snapshot(
        file,
        run_id=RUN_ID,
        step=step,
        recipe="bench",
        args={"params": params},
        model_state=model_state,
        optimizer_state={"state": {}, "param_groups": []},
        scheduler_state=None,
        range_bytes=range_mib * MiB,
    )


async def bench(args: argparse.Namespace) -> None:
    from crowdtrain.protocol.credentials import SigningKey, issue_credential
    from crowdtrain.protocol.messages import Donor, encode
    from crowdtrain.volunteer.events import DonorBanned, StateLoaded
    from crowdtrain.volunteer.state.config import StateConfig
    from crowdtrain.volunteer.state.fetch import fetch_state
    from crowdtrain.volunteer.state.snapshot import load_snapshot

    tracker = SigningKey()
    key = SigningKey()
    credential = issue_credential(tracker, RUN_ID, "newcomer", key.public_hex, ttl_s=3600)

    with tempfile.TemporaryDirectory() as tmp:
        file, manifest = Path(tmp) / "state.safetensors", Path(tmp) / "state.manifest.json"
        t = time.perf_counter()
        snap = await asyncio.to_thread(make_state, file, args.params, args.step, args.range_mib)
        size, version = snap.size, snap.version
        manifest.write_bytes(encode(snap.manifest))
        print(
            f"state: {args.params / 1e6:.0f}M params, {size / 1e6:.0f} MB, made in {time.perf_counter() - t:.1f} s",
            flush=True,
        )
        config = StateConfig(
            range_bytes=args.range_mib * MiB, accept_zstd=args.zstd, max_state_bytes=max(size, 1 << 30)
        )
        rates = [args.rate] * 3 + [args.rate / 4]
        procs = []
        try:
            started = await asyncio.gather(
                *(start_donor(file, manifest, rate, args, tracker.public_hex) for rate in rates)
            )
            procs.extend(proc for proc, _, _ in started)
            assert all(h == version.content_hash for _, _, h in started), "a donor hashed a different state"
            donors = [
                Donor(peer_id=f"donor{i}", address=f"127.0.0.1:{port}", public_key=SigningKey().public_hex)
                for i, (_, port, _) in enumerate(started)
            ]
            scenarios = [
                ("1 donor", donors[:1]),
                ("2 donors", donors[:2]),
                ("3 donors", donors[:3]),
                ("2 donors + 1 at 1/4 rate", [donors[0], donors[1], donors[3]]),
            ]
            rows = []
            for name, chosen in scenarios:
                for _ in range(args.repeat):
                    events = []
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    data = await fetch_state(
                        donors=chosen,
                        version=version,
                        run_id=RUN_ID,
                        key=key,
                        credential=credential,
                        config=config,
                        emit=events.append,
                    )
                    t1 = time.perf_counter()
                    c1 = time.process_time()
                    loaded = await asyncio.to_thread(load_snapshot, data)
                    t2 = time.perf_counter()
                    assert loaded.step == args.step and len(loaded.model_state) > 0
                    assert not any(isinstance(e, DonorBanned) for e in events)
                    used = next(e for e in events if isinstance(e, StateLoaded)).donors_used
                    del data, loaded
                    rows.append((name, t1 - t0, t2 - t0, len(used), c1 - c0))
                    print(
                        f"{name}: {size / (t1 - t0) / 1e6:.1f} MB/s, fetched in {t1 - t0:.2f} s, loaded at {t2 - t0:.2f} s",
                        flush=True,
                    )
        finally:
            for proc in procs:
                if proc.stdin is not None:
                    proc.stdin.close()
            for proc in procs:
                try:
                    async with asyncio.timeout(10):
                        await proc.wait()
                except TimeoutError:
                    proc.kill()
                    await proc.wait()

    best: dict[str, tuple] = {}
    for row in rows:  # the fastest of --repeat runs per scenario (the machine is shared and noisy)
        if row[0] not in best or row[1] < best[row[0]][1]:
            best[row[0]] = row
    rows = list(best.values())
    base = rows[0][1]
    print()
    print(
        f"per-donor upload limit {args.rate:g} MiB/s ({args.rate * MiB / 1e6:.1f} MB/s), ranges {args.range_mib} MiB, "
        f"zstd {'on' if args.zstd else 'off'}, state {size / 1e6:.0f} MB, {os.cpu_count()} CPUs"
    )
    print(f"best of {args.repeat} run(s) per scenario; newcomer CPU = process CPU seconds during the fetch")
    print("| donors | MB/s | fetch s | to loaded state s | donors used | newcomer CPU s | rate vs 1 donor |")
    print("|---|---|---|---|---|---|---|")
    for name, fetch_s, loaded_s, used, cpu_s in rows:
        print(
            f"| {name} | {size / fetch_s / 1e6:.1f} | {fetch_s:.2f} | {loaded_s:.2f} | {used} | {cpu_s:.1f} "
            f"| {base / fetch_s:.2f}× |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=100_000_000)
    p.add_argument("--rate", type=float, default=20.0, help="upload limit per donor, MiB/s")
    p.add_argument("--range-mib", type=int, default=4)
    p.add_argument("--step", type=int, default=1234)
    p.add_argument("--repeat", type=int, default=1, help="runs per scenario; the fastest is reported")
    p.add_argument("--zstd", action="store_true", help="accept zstd ranges (random tensors barely compress)")
    p.add_argument("--donor", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--manifest", help=argparse.SUPPRESS)
    p.add_argument("--tracker-key", help=argparse.SUPPRESS)
    args = p.parse_args()
    asyncio.run(donor_main(args) if args.donor else bench(args))


if __name__ == "__main__":
    main()
