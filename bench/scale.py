"""Many volunteers, several groups per step: participation, global batch ÷ target, missed steps,
parameter disagreement, steps per minute and the tracker's CPU per step, measured from outside.

The tracker is a ``crowdtrain tracker serve`` process of its own (its CPU time is read from /proc); the
seeder and N volunteers share this process and its event loop (the only way to fit 32 on 2 cores), each
with its own libtorrent session, peer server and key, all on loopback, with the tracker's default timings.

    .venv/bin/python bench/scale.py                     # 8, 16 and 32 volunteers, groups of 4
    .venv/bin/python bench/scale.py --volunteers 8 --group-size 2 --steps 10 --markdown
    .venv/bin/python bench/scale.py --volunteers 8,16 --delays 0,1   # delayed updates too

Definitions (issue 13): participation = steps a volunteer applied ÷ steps of the run while it was in it;
global batch = the samples the tracker credited to a step; parameter disagreement = the largest absolute
difference between any volunteer's parameters and the first one's at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

KiB = 1 << 10
TINY_GPT = {"d_model": 32, "n_layer": 1, "n_head": 2, "seq_len": 32}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def start_tracker() -> tuple[asyncio.subprocess.Process, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "crowdtrain", "tracker", "serve", "--port", "0", "--db", ":memory:",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    url = token = ""
    while not (url and token):
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        if not line:
            raise RuntimeError("the tracker exited before printing its URL and token")
        if m := re.match(r"tracker listening on (\S+)", line):
            url = m.group(1)
        if m := re.match(r"admin token: (\S+)", line):
            token = m.group(1)
    return proc, url, token


async def one_run(
    n: int, group_size: int, steps: int, micro_per_step: int, delay: int, workdir: Path
) -> dict:
    import numpy as np

    from crowdtrain.datasets.make import make_dataset
    from crowdtrain.datasets.session import SessionConfig, TorrentSession
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.publisher import build_run_create
    from crowdtrain.volunteer import events as ev
    from crowdtrain.volunteer.config import VolunteerConfig
    from crowdtrain.volunteer.engine import Volunteer

    micro = 8
    target = micro * micro_per_step * n
    proc, url, token = await start_tracker()
    try:
        data = workdir / f"data-{n}-{delay}"
        manifest = await asyncio.to_thread(
            make_dataset, "builtin:stdlib", data, chunk_bytes=64 * KiB, name="scale",
            announce_url=url + "/announce", max_bytes=512 * KiB,
        )  # fmt: skip
        create = await asyncio.to_thread(
            build_run_create, data, name=f"scale {n}", model={"recipe": "tiny-gpt", "args": TINY_GPT},
            target_batch_size=target, micro_batch_size=micro,
            optimizer={"name": "adamw", "lr": 3e-3},
            schedule={"kind": "constant", "warmup_steps": 0, "total_steps": 1000},
            averaging={"group_size": group_size, "codec": "none", "average_state_every": 0, "delay": delay},
        )  # fmt: skip
        async with TrackerClient(url, admin_token=token) as client:
            spec = (await client.create_run(create)).spec
            await client.register_dataset(spec.dataset.infohash, "scale")
        seen: list[list[ev.Event]] = [[] for _ in range(n)]
        records: dict[int, Any] = {}
        async with TorrentSession(SessionConfig(listen="127.0.0.1:0")) as seeder:
            await seeder.seed(data, (data / "scale.torrent").read_bytes(), manifest=manifest)
            vols = [
                Volunteer(
                    VolunteerConfig(
                        run_id=spec.run_id,
                        tracker_url=url,
                        data_dir=workdir / f"v{n}-{delay}-{i}",
                        host="127.0.0.1",
                        max_steps=steps,
                        seed=i,
                    ),
                    emit=seen[i].append,
                )
                for i in range(n)
            ]

            async def watch_history() -> None:
                async with TrackerClient(url) as c:
                    while True:
                        for r in (await c.status(spec.run_id)).recent_steps:
                            records[r.step] = r
                        await asyncio.sleep(0.5)

            cpu_before = cpu_seconds(proc.pid)
            watcher = asyncio.create_task(watch_history())
            try:
                # in one process on 2 cores, start-up and each step grow with n (16: ~26 s, then ~7 s a step)
                await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 120 + 3 * n * steps)
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            cpu = cpu_seconds(proc.pid) - cpu_before
            async with TrackerClient(url) as c:
                for r in (await c.status(spec.run_id)).recent_steps:
                    records[r.step] = r
            requests = await tracker_requests(url)
            params = [await asyncio.to_thread(v.trainer.flat_params) for v in vols]
    finally:
        proc.terminate()
        await proc.wait()

    if os.environ.get("BENCH_DEBUG"):
        for i, events in enumerate(seen):
            done = [(e.step, e.contributed_samples) for e in events if isinstance(e, ev.StepDone)]
            print(f"volunteer {i}: (step, samples it contributed) {done}", file=sys.stderr)
        print(f"credited per step: {[(s, r.samples) for s, r in sorted(records.items())]}", file=sys.stderr)
        print(
            f"step durations: {[(s, round(r.duration_s, 2)) for s, r in sorted(records.items())]}",
            file=sys.stderr,
        )
        times = [round(e.step_time_s, 3) for e in seen[0] if isinstance(e, ev.StepDone)]
        print(f"volunteer 0's rounds (s): {times}", file=sys.stderr)
    participation = []
    for events in seen:
        joined = next(e for e in events if isinstance(e, ev.Joined)).global_step
        done = sum(isinstance(e, ev.StepDone) for e in events)
        participation.append(done / max(1, steps - joined))
    missed = sum(isinstance(e, ev.StepMissed) for events in seen for e in events)
    ratios = [records[s].samples / target for s in sorted(records)]
    closes = sorted(r.closed_at for r in records.values())
    groups = []
    for events in seen:
        groups += [len(e.members) for e in events if isinstance(e, ev.RoundDone) and e.kind == "grad"]
    return {
        "volunteers": n,
        "G": group_size,
        "delay": delay,
        "target": target,
        "steps": len(records),
        "participation min": min(participation),
        "participation mean": statistics.fmean(participation),
        "missed": missed,
        "batch/target median": statistics.median(ratios) if ratios else float("nan"),
        "batch/target max": max(ratios) if ratios else float("nan"),
        "batch/target min": min(ratios) if ratios else float("nan"),
        "param disagreement": max(float(np.abs(p - params[0]).max()) for p in params),
        # from the first close to the last: the start-up (joins, first chunks) is not the run's pace
        "steps/min": 60 * (len(closes) - 1) / (closes[-1] - closes[0]) if len(closes) > 1 else float("nan"),
        "tracker CPU ms/step": 1000 * cpu / max(1, len(records)),
        # requests a volunteer makes per step (start-up included), by kind
        **{
            f"{kind}/vol/step": requests.get(kind, 0) / n / max(1, len(records))
            for kind in ("heartbeat", "ready", "step")
        },
    }


async def tracker_requests(url: str) -> dict[str, float]:
    """Requests the tracker answered so far, by the last word of their route (heartbeat, ready, step...),
    from its /metrics page."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "crowdtrain_tracker_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    kind = sample.labels["route"].rstrip("/").rsplit("/", 1)[-1]
                    counts[kind] = counts.get(kind, 0.0) + sample.value
    return counts


def fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--volunteers", default="8,16,32", help="comma-separated volunteer counts")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro-per-step", type=int, default=4, help="micro-batches of 8 per volunteer and step")
    ap.add_argument("--delays", default="0", help="comma-separated averaging.delay values, one run each")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory(prefix="crowdtrain-scale-") as tmp:
        for n in (int(x) for x in args.volunteers.split(",")):
            for delay in (int(x) for x in args.delays.split(",")):
                row = await one_run(n, args.group_size, args.steps, args.micro_per_step, delay, Path(tmp))
                rows.append(row)
                print("  ".join(f"{k}={fmt(v)}" for k, v in row.items()), flush=True)
    if args.markdown:
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for row in rows:
            print("| " + " | ".join(fmt(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    asyncio.run(main())
