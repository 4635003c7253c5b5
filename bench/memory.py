"""Memory: peak resident memory per parameter of a volunteer stepping, a donor serving a newcomer, and the
newcomer catching up, beside the floor any trainer of the model has.

One tracker and one seeder live in this process; the volunteers are ``crowdtrain join --json`` processes
(see bench/utilization.py, whose process plumbing this reuses). Two volunteers step (each writes a state
snapshot in the background after its steps); once the run is ``--late-at`` steps in, a third joins and
catches up from them. Peaks are each process's ``VmHWM`` (/proc/PID/status), read:
- stepping: the two first volunteers, just before the newcomer joins;
- serving: the same two, after the newcomer loaded the state (their peak over the whole run);
- catching up: the newcomer, after it loaded the state and took a step.
Each process's resident memory is also sampled every 50 ms: the run ends with where each one's highest
sample came (after how many of its events, and which was the last), to tell what a peak belongs to.
The floor is a process that imports torch, builds the model and its trainer and takes one optimizer step:
weights, gradients and the AdamW moments (16 bytes per parameter) plus the interpreter and torch.

    .venv/bin/python bench/memory.py                                   # tiny-gpt d_model 768 × 12 (≈ 85M)
    .venv/bin/python bench/memory.py --d-model 256 --layers 4 --steps 6 --late-at 2   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (run as a script, bench/ is on sys.path: the plumbing is bench/utilization.py's)
from utilization import KiB, Proc, cores, model_args, param_count, published, start_volunteer, stop_all, tails

FLOOR = """
import json, sys, torch
from crowdtrain.protocol.messages import OptimizerSpec, ScheduleSpec
from crowdtrain.volunteer.models import get_recipe
from crowdtrain.volunteer.trainer import Trainer
args = json.loads(sys.argv[1])
r = get_recipe("tiny-gpt")
t = Trainer(r, r.build(args), OptimizerSpec(name="adamw", lr=1e-3), ScheduleSpec(kind="constant"))
x = torch.randint(0, 256, (int(sys.argv[2]), args["seq_len"]))
t.accumulate(x, x)
t.apply(t.take_grad(), 0)
print(open("/proc/self/status").read())
"""


def peak_bytes(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * KiB
    raise RuntimeError("no VmHWM in /proc/PID/status (Linux only)")


def peak_of(pid: int) -> int:
    return peak_bytes(Path(f"/proc/{pid}/status").read_text())


def report(what: str, peaks: list[int], procs: list[Proc]) -> None:
    """One line as soon as a figure is measured (a long run shows its progress), with each process's resident
    memory now split into anonymous and file-backed pages."""
    now = []
    for p in procs:
        fields = dict(
            line.split(":", 1)
            for line in Path(f"/proc/{p.proc.pid}/status").read_text().splitlines()
            if ":" in line
        )
        now.append(f"{p.name} anon {fields['RssAnon'].strip()}, file {fields['RssFile'].strip()}")
    print(
        f"{what}: peaks {', '.join(f'{v / 1e9:.2f} GB' for v in peaks)} (now: {'; '.join(now)})", flush=True
    )


async def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


def resident(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KiB
    return 0


async def watch(procs: list[Proc], highs: dict[str, tuple[int, str]]) -> None:
    """Where each process's peak came: its resident memory every 50 ms, with the last event it printed."""
    while True:
        for p in procs:
            if p.proc is not None and p.proc.returncode is None:
                with contextlib.suppress(OSError):
                    rss = resident(p.proc.pid)
                    if rss > highs.get(p.name, (0, ""))[0]:
                        last = type(p.events[-1]).__name__ if p.events else "-"
                        highs[p.name] = (rss, f"{rss / 1e9:.2f} GB after {len(p.events)} events, last {last}")
        await asyncio.sleep(0.05)


