"""Churn soak (issue 47): volunteers that freeze, crash and leave for many minutes, as users' machines do.

``--volunteers`` ``crowdtrain join --json`` processes (tiny-gpt, groups of 4, codec int8, spot-checks at the
run's default rate) train on loopback with a tracker (``crowdtrain tracker serve``, its database in a file)
and a seeder, each a process of its own. Once every volunteer took a step the soak's clock starts; every
20–40 s (drawn from ``random.Random(--seed)``) one volunteer, never two at once, is

- frozen: SIGSTOP for 5–25 s, then SIGCONT (a laptop lid; longer than the tracker's peer TTL of 15 s, it
  comes back as a peer the tracker dropped);
- killed: SIGKILL, then started again 1–5 s later on the same data folder (a crash, a power cut);
- leaving: SIGINT (it tells the tracker it leaves), then joining again 2–8 s later on the same data folder.

The first three faults are one of each, in a drawn order. Measured over the soak's ``--minutes`` (the run's
steps as the tracker closed them, polled once a second, and the volunteers' ``StepDone`` for steps that
left the tracker's last 10 between two polls): steps per minute in each third and last ÷ first;
the longest time without a step; for each volunteer woken, restarted or rejoined, the seconds to its own
next ``StepDone``; the tracker's resident memory after the first step and at the end; tracebacks in any
process's output (stderr, the tracker's and seeder's merged output, ``LogLine`` messages) and volunteer
processes that ended with a code nobody asked for; honest spot-check mismatches (all volunteers are honest
here: every mismatch is a misfire), from the volunteers' ``LogLine`` verdicts and the tracker's credit
ledger; and each volunteer's "state catch-up failed" and "disagree" lines. Then PASS/FAIL per criterion; the
exit code is 0 when all pass.

    .venv/bin/python bench/churn.py                       # 12 minutes, 5 volunteers, seed 0
    .venv/bin/python bench/churn.py --minutes 3 --json-out /tmp/churn.json --logs /tmp/churn-logs

``--logs``: each process's events (but its progress reports) and last lines, to read a stall afterwards.

``tests/test_churn.py`` runs :func:`soak` for 1.75 minutes (seed 1: its first three faults, one of each kind,
fit) and asserts the criteria that are not speeds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # tests/faults.py: the volunteer, tracker and seeder processes

from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.volunteer import events as ev
from tests.faults import SeederProcess, TrackerProcess, VolunteerProcess
from tests.harness import TINY_GPT

# every child is on loopback: no router to ask for port mappings (tests/conftest.py sets the same)
os.environ.setdefault("CROWDTRAIN_PORT_MAPPING", "0")

GROUP_SIZE = 4
CODEC = "int8"
MICRO = 8
PER_VOLUNTEER = 16  # the run's target: this many samples per volunteer
EVERY_S = (20.0, 40.0)  # between the starts of two faults
FREEZE_S = (5.0, 25.0)
KILLED_S = (1.0, 5.0)  # from the kill's exit to the restart
AWAY_S = (2.0, 8.0)  # from the leave's exit to the rejoin
RECOVERY_S = 60.0  # a volunteer back must step within this
START_S = 150.0  # every volunteer takes a step within this of its start (it takes 10–30 s here)
KINDS = ("freeze", "kill", "leave")
AVERAGING = {
    "group_size": GROUP_SIZE,
    "codec": CODEC,
    # (tests/test_faults_volunteer_kill.py's: a member frozen or killed in a round is dropped at its deadline)
    "gather_s": 1.0,
    "round_timeout_s": 5.0,
    "step_timeout_s": 20.0,
}
TRACKER_OPTIONS = ("--heartbeat-interval", "0.5", "--peer-ttl", "15", "--join-rate", "0")
LEFT_CODES = (0, 130)  # a volunteer stopped with SIGINT: it left (130: interrupted)
SPOT = re.compile(r"spot-check of \S+ at step \d+: (\w+)")
TRACEBACK = "Traceback (most recent call last)"
KEPT_LINES = 2000  # of each process's stderr (the tracker's, the seeder's: all output), for --logs
QUIET = (ev.Progress, ev.TorrentStats, ev.LocalTraining)  # events left out of --logs
# lines that continue a traceback although they are not indented (chained exceptions, rich's box)
GOING_ON = ("Traceback", "During handling", "The above exception", "│", "╭", "╰", "+", "|")


class Tracebacks:
    """Every traceback seen in the processes' output: how many, and the first one's lines (and where)."""

    LINES = 30

    def __init__(self) -> None:
        self.count = 0
        self.first: list[str] = []
        self.first_in = ""
        self._open: dict[str, int] = {}  # source -> lines still taken into the first traceback (or -1)

    def feed(self, source: str, line: str) -> None:
        left = self._open.get(source)
        if left is not None:
            continuing = line.startswith((" ", "\t")) or not line or line.startswith(GOING_ON)
            if left > 0 and self.first_in == source:
                self.first.append(line)
                self._open[source] = left - 1
            if not continuing:  # the exception's own line ends it
                del self._open[source]
            return
        if TRACEBACK in line:
            self.count += 1
            self._open[source] = -1
            if not self.first:
                self.first_in, self.first = source, [line]
                self._open[source] = self.LINES

    def message(self, source: str, text: str) -> None:
        """A whole message (a ``LogLine``) that may hold a traceback."""
        if TRACEBACK in text:
            self.count += 1
            if not self.first:
                self.first_in, self.first = source, text.splitlines()[: self.LINES]


class Scanned(collections.deque):
    """A child's kept output lines (:class:`crowdtrain.procs.Child` keeps its last few) that also shows every
    line to a :class:`Tracebacks` as it comes."""

    def __init__(self, source: str, found: Tracebacks, kept: Iterable[str], maxlen: int | None) -> None:
        super().__init__(kept, maxlen)
        self.source, self.found = source, found

    def append(self, line: str) -> None:
        super().append(line)
        self.found.feed(self.source, line)


def scan(child: Any, source: str, found: Tracebacks) -> None:
    """Watch ``child``'s output from now on (and its lines kept so far) for tracebacks."""
    for line in child.lines:
        found.feed(source, line)
    child.lines = Scanned(source, found, child.lines, max(KEPT_LINES, child.lines.maxlen or 0))


