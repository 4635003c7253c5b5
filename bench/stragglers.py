"""Stragglers (issue 27): steps per minute with volunteers that stall, under the tracker's straggler rule and
without it (``TrackerConfig.straggler_intervals = 0``: a volunteer's allotment is waited for until it
expires), side by side in one run of this script.

One tracker, the built-in corpus and a seeder in this process; ``--volunteers`` ``crowdtrain join --json``
processes (tiny-gpt d_model 128 × 4 layers, seq_len 64, the issue's model; target ``--target``, micro-batch
``--micro``) on loopback. Stalls are made from outside,
with signals, as a user's machine makes them:
- ``none``: nobody stalls (the reference);
- ``frozen``: volunteer 1 is stopped (SIGSTOP) for ``--freeze`` seconds once the run is at step 3, as it begins
  computing its share of a step (so it owes samples), then woken;
- ``heavy-tail``: every volunteer, every ``--tick`` seconds, with probability ``--p``, is stopped for 9 ticks
  (a micro-batch that takes 10× as long: another program took the machine);
- ``slow``: volunteer 1 computes at a third of its speed (stopped two thirds of every 30 ms);
- ``slowed``: the issue's "each micro-batch slowed 10× with probability p": every volunteer, every ``--tick``
  seconds, with probability ``--p``, gets a tenth of its CPU for 9 ticks (a CPU quota on its cgroup: another
  program took the machine). Unlike ``heavy-tail`` it is not frozen: what it computes takes 10× as long,
  and it still answers, 10× slower. Needs a writable cgroup ``cpu`` controller (root; v1 or v2).

Each run lasts ``--seconds`` of wall time from the run's first step. Measured from the tracker's step history
and the volunteers' events: steps per minute (first to last step closed in the window), that ÷ the
``none`` run's under the same rule, the longest step of a volunteer that did not stall, samples
dropped (Σ ``StepMissed.dropped_samples``: work computed on parameters the run had left), and where the
volunteers' time went (the share of their summed time in each phase of theirs; their own stalls apart), and
how busy the machine's CPUs were over the window (``/proc/stat``: the volunteers share its cores, so a
volunteer stopped or waiting costs the run only where a core idles).

    .venv/bin/python bench/stragglers.py --markdown
    .venv/bin/python bench/stragglers.py --scenarios none,frozen --seconds 60
    .venv/bin/python bench/stragglers.py --paired --scenarios heavy-tail --seconds 60

``--paired`` (heavy-tail, slow, slowed) runs the stalls on and off in turns of ``--window`` seconds inside one
run, ``--seconds`` a side, the first 2 s of each turn left out: its "× none" is against the turns without
stalls of the same run, so the machine's drift falls on both sides alike.

``--oracle`` (heavy-tail; an instrument, not a rule) tells the tracker, which runs in this process, which
volunteer is stopped the moment it is stopped, as no rule can know: the rest of its share counts as
behind at once (spares open without the wait after the first peer done), and a close does not wait for
its ready call. What a run gains with it bounds what any rule that finds a sleeper sooner could gain:

    .venv/bin/python bench/stragglers.py --paired --seconds 60 --scenarios heavy-tail --rules on --oracle
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

# (run as a script, bench/ is on sys.path: the process plumbing is bench/utilization.py's)
from utilization import Proc, cores, published, start_volunteer, stop_all

SCENARIOS = ("none", "frozen", "heavy-tail", "slow", "slowed")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="none,frozen,heavy-tail")
    ap.add_argument("--rules", default="on,off", help="the straggler rule on (1.5 intervals) and/or off")
    ap.add_argument("--volunteers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0, help="wall time of each run from its first step")
    ap.add_argument("--freeze", type=float, default=20.0, help="seconds volunteer 1 is frozen (frozen)")
    ap.add_argument("--p", type=float, default=0.02, help="chance of a 10x stall per tick (heavy-tail)")
    ap.add_argument("--tick", type=float, default=0.2, help="seconds between stall draws (heavy-tail)")
    ap.add_argument("--target", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--delay", type=int, default=0, choices=(0, 1), help="[averaging] delay of the runs")
    ap.add_argument("--gather", type=float, default=1.0, help="[averaging] gather_s of the runs")
    ap.add_argument(
        "--paired",
        action="store_true",
        help="heavy-tail, slow, slowed: one run each, the stalls switched on and off in turns of --window s, "
        "against the turns without (--seconds a side): the machine's drift falls on both alike",
    )
    ap.add_argument("--window", type=float, default=20.0, help="seconds of a turn (--paired)")
    ap.add_argument(
        "--oracle",
        action="store_true",
        help="heavy-tail: the tracker is told who is stopped, the moment it is (the most finding a sleeper "
        "sooner could gain)",
    )
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the volunteers compute (cuda: one GPU shared)",
    )
    ap.add_argument(
        "--tracker-log", type=Path, help="a file: the tracker's debug log (closes, rounds, spares)"
    )
    ap.add_argument("--timeline", action="store_true", help="each stall: the phase it began in, what it cost")
    ap.add_argument(
        "--events",
        type=Path,
        help="with --timeline: a folder; each run's stalls and events go to <scenario>-<rule>.txt there",
    )
    args = ap.parse_args()
    args.scenarios = args.scenarios.split(",")
    args.rules = args.rules.split(",")
    args.threads = 1
    args.steps = 1 << 20  # (they are stopped at the end of the window)
    return args


async def stall(
    scenario: str,
    procs: list[Proc],
    at_step: asyncio.Event,
    args: argparse.Namespace,
    rng: random.Random | None = None,
) -> None:
    """Make ``scenario``'s stalls until cancelled (the volunteers that stall: STALLING)."""
    rng = rng or random.Random(27)

    def pid(p: Proc) -> int:
        assert p.proc is not None
        return p.proc.pid

    if scenario == "frozen":
        await at_step.wait()
        # at the start of its next step's compute: it owes its whole allotment then (its StepDone, then the
        # "training" phase; the events are appended by another task, which sets no event: look every 10 ms)
        seen = len(procs[0].events)
        while not _computing_a_new_step(procs[0].events[seen:]):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        os.kill(pid(procs[0]), signal.SIGSTOP)
        try:
            await asyncio.sleep(args.freeze)
        finally:
            os.kill(pid(procs[0]), signal.SIGCONT)
        await asyncio.Event().wait()
    elif scenario == "heavy-tail":
        while True:
            await asyncio.sleep(args.tick)
            for p in procs:
                if rng.random() < args.p:
                    told = ORACLE.peer_of(p) if args.oracle else None
                    asyncio.get_running_loop().create_task(_stop_for(pid(p), 9 * args.tick, told))
    elif scenario == "slowed":
        groups = [CpuGroup.of(pid(p), f"crowdtrain-bench-{p.name}") for p in procs]
        tenth = max(0.01, min(1.0, cores() / len(procs)) / 10)  # of a core: a tenth of its share here
        try:
            while True:
                await asyncio.sleep(args.tick)
                for p, g in zip(procs, groups, strict=True):
                    if rng.random() < args.p:
                        asyncio.get_running_loop().create_task(_slow_for(pid(p), g, tenth, 9 * args.tick))
        finally:
            for g in groups:
                g.limit(None)
    elif scenario == "slow":
        while True:
            os.kill(pid(procs[0]), signal.SIGSTOP)
            try:
                await asyncio.sleep(0.02)
            finally:
                os.kill(pid(procs[0]), signal.SIGCONT)
            await asyncio.sleep(0.01)
    await asyncio.Event().wait()


