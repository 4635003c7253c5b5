"""Utilization: the share of each volunteer's wall time spent computing gradients, with the run's
``averaging.delay`` 0 and 1, for a model whose compute per step is several times its all-reduce.

One tracker and one libtorrent seeder live in this process; the volunteers are ``crowdtrain join --json``
processes (each with its own interpreter, event loop and torch threads, as users run them), all on
loopback. Everything is measured from outside, from their events (JSON lines) and the tracker's step
history; the same run (data set, model, target batch, steps, codec) is repeated for each delay.

    .venv/bin/python bench/utilization.py                                  # ~10M parameters, 2 runs
    .venv/bin/python bench/utilization.py --d-model 128 --layers 4 --steps 6       # a quick look
    .venv/bin/python bench/utilization.py --d-model 768 --layers 12 --threads 4 --target 64 --markdown

Definitions. The steady-state window runs from the close of step 1 to the close of the last step (the
tracker's ``closed_at``): it holds the compute of steps 2 to the last (the first two steps, with their joins
and first chunks, are skipped), with either delay.
- compute share (engine): the last ``StepDone.compute_share`` a volunteer reported: seconds computing
  gradients that entered an average ÷ wall time since its first micro-batch (start-up included);
- compute share (outside): Σ ``StepDone.compute_s`` of the window's steps ÷ the window's wall time;
- steps/min: the window's steps ÷ its wall time;
- phases: the share of the window each volunteer spent in each ``PhaseChanged`` phase, averaged;
- all-reduce s/step: Σ ``RoundDone.duration_s`` of a step's gradient rounds (one per phase of the grid),
  averaged over the window's steps and the volunteers; compute s/step likewise from ``StepDone.compute_s``.
  With delay 1 the two overlap, so they compete for the same cores;
- batch/target: the samples the tracker credited to a step ÷ the target, over all steps.
BENCH_DEBUG=1 also prints each step's close and each volunteer's samples, compute and rounds (stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crowdtrain.commands.demo import stop_all  # SIGINT, then SIGKILL after a grace
from crowdtrain.procs import Child, child_env, json_events

KiB = 1 << 10
SKIP = 2  # steps left out of the steady-state window
PHASES = (
    "training",
    "waiting-for-step",
    "waiting-for-group",
    "averaging",
    "stepping",
    "catching-up",
    "downloading",
)


@dataclass
class Proc:
    name: str
    child: Child | None = None
    events: list[Any] = field(default_factory=list)
    bad_lines: list[str] = field(default_factory=list)  # stdout lines that are no event

    @property
    def proc(self) -> asyncio.subprocess.Process | None:
        return None if self.child is None else self.child.proc


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def model_args(args: argparse.Namespace) -> dict[str, int]:
    heads = args.heads or max(1, args.d_model // 64)
    return {"d_model": args.d_model, "n_layer": args.layers, "n_head": heads, "seq_len": args.seq_len}


def param_count(margs: dict[str, int]) -> int:
    from crowdtrain.volunteer.models import get_recipe

    model = get_recipe("tiny-gpt").build(margs)
    return sum(p.numel() for p in model.parameters())


async def start_volunteer(p: Proc, url: str, run_id: str, workdir: Path, args: argparse.Namespace) -> None:
    """``crowdtrain join --json`` in a session of its own (Ctrl-C reaches the bench only; it stops the
    volunteers itself): its events go to ``p.events``, the last lines of its stderr stay in ``p.child``."""
    threads = str(args.threads)
    p.child = await Child.start(
        ["join", run_id, "--tracker", url, "--host", "127.0.0.1", "--json", "--data-dir", str(workdir / p.name),
         "--max-steps", str(args.steps), "--device", args.device],
        name=p.name,
        on_line=json_events(p.events.append, skipped=p.bad_lines.append),
        env=child_env(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads),
    )  # fmt: skip


@contextlib.asynccontextmanager
async def published(
    workdir: Path, name: str, margs: dict[str, int], args: argparse.Namespace, averaging: dict, **tracker: Any
):
    """A tracker in this process (``TrackerConfig`` fields ``tracker``), the built-in corpus cut and seeded, and
    a run of tiny-gpt ``margs`` on it (AdamW at 1e-3, constant rate, ``args.target`` / ``args.micro``,
    ``averaging``): yields (tracker, spec)."""
    from crowdtrain.datasets.make import make_dataset
    from crowdtrain.datasets.session import SessionConfig, TorrentSession
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.publisher import build_run_create
    from crowdtrain.tracker.config import TrackerConfig
    from crowdtrain.tracker.server import serve

    async with serve(TrackerConfig(**{"db": ":memory:", **tracker})) as tracker:
        data = workdir / "data"
        manifest = await asyncio.to_thread(
            make_dataset, "builtin:stdlib", data, chunk_bytes=64 * KiB, name=name.split()[0],
            announce_url=tracker.announce_url, max_bytes=1024 * KiB,
        )  # fmt: skip
        create = await asyncio.to_thread(
            build_run_create, data, name=name, model={"recipe": "tiny-gpt", "args": margs},
            target_batch_size=args.target, micro_batch_size=args.micro,
            optimizer={"name": "adamw", "lr": 1e-3},
            schedule={"kind": "constant", "warmup_steps": 0, "total_steps": 1000},
            averaging=averaging,
        )  # fmt: skip
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
            spec = (await client.create_run(create)).spec
        async with TorrentSession(SessionConfig(listen="127.0.0.1:0")) as seeder:
            await seeder.seed(data, (data / f"{manifest.name}.torrent").read_bytes(), manifest=manifest)
            yield tracker, spec


async def one_run(delay: int, args: argparse.Namespace, margs: dict[str, int], workdir: Path) -> dict:
    from crowdtrain.protocol.client import TrackerClient

    workdir = workdir / f"delay-{delay}"
    records: dict[int, Any] = {}
    procs = [Proc(f"v{i + 1}") for i in range(args.volunteers)]
    averaging = {
        "group_size": args.group_size, "codec": args.codec, "delay": delay,
        "average_state_every": args.average_state_every,
    }  # fmt: skip
    async with published(workdir, f"utilization delay {delay}", margs, args, averaging) as (tracker, spec):

        async def watch_history() -> None:
            async with TrackerClient(tracker.url) as c:
                while True:  # the tracker keeps the last 10 steps: read them often
                    for r in (await c.status(spec.run_id)).recent_steps:
                        records[r.step] = r
                    await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch_history())
        try:
            for p in procs:
                await start_volunteer(p, tracker.url, spec.run_id, workdir, args)
            try:
                async with asyncio.timeout(args.timeout):
                    await asyncio.gather(*(p.child.wait() for p in procs))
            except TimeoutError:
                raise SystemExit(
                    f"delay {delay}: the volunteers did not finish {args.steps} steps within "
                    f"{args.timeout:.0f} s (--timeout); last steps closed: {sorted(records)[-3:]}\n"
                    + tails(procs)
                ) from None
        finally:
            await stop_all(procs)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        async with TrackerClient(tracker.url) as c:
            for r in (await c.status(spec.run_id)).recent_steps:
                records[r.step] = r
    failed = [p for p in procs if p.proc.returncode != 0]
    if failed:
        raise SystemExit(f"delay {delay}: {len(failed)} volunteer(s) exited with an error\n" + tails(failed))
    return measure(delay, procs, records, args)


def tails(procs: list[Proc]) -> str:
    out = []
    for p in procs:
        code = None if p.proc is None else p.proc.returncode
        out.append(f"--- {p.name} (exit {code}), last stderr lines:")
        out += [f"  {line}" for line in ([] if p.child is None else p.child.tail(12))]
    return "\n".join(out)


def phase_shares(events: list[Any], t0: float, t1: float) -> dict[str, float]:
    """Seconds in each phase within [t0, t1] ÷ (t1 - t0), from the PhaseChanged events."""
    from crowdtrain.volunteer import events as ev

    spent: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    changes = [(e.t, e.phase) for e in events if isinstance(e, ev.PhaseChanged)]
    for (t, phase), nxt in zip(changes, [*changes[1:], (t1, "")], strict=True):
        lo, hi = max(t, t0), min(nxt[0], t1)
        if hi > lo:
            spent[phase] = spent.get(phase, 0.0) + hi - lo
    return {k: v / (t1 - t0) for k, v in spent.items()}


def debug(procs: list[Proc], closed: dict[int, Any], t0: float) -> None:
    """Per step: what the tracker credited and when it closed; per volunteer: samples, compute, rounds."""
    from crowdtrain.volunteer import events as ev

    for s, r in sorted(closed.items()):
        print(
            f"step {s}: closed at {r.closed_at - t0:+.2f} s, {r.samples} samples, open {r.duration_s:.2f} s",
            file=sys.stderr,
        )
    for p in procs:
        done = [
            f"{e.step}:{e.contributed_samples}/{e.compute_s:.2f}s@{e.t - t0:+.2f}"
            for e in p.events
            if isinstance(e, ev.StepDone)
        ]
        rounds = [f"{e.step}:{e.duration_s:.2f}s" for e in p.events if isinstance(e, ev.RoundDone)]
        print(f"{p.name} steps (samples/compute@t): {' '.join(done)}", file=sys.stderr)
        print(f"{p.name} rounds: {' '.join(rounds)}", file=sys.stderr)


def measure(delay: int, procs: list[Proc], records: dict[int, Any], args: argparse.Namespace) -> dict:
    from crowdtrain.volunteer import events as ev

    closed = {s: r for s, r in records.items() if s < args.steps}
    last = max(closed)
    if SKIP - 1 not in closed or last <= SKIP:
        raise SystemExit(f"delay {delay}: steps closed {sorted(closed)}; need steps 1..{SKIP + 1} at least")
    t0, t1 = closed[SKIP - 1].closed_at, closed[last].closed_at
    window = range(SKIP, last + 1)
    engine_share, outside_share, compute, allreduce, missed, devices = [], [], [], [], 0, set()
    notes: list[str] = []
    phases: dict[str, list[float]] = {k: [] for k in PHASES}
    for p in procs:
        done = {e.step: e for e in p.events if isinstance(e, ev.StepDone)}
        shares = [e.compute_share for e in p.events if isinstance(e, ev.StepDone)]
        engine_share.append(shares[-1] if shares else None)
        outside_share.append(sum(done[s].compute_s for s in window if s in done) / (t1 - t0))
        compute += [done[s].compute_s for s in window if s in done]
        rounds: dict[int, float] = {}
        for e in p.events:
            if isinstance(e, ev.RoundDone) and e.kind == "grad" and e.step in window:
                rounds[e.step] = rounds.get(e.step, 0.0) + e.duration_s
        allreduce += rounds.values()
        missed += sum(isinstance(e, ev.StepMissed) for e in p.events)
        devices |= {e.device for e in p.events if isinstance(e, ev.Joined)}
        notes += [
            f"{p.name}: {e.level} {e.message}"
            for e in p.events
            if isinstance(e, ev.LogLine) and e.level in ("WARNING", "ERROR", "CRITICAL")
        ]
        notes += [
            f"{p.name}: round of step {e.step} failed: {e.reason}"
            for e in p.events
            if isinstance(e, ev.RoundFailed)
        ]
        for k, v in phase_shares(p.events, t0, t1).items():
            phases.setdefault(k, []).append(v)
    if os.environ.get("BENCH_DEBUG"):
        debug(procs, closed, t0)
    known = [s for s in engine_share if s is not None]
    ratios = [closed[s].samples / args.target for s in sorted(closed)]
    compute_s = statistics.fmean(compute) if compute else float("nan")
    allreduce_s = statistics.fmean(allreduce) if allreduce else float("nan")
    return {
        "delay": delay,
        "device": ",".join(sorted(devices)),
        "steps": len(closed),
        "steps/min": 60 * len(window) / (t1 - t0),
        "engine share": engine_share,
        "engine share mean": statistics.fmean(known) if known else None,
        "outside share": outside_share,
        "outside share mean": statistics.fmean(outside_share),
        "compute s/step": compute_s,
        "all-reduce s/step": allreduce_s,
        "compute/all-reduce": compute_s / allreduce_s if allreduce_s else float("nan"),
        "phases": {k: statistics.fmean(v) for k, v in phases.items() if v},
        "batch/target": (statistics.median(ratios), min(ratios), max(ratios)),
        "missed": missed,
        "bad lines": sum(len(p.bad_lines) for p in procs),
        "notes": notes,
    }


def pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


def report(row: dict) -> str:
    med, lo, hi = row["batch/target"]
    names = [f"v{i + 1}" for i in range(len(row["outside share"]))]
    lines = [
        f"delay {row['delay']} ({row['device']}): {row['steps']} steps, {row['steps/min']:.2f} steps/min "
        f"(steady state), batch/target median {med:.2f} (min {lo:.2f}, max {hi:.2f}), "
        f"missed {row['missed']}",
        "  compute share, engine   mean " + pct(row["engine share mean"]) + ": "
        + ", ".join(f"{n} {pct(s)}" for n, s in zip(names, row["engine share"], strict=True)),
        "  compute share, outside  mean " + pct(row["outside share mean"]) + ": "
        + ", ".join(f"{n} {pct(s)}" for n, s in zip(names, row["outside share"], strict=True)),
        f"  compute {row['compute s/step']:.3f} s/step, all-reduce {row['all-reduce s/step']:.3f} s/step: "
        f"compute/all-reduce {row['compute/all-reduce']:.1f}×"
        + ("" if row["compute/all-reduce"] >= 3 else "  (below 3×: use a larger model or batch)"),
        "  phases  " + ", ".join(f"{k} {pct(v)}" for k, v in row["phases"].items()),
    ]  # fmt: skip
    if row["notes"]:
        lines.append(f"  {len(row['notes'])} warnings from the volunteers, e.g.:")
        lines += [f"    {n}" for n in row["notes"][:5]]
    if row["bad lines"]:
        lines.append(f"  ({row['bad lines']} unreadable event lines)")
    return "\n".join(lines)


MD_KEYS = ("delay", "steps/min", "engine share", "outside share", "compute s", "all-reduce s", "ratio",
           "batch/target", *PHASES)  # fmt: skip


def markdown_row(row: dict) -> str:
    cells = [
        str(row["delay"]),
        f"{row['steps/min']:.2f}",
        pct(row["engine share mean"]),
        pct(row["outside share mean"]),
        f"{row['compute s/step']:.3f}",
        f"{row['all-reduce s/step']:.3f}",
        f"{row['compute/all-reduce']:.1f}×",
        f"{row['batch/target'][0]:.2f}",
        *(pct(row["phases"].get(k, 0.0)) for k in PHASES),
    ]
    return "| " + " | ".join(cells) + " |"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--volunteers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=320)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=0, help="attention heads; default d_model / 64")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help=f"global steps per run (the first {SKIP} skipped)")
    ap.add_argument("--target", type=int, default=32, help="target batch size (samples per global step)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch size")
    ap.add_argument("--codec", default="int8", choices=("none", "fp16", "bf16", "int8", "int2", "sparse"))
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--average-state-every", type=int, default=0, help="parameter averaging; 0: never")
    ap.add_argument("--delays", default="0,1", help="comma-separated averaging.delay values, one run each")
    ap.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads per volunteer; default cores / N")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table, a row per run")
    args = ap.parse_args()
    if args.steps < SKIP + 2:
        ap.error(f"--steps must be at least {SKIP + 2}: the first {SKIP} steps are left out")
    args.threads = args.threads or max(1, cores() // args.volunteers)
    logging.basicConfig(level=logging.ERROR)
    import torch

    margs = model_args(args)
    n_params = await asyncio.to_thread(param_count, margs)
    print(
        f"machine: {cores()} cores, torch {torch.__version__}, {args.threads} torch thread(s) per volunteer, "
        f"device {args.device}; model tiny-gpt {margs}: {n_params / 1e6:.2f} M parameters; "
        f"{args.volunteers} volunteers, target {args.target}, micro {args.micro}, codec {args.codec}, "
        f"{args.steps} steps",
        flush=True,
    )
    if args.device != "cuda" and args.volunteers * args.threads > cores():
        print(
            f"note: {args.volunteers} volunteers × {args.threads} thread(s) on {cores()} cores: each volunteer's "
            "compute time includes time waiting for a core, so shares and compute/all-reduce are inflated",
            flush=True,
        )
    rows = []
    with tempfile.TemporaryDirectory(prefix="crowdtrain-utilization-") as tmp:
        for delay in (int(x) for x in args.delays.split(",")):
            row = await one_run(delay, args, margs, Path(tmp))
            rows.append(row)
            print(report(row), flush=True)
    if args.markdown:
        print("| " + " | ".join(MD_KEYS) + " |")
        print("|" + "---|" * len(MD_KEYS))
        for row in rows:
            print(markdown_row(row))


if __name__ == "__main__":
    asyncio.run(main())
