"""Group all-reduce: crowdtrain's butterfly over HTTP vs torch.distributed gloo ``all_reduce``, on 127.0.0.1.

Every member is its own process for both systems (gloo needs that; crowdtrain gets the same so the
comparison is fair). For each vector size N and group size P the two run back to back in one go:

* gloo: ``init_process_group("gloo")`` through a file store, then rounds of ``barrier(); all_reduce(x)``;
* crowdtrain: each process runs an ``Averager`` behind its own aiohttp server on 127.0.0.1:0; this script
  plays the tracker (signs credentials and one assignment per round); a 1-value all-reduce before each
  timed round lines the members up the way gloo's barrier does.

A round's time is the slowest member's time for that round; the table shows the median over the timed
rounds (after warm-up rounds). "cpu s" is the user + system CPU seconds of all members together in one
round (median; the kernel's TCP copies included), the steadier figure on a shared machine: with four
processes on two cores the wall time follows it. "wire MB" is the tensor bytes all members put on the
loopback in one round (HTTP headers not counted; for gloo the ring's 2(P-1)/P·4N per member). "ready s" is
the time from a crowdtrain member's process start to its peer server answering (interpreter and imports
included).
``BENCH_DEBUG=1`` prints each member's wall and CPU seconds, page faults and phases per round;
``BENCH_ROUNDS=K`` times K rounds instead of the default for each size.

    .venv/bin/python bench/allreduce.py                  # the full table (several minutes on 2 cores)
    .venv/bin/python bench/allreduce.py --sizes 1M --groups 2 --codecs none,none@-1 --markdown

``--codecs`` takes ``codec[@zstd level]``; the default level is the run spec's default (1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"1M": 1_000_000, "10M": 10_000_000, "25M": 25_000_000}
ROUNDS = {1_000_000: (2, 9), 10_000_000: (2, 9), 25_000_000: (1, 5)}  # (warm-up, timed)
HERE = Path(__file__).resolve()


# ------------------------------------------------------------------ workers (one process each)


def _wait_for(path: Path, timeout: float = 120.0) -> None:
    end = time.time() + timeout
    while not path.exists():
        if time.time() > end:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.01)


def _cpu() -> float:
    """User + system CPU seconds of this process, all threads (the kernel's TCP copies included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _write_atomic(path: Path, data: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(data)
    os.replace(tmp, path)


def gloo_worker(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{args.dir}/store", rank=args.rank, world_size=args.world
    )
    torch.manual_seed(args.rank)
    x = torch.randn(args.n)
    times, cpus = [], []
    for _ in range(args.warmup + args.rounds):
        dist.barrier()
        t, cpu = time.perf_counter(), _cpu()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
        cpus.append(_cpu() - cpu)
        x.div_(args.world)
    dist.destroy_process_group()
    w = args.warmup
    _write_atomic(
        Path(args.dir) / f"result{args.rank}.json", json.dumps({"times": times[w:], "cpu": cpus[w:]})
    )


def crowdtrain_worker(args) -> None:
    import asyncio

    import numpy as np
    from aiohttp import web

    from crowdtrain.protocol.codecs import Codec
    from crowdtrain.protocol.credentials import SigningKey
    from crowdtrain.protocol.messages import Credential, GroupAssignment, decode
    from crowdtrain.volunteer.averaging import Averager, AveragingConfig

    setup = json.loads((Path(args.dir) / f"setup{args.rank}.json").read_text())

    async def main() -> None:
        averager = Averager(
            run_id=setup["run_id"],
            tracker_public_key=setup["tracker"],
            peer_id=setup["peer_id"],
            key=SigningKey.from_bytes(bytes.fromhex(setup["key"])),
            credential=decode(setup["credential"].encode(), Credential),
            config=AveragingConfig(codec=Codec.parse(args.codec), zstd_level=args.zstd_level),
        )
        app = web.Application()
        app.add_routes(averager.routes())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        ready = time.time() - args.t0
        _write_atomic(
            Path(args.dir) / f"addr{args.rank}.json",
            json.dumps({"address": f"127.0.0.1:{runner.addresses[0][1]}", "ready_s": ready}),
        )
        rounds_file = Path(args.dir) / "rounds.json"
        await asyncio.to_thread(_wait_for, rounds_file, 600.0)
        assignments = [decode(a.encode(), GroupAssignment) for a in json.loads(rounds_file.read_text())]
        rng = np.random.default_rng(args.rank)
        x = rng.standard_normal(args.n).astype(np.float32)
        sync = np.zeros(1, np.float32)
        out = np.empty_like(x)  # one result buffer for every round, as `crowdtrain join` does
        times, cpus, sent, raw = [], [], [], []
        for a in assignments:
            await averager.allreduce(a, sync, 1.0, tag="sync")
            t, cpu, cpu0 = time.perf_counter(), time.process_time(), _cpu()
            ru = resource.getrusage(resource.RUSAGE_SELF)
            result = await averager.allreduce(a, x, 1.0, tag="grad", out=out)
            times.append(time.perf_counter() - t)
            cpus.append(_cpu() - cpu0)
            if os.environ.get("BENCH_DEBUG"):  # per member and round: wall, CPU of all threads, phases
                cpu = time.process_time() - cpu
                ru2 = resource.getrusage(resource.RUSAGE_SELF)
                user, system = ru2.ru_utime - ru.ru_utime, ru2.ru_stime - ru.ru_stime
                phases = {k: round(v, 3) for k, v in result.phases.items()}
                print(
                    args.rank,
                    f"wall {times[-1]:.3f} s, cpu {cpu:.3f} s (user {user:.3f}, system {system:.3f}, faults {ru2.ru_minflt - ru.ru_minflt})",
                    phases,
                    file=sys.stderr,
                )
            sent.append(result.bytes_sent)
            raw.append(result.raw_bytes)
            if result.failed_parts or result.dropped or result.rejected:
                raise SystemExit(f"round {a.round_id} was not complete: {result}")
        await averager.close()
        await runner.cleanup()
        w = args.warmup
        _write_atomic(
            Path(args.dir) / f"result{args.rank}.json",
            json.dumps(
                {"times": times[w:], "cpu": cpus[w:], "sent": sent[w:], "raw": raw[w:], "ready_s": ready}
            ),
        )

    from crowdtrain.commands.common import new_event_loop

    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # the loop `crowdtrain join` runs on
        runner.run(main())


# ------------------------------------------------------------------ coordinator


def _spawn(
    kind: str, d: Path, rank: int, world: int, n: int, warmup: int, rounds: int, codec: str, level: int
):
    cmd = [sys.executable, str(HERE), "--worker", kind, "--dir", str(d), "--rank", str(rank)]
    cmd += ["--world", str(world), "--n", str(n), "--warmup", str(warmup), "--rounds", str(rounds)]
    cmd += ["--codec", codec, "--zstd-level", str(level), "--t0", repr(time.time())]
    return subprocess.Popen(cmd)


def _collect(procs, d: Path, world: int) -> list[dict]:
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"a worker failed with exit code {p.returncode}")
    return [json.loads((d / f"result{r}.json").read_text()) for r in range(world)]