def _computing_a_new_step(events: list[Any]) -> bool:
    """A StepDone, then a change to the "training" phase: the volunteer began computing its next step."""
    done = next((i for i, e in enumerate(events) if type(e).__name__ == "StepDone"), None)
    return done is not None and any(
        type(e).__name__ == "PhaseChanged" and e.phase == "training" for e in events[done + 1 :]
    )


PAIRED = ("heavy-tail", "slow", "slowed")  # (frozen is one event, not a rate: it is not paired)


async def alternate(
    scenario: str, procs: list[Proc], at_step: asyncio.Event, args: argparse.Namespace, turns: list[Turn]
) -> None:
    """--paired: ``scenario``'s stalls off and on in turns of ``--window`` seconds (off first) until
    cancelled, each turn noted in ``turns``."""
    rng, on = random.Random(27), False
    while True:
        turn = Turn(on, time.time(), cpu_times())
        staller = asyncio.create_task(stall(scenario, procs, at_step, args, rng)) if on else None
        try:
            await asyncio.sleep(args.window)
        finally:
            if staller is not None:
                staller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await staller
            turn.end, turn.cpu_end = time.time(), cpu_times()
            turns.append(turn)
        on = not on


class Turn:
    """One turn of a --paired run: stalls on or off from ``start`` to ``end`` (wall clock)."""

    # a turn's first seconds are left out: stalls of the turn before may still run (a stall is 9 ticks)
    SETTLE_S = 2.0

    def __init__(self, on: bool, start: float, cpu: tuple[int, int]) -> None:
        self.on, self.start, self.cpu = on, start, cpu
        self.end, self.cpu_end = start, cpu

    def counts(self, closed: list[float]) -> tuple[int, float]:
        """Steps closed in the turn after its settling, and those seconds."""
        a = self.start + self.SETTLE_S
        return sum(1 for t in closed if a <= t < self.end), max(0.0, self.end - a)