def resident_bytes(pid: int) -> int:
    """VmRSS of ``pid`` (``/proc/PID/status``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def where(v: VolunteerProcess) -> str:
    """Where volunteer ``v`` is: its steps, its last phases and events, its last lines of stderr."""
    phases = [e.phase for e in v.of(ev.PhaseChanged)][-4:]
    last = [type(e).__name__ for e in v.events[-6:]]
    logs = [e.message for e in v.of(ev.LogLine)][-3:]
    return (
        f"{v.name}: {len(v.of(ev.StepDone))} steps, {len(v.events)} events, phases ...{phases}, "
        f"last events {last}, last log lines {logs}, {v.tail()}"
    )


@dataclass
class Fault:
    """One fault: ``kind`` done to volunteer ``name`` at ``at`` (unix s); it was woken, restarted or rejoined
    at ``back_at`` as ``proc`` (the same process for a freeze)."""

    kind: str  # "freeze", "kill", "leave", or "exited" (it ended on its own; restarted)
    name: str
    at: float
    held_s: float = 0.0  # frozen for, or from its exit to its restart
    back_at: float = 0.0
    proc: VolunteerProcess | None = None
    code: int | None = None  # the exit code of the process it ended (kill, leave, exited)

    def first_step(self) -> float | None:
        """Seconds from ``back_at`` to the volunteer's first own ``StepDone`` after it, or None."""
        steps = [] if self.proc is None else [e.t for e in self.proc.of(ev.StepDone) if e.t >= self.back_at]
        return min(steps) - self.back_at if steps else None


