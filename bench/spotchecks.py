"""Spot-checks (issue 29): what they cost per step and how soon they catch a cheater, measured from outside.

A ``crowdtrain tracker serve`` process; a libtorrent seeder and ``--volunteers`` volunteers share this process
(each with its own libtorrent session, peer server and key, on loopback), tiny-gpt d_model 64 × 2 layers,
target 64 samples, micro-batch 8, codec int8, groups of 4. One of the volunteers may cheat:

- ``other-data``: names the run's samples it drew but computes its gradients on random tokens;
- ``stale``: computes honestly but sends the gradient it computed 3 steps earlier (other parameters, other
  samples);
- ``none``: every volunteer is honest.

Each configuration (``spot_checks`` × cheater) runs ``--steps`` steps of the honest volunteers, ``--repeats``
times. Figures per configuration, from outside (the volunteers' events, the tracker's credit ledger):

- steps/min: the honest volunteers' global steps per minute after their first step (mean over repeats);
- checks: spot-checks reported (match / mismatch / unanswered / unverifiable), summed over repeats;
- recompute s/step: the checkers' seconds recomputing (from their verdicts' figures) per global step, and
  beside it the same as a share of the honest volunteers' compute seconds (``StepDone.compute_s``);
- caught: repeats in which the cheater was barred, and the global step at which it left (mean);
- honest flagged: honest keys with a rejection in the ledger (should be 0).

    .venv/bin/python bench/spotchecks.py                            # 0, 0.25 and 1.0 × none, other-data, stale
    .venv/bin/python bench/spotchecks.py --rates 0.25 --cheaters other-data --repeats 5 --markdown
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# (run as a script, bench/ is on sys.path)
from scale import KiB, start_tracker

MODEL = {"d_model": 64, "n_layer": 2, "n_head": 2, "seq_len": 32}
TARGET, MICRO, GROUP = 64, 8, 4
CHECK = re.compile(r"spot-check of \S+ at step \d+: (\w+) \((?:(\d+) samples in ([\d.]+) s)?")


def cheat(volunteer: Any, how: str) -> None:
    """Arm ``volunteer`` (just joined) to cheat ``how``."""
    import numpy as np

    trainer = volunteer._run.trainer
    if how == "other-data":
        accumulate, rng = trainer.accumulate, np.random.default_rng(5)

        def elsewhere(x, y):
            other = rng.integers(0, 256, size=(x.shape[0], x.shape[1] + 1), dtype=np.int64)
            return accumulate(other[:, :-1], other[:, 1:])

        trainer.accumulate = elsewhere
    elif how == "stale":
        take_grad, old = trainer.take_grad, collections.deque(maxlen=3)

        def replayed(into=None):
            g = take_grad(into)
            old.append(g.copy())
            if len(old) == old.maxlen:
                g[:] = old[0]
            return g

        trainer.take_grad = replayed


async def one_run(rate: float, cheater: str, args, workdir: Path) -> dict:
    from crowdtrain.datasets.make import make_dataset
    from crowdtrain.datasets.session import SessionConfig, TorrentSession
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.publisher import build_run_create
    from crowdtrain.volunteer import events as ev
    from crowdtrain.volunteer.config import VolunteerConfig
    from crowdtrain.volunteer.engine import Volunteer

    proc, url, token = await start_tracker()
    try:
        data = workdir / "data"
        manifest = await asyncio.to_thread(
            make_dataset, "builtin:stdlib", data, chunk_bytes=64 * KiB, name="spot",
            announce_url=url + "/announce", max_bytes=512 * KiB,
        )  # fmt: skip
        create = await asyncio.to_thread(
            build_run_create, data, name=f"spot {rate} {cheater}", model={"recipe": "tiny-gpt", "args": MODEL},
            target_batch_size=TARGET, micro_batch_size=MICRO, optimizer={"name": "adamw", "lr": 3e-3},
            schedule={"kind": "constant", "warmup_steps": 0, "total_steps": 1000},
            averaging={"group_size": GROUP, "codec": "int8", "average_state_every": 0, "spot_checks": rate},
        )  # fmt: skip
        async with TrackerClient(url, admin_token=token) as client:
            spec = (await client.create_run(create)).spec
            await client.register_dataset(spec.dataset.infohash, "spot")
        n = args.volunteers
        seen: list[list[Any]] = [[] for _ in range(n)]
        stamps: list[list[float]] = [[] for _ in range(n)]  # when each event came
        async with TorrentSession(SessionConfig(listen="127.0.0.1:0")) as seeder:
            await seeder.seed(data, (data / "spot.torrent").read_bytes(), manifest=manifest)
            vols: list[Any] = []
            for i in range(n):
                bad = cheater != "none" and i == n - 1

                def emit(e, i=i, bad=bad) -> None:
                    seen[i].append(e)
                    stamps[i].append(time.monotonic())
                    if bad and isinstance(e, ev.Joined):
                        cheat(vols[i], cheater)

                config = VolunteerConfig(
                    run_id=spec.run_id, tracker_url=url, data_dir=workdir / f"v{rate}-{cheater}-{i}",
                    host="127.0.0.1", max_steps=None if bad else args.steps, seed=i,
                )  # fmt: skip
                vols.append(Volunteer(config, emit=emit))
            started = time.monotonic()
            runs = [asyncio.create_task(v.run()) for v in vols]
            honest = runs[:-1] if cheater != "none" else runs
            await asyncio.wait_for(asyncio.gather(*honest), 60 + 10 * args.steps)
            wall = time.monotonic() - started
            for v in vols:
                v.stop()
            await asyncio.gather(*runs, return_exceptions=True)
            async with TrackerClient(url) as c:
                status = await c.status(spec.run_id)
    finally:
        proc.terminate()
        await proc.wait()

    honest_ids = range(n - 1) if cheater != "none" else range(n)
    done = [[e for e in seen[i] if isinstance(e, ev.StepDone)] for i in honest_ids]
    at = [
        [t for t, e in zip(stamps[i], seen[i], strict=True) if isinstance(e, ev.StepDone)] for i in honest_ids
    ]
    per_min = statistics.mean(60 * (len(t) - 1) / (t[-1] - t[0]) for t in at if len(t) > 1 and t[-1] > t[0])
    outcomes: collections.Counter[str] = collections.Counter()
    recompute_s = 0.0
    for events in seen:
        for e in events:
            if isinstance(e, ev.LogLine) and (m := CHECK.search(e.message)):
                outcomes[m.group(1)] += 1
                if args.verbose or (m.group(1) != "match" and cheater == "none"):
                    print(f"    {e.message}", file=sys.stderr)
                recompute_s += float(m.group(3) or 0.0)
    compute_s = sum(e.compute_s for d in done for e in d)
    steps = max((e.step for d in done for e in d), default=0) + 1
    keys = [v._me.key.public_hex for v in vols]
    credits = {c.public_key: c for c in status.credits}
    flagged = sum(1 for i in honest_ids if (c := credits.get(keys[i])) is not None and c.rejected)
    caught, left_at = False, None
    if cheater != "none":
        summary = vols[-1].summary
        caught = "spot-checks" in (summary.ended or "")
        left_at = summary.last_step if caught else None
    return {
        "per_min": per_min, "wall_s": wall, "outcomes": outcomes, "recompute_s": recompute_s, "compute_s": compute_s,
        "steps": steps, "flagged": flagged, "caught": caught, "left_at": left_at,
    }  # fmt: skip


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0,0.25,1.0", help="spot_checks values, comma-separated")
    p.add_argument("--cheaters", default="none,other-data,stale", help="none, other-data, stale")
    p.add_argument("--volunteers", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="global steps of the honest volunteers per run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--verbose", action="store_true", help="print every verdict that is not a match")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ct-spot-") as tmp:
        for rate in [float(r) for r in args.rates.split(",")]:
            for cheater in args.cheaters.split(","):
                results = []
                for k in range(args.repeats):
                    workdir = Path(tmp) / f"{rate}-{cheater}-{k}"
                    workdir.mkdir(parents=True)
                    results.append(await one_run(rate, cheater, args, workdir))
                    print(f"  {rate} {cheater} #{k + 1}: {results[-1]}", file=sys.stderr, flush=True)
                rows.append((rate, cheater, results))
    head = "| spot_checks | cheater | steps/min | checks (match/mismatch/unanswered/unverifiable) | recompute s/step | share of compute | caught | left at step | honest flagged |"
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    for rate, cheater, results in rows:
        o = sum((r["outcomes"] for r in results), collections.Counter())
        steps = sum(r["steps"] for r in results)
        rec = sum(r["recompute_s"] for r in results)
        comp = sum(r["compute_s"] for r in results)
        caught = [r for r in results if r["caught"]]
        left = statistics.mean(r["left_at"] for r in caught) if caught else None
        print(
            f"| {rate} | {cheater} | {statistics.mean(r['per_min'] for r in results):.1f} | "
            f"{o['match']}/{o['mismatch']}/{o['unanswered']}/{o['unverifiable']} | {rec / max(steps, 1):.3f} | "
            f"{100 * rec / comp if comp else 0:.1f}% | "
            f"{'-' if cheater == 'none' else f'{len(caught)}/{len(results)}'} | "
            f"{'-' if left is None else f'{left:.1f}'} | {sum(r['flagged'] for r in results)} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