def paired_side(turns: list[Turn], closed: list[float], on: bool) -> tuple[float, float]:
    """Steps per minute and CPU busy share over the turns with the stalls ``on`` (or off)."""
    mine = [t for t in turns if t.on == on]
    counted = [t.counts(closed) for t in mine]
    steps, seconds = sum(n for n, _ in counted), sum(s for _, s in counted)
    before = (sum(t.cpu[0] for t in mine), sum(t.cpu[1] for t in mine))
    after = (sum(t.cpu_end[0] for t in mine), sum(t.cpu_end[1] for t in mine))
    return (60.0 * steps / seconds if seconds else float("nan"), cpu_busy(before, after))


STALLS: list[tuple[int, float, float]] = []  # (pid, wall start, wall end) of each stall made (--timeline)


async def _stop_for(pid: int, seconds: float, told: str | None = None) -> None:
    """Stop ``pid`` for ``seconds`` (``told``: its peer id, which the oracle then knows asleep)."""
    STALLS.append((pid, time.time(), time.time() + seconds))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
        ORACLE.stopped(told, 1)
        try:
            await asyncio.sleep(seconds)
        finally:
            ORACLE.stopped(told, -1)
            os.kill(pid, signal.SIGCONT)


class Oracle:
    """``--oracle``: the tracker in this process knows which volunteers are stopped (``asleep``). Installed
    around the tracker's own functions, its code unchanged: a peer asleep is past its time at once
    (``policy._due``), spares open without the first peer done waiting while one asleep owes samples
    (``Spares.open`` with the waits at 0 for that call), and a close does not wait for its ready call
    (``collab.answer_wait``)."""

    def __init__(self) -> None:
        self.asleep: set[str] = set()
        self._stops: dict[str, int] = {}  # (stalls of one volunteer may overlap)
        self._installed = False

    def stopped(self, peer_id: str | None, change: int) -> None:
        if peer_id is None:
            return
        self._stops[peer_id] = self._stops.get(peer_id, 0) + change
        if self._stops[peer_id] > 0:
            self.asleep.add(peer_id)
        else:
            self.asleep.discard(peer_id)

    @staticmethod
    def peer_of(p: Proc) -> str | None:
        joined = [e.peer_id for e in p.events if type(e).__name__ == "Joined"]
        return joined[-1] if joined else None

    def install(self) -> None:
        from crowdtrain.tracker import collab, policy

        if self._installed:
            return
        self._installed = True
        asleep, due, open_spares, answer_wait = (
            self.asleep,
            policy._due,
            policy.Spares.open,
            collab.answer_wait,
        )

        def told_due(share: Any) -> float:
            return -math.inf if share.peer_id in asleep else due(share)

        def told_open(spares: Any, at_step: list, *rest: Any) -> int:
            if not any(s.peer_id in asleep and s.allotted > s.samples for s in at_step):
                return open_spares(spares, at_step, *rest)
            kept = policy.POLICY
            policy.POLICY = dataclasses.replace(kept, spare_wait_s=0.0, spare_fraction=0.0)
            try:
                return open_spares(spares, at_step, *rest)
            finally:
                policy.POLICY = kept

        def told_wait(peer: Any, *rest: Any, **kw: Any) -> float:
            return 0.0 if peer.peer_id in asleep else answer_wait(peer, *rest, **kw)

        policy._due, policy.Spares.open, collab.answer_wait = told_due, told_open, told_wait