@dataclass
class Soak:
    workdir: Path
    volunteers: int
    seed: int
    minutes: float
    say: Callable[[str], None] = print
    logs_to: Path | None = None  # each process's events and last lines are written there at the end
    rng: random.Random = field(init=False)
    found: Tracebacks = field(default_factory=Tracebacks)
    current: dict[str, VolunteerProcess] = field(default_factory=dict)
    started: list[VolunteerProcess] = field(default_factory=list)  # every volunteer process, in order
    faults: list[Fault] = field(default_factory=list)
    exits: list[dict[str, Any]] = field(default_factory=list)  # every volunteer process's exit
    closed: dict[int, float] = field(default_factory=dict)  # step -> closed_at, as the tracker told
    notices: set[str] = field(default_factory=set)
    poll_failures: int = 0
    t0: float = 0.0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def clock(self) -> str:
        return f"{time.time() - self.t0:+7.1f} s" if self.t0 else "  start  "

    async def start(self, name: str, tracker: TrackerProcess, run_id: str) -> VolunteerProcess:
        v = await VolunteerProcess.start(
            name, run_id, tracker.url, self.workdir / name, extra=["--host", "127.0.0.1"]
        )
        scan(v.child, name, self.found)
        self.current[name] = v
        self.started.append(v)
        return v

    def ended(self, v: VolunteerProcess, expected: Iterable[int], why: str) -> int:
        code = v.proc.returncode
        assert code is not None
        self.exits.append({"volunteer": v.name, "code": code, "why": why, "expected": code in expected})
        return code

    async def poll(self, client: Any, run_id: str, stop: asyncio.Event) -> None:
        """The run's closed steps (the tracker's status holds its last 10) and its notice: once a second until
        ``stop``."""
        while not stop.is_set():
            try:
                status = await client.status(run_id)
            except CrowdtrainError:
                self.poll_failures += 1
            else:
                for record in status.recent_steps:
                    self.closed.setdefault(record.step, record.closed_at)
                if status.notice:
                    self.notices.add(status.notice)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def restart_the_exited(self, tracker: TrackerProcess, run_id: str) -> None:
        """A volunteer that ended without being asked: noted, and started again (it counts as a fault)."""
        for name, v in list(self.current.items()):
            if v.proc.returncode is None:
                continue
            await v.wait(10)
            code = self.ended(v, (), "ended on its own")
            self.say(f"{self.clock()}  {name} ended on its own (exit code {code}): {v.tail()}")
            fault = Fault("exited", name, time.time(), code=code)
            fault.proc = await self.start(name, tracker, run_id)
            fault.back_at = time.time()
            self.faults.append(fault)

    def pending(self, name: str) -> bool:
        """``name`` is back from a fault but has not stepped since (nor for RECOVERY_S)."""
        for f in self.faults:
            if f.name == name and f.first_step() is None and time.time() - f.back_at < RECOVERY_S:
                return True
        return False

    async def fault(self, kind: str, tracker: TrackerProcess, run_id: str) -> Fault | None:
        eligible = [n for n in sorted(self.current) if not self.pending(n)]
        if not eligible:
            return None
        name = self.rng.choice(eligible)
        v = self.current[name]
        f = Fault(kind, name, time.time())
        if kind == "freeze":
            f.held_s = self.rng.uniform(*FREEZE_S)
            self.say(f"{self.clock()}  freeze {name} for {f.held_s:.1f} s")
            os.kill(v.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(f.held_s)
            finally:
                os.kill(v.proc.pid, signal.SIGCONT)
            f.proc = v
        else:
            f.held_s = self.rng.uniform(*(KILLED_S if kind == "kill" else AWAY_S))
            self.say(f"{self.clock()}  {kind} {name}, back {f.held_s:.1f} s after it exits")
            if kind == "kill":
                v.kill()
                await v.wait(30)
                f.code = self.ended(v, (-signal.SIGKILL,), "killed")
            else:
                await v.stop()
                f.code = self.ended(v, LEFT_CODES, "left")
            await asyncio.sleep(f.held_s)
            f.proc = await self.start(name, tracker, run_id)
        f.back_at = time.time()
        self.faults.append(f)
        return f

    async def churn(self, tracker: TrackerProcess, run_id: str, end: float) -> None:
        """Faults until ``end``: the first three one of each kind, then any; one at a time."""
        kinds = self.rng.sample(KINDS, len(KINDS))
        last = self.t0
        while True:
            at = last + self.rng.uniform(*EVERY_S)
            kind = kinds.pop(0) if kinds else self.rng.choice(KINDS)
            # room for the longest fault of its kind before the end
            longest = {"freeze": FREEZE_S[1], "kill": KILLED_S[1] + 10, "leave": AWAY_S[1] + 20}[kind]
            if at + longest >= end:
                return
            while time.time() < at:
                await self.restart_the_exited(tracker, run_id)
                await asyncio.sleep(min(1.0, max(0.0, at - time.time())))
            await self.restart_the_exited(tracker, run_id)
            f = await self.fault(kind, tracker, run_id)
            last = f.at if f is not None else time.time()

    async def run(self) -> dict[str, Any]:
        from crowdtrain.datasets.make import make_dataset
        from crowdtrain.protocol.client import TrackerClient
        from crowdtrain.publisher import build_run_create

        tracker = await TrackerProcess.start(self.workdir / "tracker.sqlite3", options=TRACKER_OPTIONS)
        scan(tracker.child, "tracker", self.found)
        seeder: SeederProcess | None = None
        try:
            data = self.workdir / "dataset"
            await asyncio.to_thread(
                make_dataset, "builtin:stdlib", data, chunk_bytes=64 * 1024, name="stdlib-churn",
                announce_url=f"{tracker.url}/announce", max_bytes=512 * 1024,
            )  # fmt: skip
            create = await asyncio.to_thread(
                build_run_create, data, name="churn", model={"recipe": "tiny-gpt", "args": TINY_GPT},
                target_batch_size=PER_VOLUNTEER * self.volunteers, micro_batch_size=MICRO,
                optimizer={"name": "adamw", "lr": 3e-3},
                schedule={"kind": "constant", "warmup_steps": 0, "total_steps": 1_000_000},
                averaging=AVERAGING,
            )  # fmt: skip
            async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as admin:
                spec = (await admin.create_run(create)).spec
            seeder = await SeederProcess.start(data, tracker.url, tracker.admin_token)
            scan(seeder.child, "seeder", self.found)
            for i in range(self.volunteers):
                await self.start(f"v{i + 1}", tracker, spec.run_id)
            async with TrackerClient(tracker.url) as client, asyncio.TaskGroup() as tg:
                stop = asyncio.Event()
                tg.create_task(self.poll(client, spec.run_id, stop), name="status poll")
                try:
                    report = await self.measure(tracker, spec.run_id)
                    # spot-checks each honest key failed, as the tracker's credit ledger counts them
                    rejected = sum(c.rejected for c in (await client.status(spec.run_id)).credits)
                finally:
                    stop.set()
        finally:
            for v in self.current.values():
                if v.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(v.proc.pid, signal.SIGCONT)
                    await v.stop()
                    self.ended(v, LEFT_CODES, "stopped at the end")
            if seeder is not None:
                await seeder.close()
            await tracker.close()
            if self.logs_to is not None:
                self.dump(
                    self.logs_to,
                    [("tracker", tracker.child), *([("seeder", seeder.child)] if seeder else [])],
                )
        report.update(self.logs())
        report["spot_checks"]["tracker_rejected"] = rejected
        report["exits"] = self.exits
        report["unexpected_exits"] = [e for e in self.exits if not e["expected"]]
        report["tracebacks"] = {"count": self.found.count, "first_in": self.found.first_in,
                                "first": self.found.first}  # fmt: skip
        return report

    async def measure(self, tracker: TrackerProcess, run_id: str) -> dict[str, Any]:
        deadline = time.time() + START_S
        while not all(v.of(ev.StepDone) for v in self.current.values()):
            await self.restart_the_exited(tracker, run_id)
            if time.time() > deadline:
                raise RuntimeError(
                    f"not every volunteer took a step within {START_S:.0f} s (the run closed {len(self.closed)}): "
                    + "; ".join(where(v) for v in self.current.values())
                )
            await asyncio.sleep(0.5)
        self.t0 = time.time()
        rss_start = resident_bytes(tracker.proc.pid)
        end = self.t0 + 60 * self.minutes
        self.say(f"{self.clock()}  every volunteer took a step; soak of {self.minutes:g} min begins")
        await self.churn(tracker, run_id, end)
        while time.time() < end:
            await self.restart_the_exited(tracker, run_id)
            await asyncio.sleep(min(1.0, max(0.0, end - time.time())))
        rss_end = resident_bytes(tracker.proc.pid)
        # (a volunteer back shortly before the end gets its RECOVERY_S to step: measured, not counted above)
        while any(f.first_step() is None and time.time() - f.back_at < RECOVERY_S for f in self.faults):
            await self.restart_the_exited(tracker, run_id)
            await asyncio.sleep(1.0)
        self.say(f"{self.clock()}  soak over")
        return self.figures(end, rss_start, rss_end)

    def figures(self, end: float, rss_start: int, rss_end: int) -> dict[str, Any]:
        t0, span = self.t0, end - self.t0
        # each step's close as the tracker told it; a step that left its last 10 between two polls (ten steps
        # a second) by the first StepDone of it any volunteer emitted, a few ms after its close
        done: dict[int, float] = {}
        for v in self.started:
            for e in v.of(ev.StepDone):
                done[e.step] = min(e.t, done.get(e.step, e.t))
        steps = {**done, **self.closed}
        times = sorted(t for t in steps.values() if t0 <= t < end)
        thirds = [t0 + span * k / 3 for k in range(4)]
        per_min = [
            60.0 * sum(1 for t in times if a <= t < b) / (b - a) for a, b in itertools.pairwise(thirds)
        ]
        gaps = [(b - a, a - t0) for a, b in itertools.pairwise([t0, *times, end])]
        longest, longest_at = max(gaps)
        # what the volunteers warned of from just before the longest gap began to its end
        a, b = t0 + longest_at - 10.0, t0 + longest_at + longest
        warned = sorted(
            (e.t, v.name, e.message) for v in self.started for e in v.of(ev.LogLine)
            if a <= e.t <= b and e.level in ("WARNING", "ERROR", "CRITICAL")
        )  # fmt: skip
        back = [
            {"kind": f.kind, "volunteer": f.name, "at_s": round(f.at - t0, 1), "held_s": round(f.held_s, 1),
             "first_step_s": None if (s := f.first_step()) is None else round(s, 1)}
            for f in self.faults
        ]  # fmt: skip
        return {
            "config": {
                "minutes": self.minutes, "volunteers": self.volunteers, "seed": self.seed,
                "group_size": GROUP_SIZE, "codec": CODEC, "model": TINY_GPT, "micro_batch": MICRO,
                "target": PER_VOLUNTEER * self.volunteers, "averaging": AVERAGING,
                "tracker": list(TRACKER_OPTIONS), "cores": os.cpu_count(),
            },
            "soak_s": round(span, 1),
            "steps": len(times),
            "steps_seen_by_volunteers_only": sum(1 for s in done if s not in self.closed and t0 <= done[s] < end),
            "steps_per_min_thirds": [round(x, 2) for x in per_min],
            "last_over_first": round(per_min[2] / per_min[0], 3) if per_min[0] else None,
            "longest_without_step_s": round(longest, 1),
            "longest_without_step_at_s": round(longest_at, 1),
            "warnings_around_it": [f"{n} +{t - t0:.1f} s: {m}" for t, n, m in warned[:12]],
            "faults": back,
            "slow_or_never": sum(1 for b in back if b["first_step_s"] is None or b["first_step_s"] > RECOVERY_S),
            "tracker_rss_mb": {"start": round(rss_start / 2**20, 1), "end": round(rss_end / 2**20, 1),
                               "ratio": round(rss_end / rss_start, 3)},
            "notices": sorted(self.notices),
            "status_poll_failures": self.poll_failures,
        }  # fmt: skip

    def dump(self, folder: Path, others: list[tuple[str, Any]]) -> None:
        """Each volunteer process's events (but its progress reports) and last lines of stderr, one file per
        process in the order they started; the tracker's and seeder's last lines."""
        folder.mkdir(parents=True, exist_ok=True)
        for k, v in enumerate(self.started):
            with open(folder / f"{k:02d}-{v.name}.jsonl", "w", encoding="utf-8") as f:
                for e in v.events:
                    if not isinstance(e, QUIET):
                        f.write(json.dumps(ev.to_dict(e), default=str) + "\n")
                f.writelines(f"stderr: {line}\n" for line in v.child.lines)
        for name, child in others:
            (folder / f"{name}.log").write_text(
                "".join(f"{line}\n" for line in child.lines), encoding="utf-8"
            )

    def logs(self) -> dict[str, Any]:
        """What every volunteer process said in its ``LogLine`` events (all of them, once they ended)."""
        outcomes: collections.Counter[str] = collections.Counter()
        failed: collections.Counter[str] = collections.Counter()
        disagree: collections.Counter[str] = collections.Counter()
        errors = 0
        for v in self.started:
            for e in v.of(ev.LogLine):
                self.found.message(v.name, e.message)
                if m := SPOT.search(e.message):
                    outcomes[m.group(1)] += 1
                failed[v.name] += "state catch-up failed" in e.message
                disagree[v.name] += "disagree" in e.message
                errors += e.level in ("ERROR", "CRITICAL")
        names = sorted({v.name for v in self.started})
        return {
            "spot_checks": {"outcomes": dict(outcomes), "mismatches": outcomes["mismatch"]},
            "catchup_failed": {n: failed[n] for n in names},
            "disagree": {n: disagree[n] for n in names},
            "error_lines": errors,
        }


async def soak(
    workdir: Path,
    *,
    minutes: float,
    volunteers: int = 5,
    seed: int = 0,
    say: Callable[[str], None] = print,
    logs_to: Path | None = None,
) -> dict[str, Any]:
    """Run the churn soak in ``workdir``; its figures (JSON-able). ``logs_to``: a folder for each process's
    events and last lines, written at the end (also when the soak fails)."""
    return await Soak(workdir, volunteers, seed, minutes, say, logs_to).run()


def verdicts(report: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(criterion, passed, what was measured) for each pass/fail criterion of the soak."""
    back = report["faults"]
    thirds = report["steps_per_min_thirds"]
    tb = report["tracebacks"]
    return [
        ("every volunteer woken, restarted or rejoined steps within 60 s", bool(back) and report["slow_or_never"] == 0,
         f"{len(back)} back, {report['slow_or_never']} slower or never; "
         + ", ".join(f"{b['kind']} {b['volunteer']} {b['first_step_s']}" for b in back)),
        ("no minute without a step", report["longest_without_step_s"] < 60.0,
         f"longest {report['longest_without_step_s']} s (at +{report['longest_without_step_at_s']} s)"),
        ("steps/min of the last third >= 0.8 x the first", (report["last_over_first"] or 0.0) >= 0.8,
         f"{thirds[0]} -> {thirds[2]} ({report['last_over_first']}x)"),
        ("no traceback, no unexpected exit", tb["count"] == 0 and not report["unexpected_exits"],
         f"{tb['count']} traceback(s), {len(report['unexpected_exits'])} unexpected exit(s)"),
        ("tracker RSS grows <= 1.5x", report["tracker_rss_mb"]["ratio"] <= 1.5,
         f"{report['tracker_rss_mb']['start']} -> {report['tracker_rss_mb']['end']} MB "
         f"({report['tracker_rss_mb']['ratio']}x)"),
        ("0 honest spot-check mismatches",
         report["spot_checks"]["mismatches"] == 0 and report["spot_checks"]["tracker_rejected"] == 0,
         f"{report['spot_checks']['mismatches']} mismatch verdicts of {report['spot_checks']['outcomes']}, "
         f"{report['spot_checks']['tracker_rejected']} rejected in the tracker's ledger"),
    ]  # fmt: skip


def show(report: dict[str, Any]) -> list[str]:
    c, rss = report["config"], report["tracker_rss_mb"]
    thirds = report["steps_per_min_thirds"]
    lines = [
        f"churn soak: {c['volunteers']} volunteers, {report['soak_s']:.0f} s, seed {c['seed']}, tiny-gpt "
        f"{c['model']}, target {c['target']}, micro {c['micro_batch']}, groups of {c['group_size']}, {c['codec']}, "
        f"{c['cores']} cores",
        f"steps: {report['steps']} ({report['steps_seen_by_volunteers_only']} of them missed by the status "
        f"polls, seen in StepDone); steps/min by third: {thirds[0]} | {thirds[1]} | {thirds[2]}; "
        f"last/first {report['last_over_first']}",
        f"longest without a step: {report['longest_without_step_s']} s (from +{report['longest_without_step_at_s']} s); "
        "the volunteers' warnings from 10 s before it to its end:",
        *(f"  {w}" for w in report["warnings_around_it"]),
        "faults (kind, volunteer, at, held, back to its first step):",
        *(f"  {b['kind']:6s} {b['volunteer']} at +{b['at_s']} s, {b['held_s']} s, "
          f"first step {'never' if b['first_step_s'] is None else str(b['first_step_s']) + ' s'}"
          for b in report["faults"]),
        f"slower than 60 s or never: {report['slow_or_never']}",
        f"tracker RSS: {rss['start']} MB after the first step, {rss['end']} MB at the end ({rss['ratio']}x)",
        f"tracebacks: {report['tracebacks']['count']}; unexpected exits: "
        f"{[(e['volunteer'], e['code'], e['why']) for e in report['unexpected_exits']]}",
        f"spot-checks: {report['spot_checks']['outcomes']}, mismatches {report['spot_checks']['mismatches']}, "
        f"rejected in the tracker's ledger {report['spot_checks']['tracker_rejected']}",
        f"'state catch-up failed' lines: {report['catchup_failed']}",
        f"'disagree' lines: {report['disagree']}",
        f"ERROR lines: {report['error_lines']}; run notices: {report['notices'] or 'none'}; "
        f"status polls failed: {report['status_poll_failures']}",
    ]  # fmt: skip
    if report["tracebacks"]["first"]:
        lines += [f"first traceback ({report['tracebacks']['first_in']}):"]
        lines += ["  " + line for line in report["tracebacks"]["first"]]
    lines += [f"{'PASS' if ok else 'FAIL'}  {name}: {detail}" for name, ok, detail in verdicts(report)]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=12.0, help="the soak's length from the first step")
    ap.add_argument("--volunteers", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="of the faults' times, kinds and volunteers")
    ap.add_argument("--json-out", type=Path, help="also write the figures here, as JSON")
    ap.add_argument("--logs", type=Path, help="a folder: each process's events and last lines go there")
    args = ap.parse_args()
    if args.volunteers < 5:
        ap.error("--volunteers: at least 5 (one at a time is faulted; groups of 4)")

    def say(line: str) -> None:
        print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="crowdtrain-churn-") as tmp:
        report = asyncio.run(soak(Path(tmp), minutes=args.minutes, volunteers=args.volunteers, seed=args.seed,
                                  say=say, logs_to=args.logs))  # fmt: skip
    for line in show(report):
        print(line)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(ok for _, ok, _ in verdicts(report)) else 1


if __name__ == "__main__":
    sys.exit(main())