async def run(args: argparse.Namespace, margs: dict[str, int], workdir: Path) -> dict[str, list[int]]:
    from crowdtrain.volunteer import events as ev

    donors = [Proc("v1"), Proc("v2")]
    newcomer = Proc("late")
    peaks: dict[str, list[int]] = {}
    averaging = {"group_size": 4, "codec": args.codec, "average_state_every": 0, "round_timeout_s": 120.0}
    async with published(workdir, "memory", margs, args, averaging) as (tracker, spec):
        procs = [*donors, newcomer]
        highs: dict[str, tuple[int, str]] = {}
        watcher = asyncio.get_running_loop().create_task(watch(procs, highs))
        try:
            for p in donors:
                await start_volunteer(p, tracker.url, spec.run_id, workdir, args)

            def stepped(p: Proc, n: int) -> bool:
                return sum(isinstance(e, ev.StepDone) for e in p.events) >= n

            def served(p: Proc) -> bool:
                return any(isinstance(e, ev.StateServed) for e in p.events)

            await wait_for(
                lambda: all(stepped(p, args.late_at) and served(p) for p in donors),
                args.timeout, f"{args.late_at} steps and a snapshot",
            )  # fmt: skip
            peaks["stepping"] = [peak_of(p.proc.pid) for p in donors]
            report("stepping", peaks["stepping"], donors)
            await start_volunteer(newcomer, tracker.url, spec.run_id, workdir, args)
            loaded = lambda: any(isinstance(e, ev.StateLoaded) for e in newcomer.events)  # noqa: E731
            await wait_for(loaded, args.timeout, "the newcomer to load the state")
            took = sum(isinstance(e, ev.StepDone) for e in newcomer.events)
            await wait_for(lambda: stepped(newcomer, took + 1), args.timeout, "the newcomer's next step")
            peaks["serving"] = [peak_of(p.proc.pid) for p in donors]
            peaks["catching up"] = [peak_of(newcomer.proc.pid)]
            report("serving", peaks["serving"], donors)
            report("catching up", peaks["catching up"], [newcomer])
        except BaseException:
            print(tails(procs), file=sys.stderr)
            for p in procs:  # what was measured before it stopped (a timeout, Ctrl-C)
                if p.proc is not None and p.proc.returncode is None:
                    print(f"{p.name}: peak so far {peak_of(p.proc.pid) / 1e9:.2f} GB", file=sys.stderr)
            raise
        finally:
            watcher.cancel()
            for name, (_, where) in highs.items():
                print(f"{name}: peak seen {where}", flush=True)
            await stop_all(procs)
    return peaks


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=0, help="attention heads; default d_model / 64")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument(
        "--steps", type=int, default=1000, help="--max-steps of each volunteer (they are stopped)"
    )
    ap.add_argument(
        "--late-at", type=int, default=3, help="steps the two first volunteers take before the third joins"
    )
    ap.add_argument("--target", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--codec", default="int8", choices=("none", "fp16", "bf16", "int8", "int2", "sparse"))
    ap.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads per volunteer; default cores / 3")
    ap.add_argument("--timeout", type=float, default=1200.0)
    args = ap.parse_args()
    args.threads = args.threads or max(1, cores() // 3)
    logging.basicConfig(level=logging.ERROR)
    margs = model_args(args)
    n = await asyncio.to_thread(param_count, margs)
    floor = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", FLOOR, __import__("json").dumps(margs), str(args.micro)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    floor_peak = peak_bytes(floor.stdout)
    print(
        f"model tiny-gpt {margs}: {n / 1e6:.1f} M parameters; AdamW; codec {args.codec}; {cores()} cores, "
        f"{args.threads} torch thread(s) per volunteer; state {12 * n / 1e9:.2f} GB (weights + moments)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="crowdtrain-memory-") as tmp:
        peaks = await run(args, margs, Path(tmp))
    rows = [("floor: a trainer after one step", [floor_peak]), *peaks.items()]
    print(f"{'peak resident memory':34} {'GB':>7} {'bytes/param':>12}")
    for what, values in rows:
        worst = max(values)
        print(f"{what:34} {worst / 1e9:7.2f} {worst / n:12.1f}")
    print(
        f"above the floor, worst case: {max(max(v) for v in peaks.values()) / n - floor_peak / n:.1f} bytes/param"
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