ORACLE = Oracle()


async def _slow_for(pid: int, group: CpuGroup, cores_: float, seconds: float) -> None:
    STALLS.append((pid, time.time(), time.time() + seconds))
    group.limit(cores_)
    try:
        await asyncio.sleep(seconds)
    finally:
        group.limit(None)


class CpuGroup:
    """A cgroup of its own for one process, whose CPU quota the bench sets (cgroup v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us``), with a 20 ms period so that a slowed process is slowed evenly, not in bursts."""

    PERIOD_US = 20_000
    made: ClassVar[list[Path]] = []  # (removed by :meth:`remove_all` once their processes are gone)

    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    @classmethod
    def of(cls, pid: int, name: str) -> CpuGroup:
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        root = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/cpu")
        path = root / f"{name}-{pid}"
        try:
            path.mkdir(exist_ok=True)
            (path / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            raise SystemExit(f"the slowed scenario needs a writable cgroup cpu controller ({exc})") from None
        cls.made.append(path)
        group = cls(path, v2)
        group.limit(None)
        return group

    @classmethod
    def remove_all(cls) -> None:
        for path in cls.made:
            with contextlib.suppress(OSError):
                path.rmdir()
        cls.made.clear()

    def limit(self, cores: float | None) -> None:
        """At most ``cores`` of CPU time (None: no limit)."""
        quota = -1 if cores is None else max(1000, int(cores * self.PERIOD_US))
        with contextlib.suppress(OSError):  # (the process may be gone)
            if self.v2:
                (self.path / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {self.PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))


STALLING: dict[str, set[str]] = {
    "none": set(),
    "frozen": {"v1"},
    "heavy-tail": {"v1", "v2", "v3", "v4"},
    "slow": {"v1"},
    "slowed": {"v1", "v2", "v3", "v4"},
}


async def one_run(scenario: str, rule: str, args: argparse.Namespace, workdir: Path) -> dict:
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.volunteer import events as ev

    workdir = workdir / f"{scenario}-{rule}"
    margs = {"d_model": 128, "n_layer": 4, "n_head": 4, "seq_len": 64}
    averaging = {
        "group_size": 4,
        "codec": "int8",
        "gather_s": args.gather,
        "step_timeout_s": 120.0,
        "delay": args.delay,
    }
    tracker = {"straggler_intervals": 1.5 if rule == "on" else 0.0, "peer_ttl_s": 60.0}
    procs = [Proc(f"v{i + 1}") for i in range(args.volunteers)]
    records: dict[int, Any] = {}
    paired = args.paired and scenario in PAIRED
    seconds = 2 * args.seconds if paired else args.seconds
    turns: list[Turn] = []
    async with published(workdir, f"stragglers {scenario} {rule}", margs, args, averaging, **tracker) as (
        t,
        spec,
    ):
        at_step = asyncio.Event()
        for p in procs:
            await start_volunteer(p, t.url, spec.run_id, workdir, args)
        staller: asyncio.Task | None = None
        try:
            async with TrackerClient(t.url) as c:
                started, cpu, busy = None, (0, 0), float("nan")
                while True:
                    status = await c.status(spec.run_id)
                    for r in status.recent_steps:
                        records[r.step] = r
                    if started is None and status.global_step >= 1:
                        started, cpu = time.monotonic(), cpu_times()
                        staller = asyncio.create_task(
                            alternate(scenario, procs, at_step, args, turns)
                            if paired
                            else stall(scenario, procs, at_step, args)
                        )
                    if status.global_step >= 3:
                        at_step.set()
                    if started is not None and time.monotonic() - started >= seconds:
                        busy = cpu_busy(cpu, cpu_times())
                        break
                    await asyncio.sleep(0.5)
        finally:
            if staller is not None:
                staller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await staller
            for p in procs:  # (a stopped one must be running to leave)
                if p.proc is not None and p.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.proc.pid, signal.SIGCONT)
            await stop_all(procs)
            CpuGroup.remove_all()
    if args.timeline:
        timeline(procs, None if args.events is None else args.events / f"{scenario}-{rule}.txt", turns)
    closed = sorted(records.values(), key=lambda r: r.step)
    window = [r for r in closed if r.step >= 1]
    span = window[-1].closed_at - window[0].closed_at if len(window) > 1 else float("nan")
    phases = phase_shares(procs, window[0].closed_at, window[-1].closed_at) if len(window) > 1 else {}
    STALLS.clear()
    steady = [p for p in procs if p.name not in STALLING[scenario]] or procs
    # a step's wall time for a volunteer: from its StepDone of the step before to its StepDone of this one
    gaps = [
        [b.t - a.t for a, b in itertools.pairwise([e for e in p.events if isinstance(e, ev.StepDone)])]
        for p in steady
    ]
    longest = max((g for each in gaps for g in each), default=float("nan"))
    medians = [statistics.median(each) for each in gaps if each]
    dropped = sum(e.dropped_samples for p in procs for e in p.events if isinstance(e, ev.StepMissed))
    row = {
        "scenario": scenario,
        "rule": rule,
        "steps": len(window),
        "steps/min": 60.0 * (len(window) - 1) / span if span == span and span > 0 else float("nan"),
        "longest": longest,
        "median": statistics.median(medians) if medians else float("nan"),
        "dropped": dropped,
        "phases": phases,
        "cpu": busy,
    }
    if paired:  # the turns with stalls against those without, in the same run
        times = [r.closed_at for r in window]
        (rate, busy), (none_rate, none_busy) = (
            paired_side(turns, times, True),
            paired_side(turns, times, False),
        )
        print(
            f"    paired: turns without stalls {none_rate:.1f} steps/min (CPU busy {none_busy:.0%})",
            flush=True,
        )
        row.update(scenario=f"{scenario} (paired)", phases={}, cpu=busy, none=none_rate)
        row["steps/min"] = rate
    return row