def run_gloo(n: int, world: int) -> dict:
    warmup, rounds = ROUNDS[n]
    rounds = int(os.environ.get("BENCH_ROUNDS", rounds))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        procs = [_spawn("gloo", d, r, world, n, warmup, rounds, "none", 1) for r in range(world)]
        results = _collect(procs, d, world)
    per_round = [max(r["times"][k] for r in results) for k in range(rounds)]
    wire = world * 2 * (world - 1) / world * 4 * n
    cpu = statistics.median(sum(r["cpu"][k] for r in results) for k in range(rounds))
    return {"s": statistics.median(per_round), "wire": wire, "cpu": cpu}


def run_crowdtrain(n: int, world: int, codec: str, level: int) -> dict:
    from crowdtrain.protocol.credentials import SigningKey, issue_credential, sign_assignment
    from crowdtrain.protocol.messages import GroupAssignment, GroupMember, encode

    warmup, rounds = ROUNDS[n]
    rounds = int(os.environ.get("BENCH_ROUNDS", rounds))
    tracker = SigningKey()
    keys = [SigningKey() for _ in range(world)]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for r, key in enumerate(keys):
            cred = issue_credential(tracker, "bench", f"peer{r}", key.public_hex, 3600)
            setup = {
                "run_id": "bench",
                "tracker": tracker.public_hex,
                "peer_id": f"peer{r}",
                "key": key.private_bytes().hex(),
                "credential": encode(cred).decode(),
            }
            (d / f"setup{r}.json").write_text(json.dumps(setup))
        procs = [_spawn("crowdtrain", d, r, world, n, warmup, rounds, codec, level) for r in range(world)]
        addrs = []
        for r in range(world):
            _wait_for(d / f"addr{r}.json")
            addrs.append(json.loads((d / f"addr{r}.json").read_text()))
        members = [
            GroupMember(
                peer_id=f"peer{r}", address=addrs[r]["address"], public_key=k.public_hex, weight=1, part=r
            )
            for r, k in enumerate(keys)
        ]
        deadline = time.time() + 600
        assignments = [
            sign_assignment(
                tracker,
                GroupAssignment(
                    run_id="bench",
                    round_id=f"b{i}",
                    step=i,
                    members=members,
                    parts=world,
                    average_params=False,
                    deadline=deadline,
                    seed=0,
                    signature="",
                ),
            )
            for i in range(warmup + rounds)
        ]
        _write_atomic(d / "rounds.json", json.dumps([encode(a).decode() for a in assignments]))
        results = _collect(procs, d, world)
    per_round = [max(r["times"][k] for r in results) for k in range(rounds)]
    wire = statistics.median(sum(r["sent"][k] for r in results) for k in range(rounds))
    raw = statistics.median(sum(r["raw"][k] for r in results) for k in range(rounds))
    return {
        "s": statistics.median(per_round),
        "cpu": statistics.median(sum(r["cpu"][k] for r in results) for k in range(rounds)),
        "wire": wire,
        "raw": raw,
        "ready": max(r["ready_s"] for r in results),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["gloo", "crowdtrain"])
    ap.add_argument("--dir")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codec", default="none")
    ap.add_argument("--zstd-level", type=int, default=1)
    ap.add_argument("--t0", type=float, default=0.0)
    ap.add_argument("--sizes", default="1M,10M,25M")
    ap.add_argument("--groups", default="2,4")
    ap.add_argument("--codecs", default="none,fp16,int8")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    if args.worker == "gloo":
        return gloo_worker(args)
    if args.worker == "crowdtrain":
        return crowdtrain_worker(args)

    rows = []  # (N, P, system, s/round, wire bytes, × gloo, CPU s/round, CPU × gloo, crowdtrain figures)
    for size in args.sizes.split(","):
        n = SIZES[size]
        for world in map(int, args.groups.split(",")):
            gloo = run_gloo(n, world)
            rows.append((size, world, "gloo", gloo["s"], gloo["wire"], 1.0, gloo["cpu"], 1.0, None))
            print(
                f"{size:>4} P={world} gloo            {gloo['s'] * 1e3:9.1f} ms  cpu {gloo['cpu']:.3f} s",
                file=sys.stderr,
                flush=True,
            )
            for spec in args.codecs.split(","):
                codec, _, level = spec.partition("@")  # "none@-1": codec none with zstd level -1
                ct = run_crowdtrain(n, world, codec, int(level) if level else args.zstd_level)
                label = f"crowdtrain {codec}" + (f" zstd {level}" if level else "")
                ratio, cpu_ratio = ct["s"] / gloo["s"], ct["cpu"] / gloo["cpu"]
                rows.append((size, world, label, ct["s"], ct["wire"], ratio, ct["cpu"], cpu_ratio, ct))
                print(
                    f"{size:>4} P={world} {label:<22} {ct['s'] * 1e3:9.1f} ms  x{ratio:.2f}  cpu {ct['cpu']:.3f} s"
                    f"  x{cpu_ratio:.2f}  wire/fp32 {ct['wire'] / ct['raw']:.3f}  ready {ct['ready']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    if args.markdown:
        print(
            "| N | P | system | s/round (median) | wire MB/round | wire / fp32 | × gloo | CPU s/round "
            "| CPU × gloo | ready s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for size, world, label, s, wire, ratio, cpu, cpu_ratio, ct in rows:
            frac = f"{ct['wire'] / ct['raw']:.3f}" if ct else "1.000"
            ready = f"{ct['ready']:.2f}" if ct else ""
            print(
                f"| {size} | {world} | {label} | {s:.3f} | {wire / 1e6:.1f} | {frac} | {ratio:.2f} | {cpu:.3f} "
                f"| {cpu_ratio:.2f} | {ready} |"
            )
    else:
        print(
            f"{'N':>4} {'P':>2} {'system':<23} {'s/round':>9} {'wire MB':>9} {'wire/fp32':>9} {'x gloo':>7}"
            f" {'cpu s':>7} {'cpu x':>6}"
        )
        for size, world, label, s, wire, ratio, cpu, cpu_ratio, ct in rows:
            frac = ct["wire"] / ct["raw"] if ct else 1.0
            print(
                f"{size:>4} {world:>2} {label:<23} {s:9.3f} {wire / 1e6:9.1f} {frac:9.3f} {ratio:7.2f}"
                f" {cpu:7.3f} {cpu_ratio:6.2f}"
            )


if __name__ == "__main__":
    main()