def cpu_times() -> tuple[int, int]:
    """The machine's (busy, total) CPU time so far, in ticks (``/proc/stat``; (0, 0) where there is none)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the machine's CPU time that was busy between two :func:`cpu_times`."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else float("nan")


def phase_shares(procs: list[Proc], start: float, end: float) -> dict[str, float]:
    """Where the volunteers' time went between ``start`` and ``end`` (wall clock): the share of the sum of
    their times spent in each phase of theirs (``PhaseChanged``), a volunteer's own stalls as "stalled"."""
    from crowdtrain.volunteer import events as ev

    spent: dict[str, float] = {}

    def add(what: str, a: float, b: float) -> None:
        a, b = max(a, start), min(b, end)
        if b > a:
            spent[what] = spent.get(what, 0.0) + b - a

    for p in procs:
        if p.proc is None:
            continue
        stalls = sorted((a, b) for pid, a, b in STALLS if pid == p.proc.pid)
        changes = [e for e in p.events if isinstance(e, ev.PhaseChanged)]
        for here, after in itertools.pairwise([*changes, None]):
            a, b = here.t, end if after is None else after.t
            for sa, sb in stalls:  # the stalled part of [a, b) is the stall's, not the phase's
                if sb <= a or sa >= b:
                    continue
                add(here.phase, a, sa)
                add("stalled", max(a, sa), min(b, sb))
                a = min(b, sb)
            add(here.phase, a, b)
    total = sum(spent.values()) or 1.0
    return {k: v / total for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}


def timeline(procs: list[Proc], events: Path | None, turns: list[Turn]) -> None:
    """Each stall (heavy-tail): the stalled volunteer's phase as it began, and the longest step another
    volunteer finished during it or within a second after; then that step's mean per phase."""
    from crowdtrain.volunteer import events as ev

    by_pid = {p.proc.pid: p for p in procs if p.proc is not None}
    if events is not None:
        events.parent.mkdir(parents=True, exist_ok=True)
        with events.open("w") as f:
            for pid, start, end in STALLS:
                f.write(f"{start:.3f} STALL {by_pid[pid].name} until {end:.3f}\n")
            for turn in turns:  # (--paired)
                f.write(f"{turn.start:.3f} TURN {'on' if turn.on else 'off'} until {turn.end:.3f}\n")
            for p in procs:
                for e in p.events:
                    fields = {k: getattr(e, k) for k in getattr(e, "__slots__", ()) if k != "t"}
                    f.write(f"{e.t:.3f} {p.name} {type(e).__name__} {str(fields)[:1500]}\n")
    cost: dict[str, list[float]] = {}
    for pid, start, end in STALLS:
        me = by_pid[pid]
        phases = [e for e in me.events if isinstance(e, ev.PhaseChanged) and e.t <= start]
        phase = phases[-1].phase if phases else "?"
        steps = [
            b.t - a.t
            for p in procs
            if p is not me
            for a, b in itertools.pairwise([e for e in p.events if isinstance(e, ev.StepDone)])
            if b.t > start and a.t < end + 1.0
        ]
        longest = max(steps, default=float("nan"))
        cost.setdefault(phase, []).append(longest)
        print(
            f"  stall {me.name} {start % 1000:8.2f}-{end % 1000:8.2f} in {phase:18s} longest step {longest:.2f}"
        )
    for phase, c in sorted(cost.items()):
        print(
            f"  {phase:18s} {len(c):3d} stalls, longest step of the others: mean {statistics.fmean(c):.2f} s"
        )


HEADER = ("scenario", "straggler rule", "steps", "steps/min", "× none", "median step s", "longest step s",
          "samples dropped", "CPU busy")  # fmt: skip


def cells(row: dict, base: dict | None) -> list[str]:
    none = row.get("none") or (base["steps/min"] if base else float("nan"))  # (--paired: its own turns)
    ratio = row["steps/min"] / none
    return [
        row["scenario"],
        row["rule"],
        str(row["steps"]),
        f"{row['steps/min']:.1f}",
        f"{ratio:.2f}",
        f"{row['median']:.2f}",
        f"{row['longest']:.1f}",
        str(row["dropped"]),
        f"{row['cpu']:.0%}",
    ]


async def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.oracle:
        ORACLE.install()
    if args.tracker_log:
        Path(args.tracker_log).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(args.tracker_log)
        handler.setFormatter(logging.Formatter("%(created).3f %(message)s"))
        logging.getLogger("crowdtrain.tracker").setLevel(logging.DEBUG)
        logging.getLogger("crowdtrain.tracker").addHandler(handler)
        logging.getLogger("crowdtrain.tracker").propagate = False  # (the file only, not stderr)
    print(
        f"machine: {cores()} cores (shared); {args.volunteers} volunteers, tiny-gpt 128 × 4, target {args.target}, "
        f"micro {args.micro}, device {args.device}; {args.seconds:.0f} s a run",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="crowdtrain-stragglers-") as tmp:
        for rule in args.rules:
            for scenario in args.scenarios:
                row = await one_run(scenario, rule, args, Path(tmp))
                rows.append(row)
                base = next((r for r in rows if r["scenario"] == "none" and r["rule"] == rule), None)
                print(
                    "  ".join(f"{h} {c}" for h, c in zip(HEADER, cells(row, base), strict=True)), flush=True
                )
                print("    time: " + ", ".join(f"{k} {v:.0%}" for k, v in row["phases"].items()), flush=True)
    if args.markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "---|" * len(HEADER))
        for row in rows:
            base = next((r for r in rows if r["scenario"] == "none" and r["rule"] == row["rule"]), None)
            print("| " + " | ".join(cells(row, base)) + " |")
        names = sorted(
            {k for row in rows for k in row["phases"]},
            key=lambda k: -max(r["phases"].get(k, 0) for r in rows),
        )
        print("\n| scenario | straggler rule | " + " | ".join(names) + " |")
        print("|" + "---|" * (len(names) + 2))
        for row in rows:
            shares = [f"{row['phases'].get(k, 0.0):.0%}" for k in names]
            print(f"| {row['scenario']} | {row['rule']} | " + " | ".join(shares) + " |")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
