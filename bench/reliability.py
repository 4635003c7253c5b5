"""Run the fault scenarios and write ``docs/reliability.md`` from what they measured.

Each test in ``tests/test_faults_*.py`` appends one JSON record per scenario (rounds completed, samples
lost, time to recover, ...) to the file named by ``CROWDTRAIN_RELIABILITY_OUT`` (see ``tests/faults.py``).
This script runs them with that set (and a JUnit report, for which passed, failed or was skipped and why),
then renders the table. Nothing in the table is typed by hand.

    .venv/bin/python bench/reliability.py                     # run the fault tests, write docs/reliability.md
    .venv/bin/python bench/reliability.py --records R.jsonl --junit J.xml   # render earlier results only
    .venv/bin/python bench/reliability.py --out -             # print instead of writing the file
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_ENV = "CROWDTRAIN_RELIABILITY_OUT"

# What each test file shows, in the order of the table: (test file, fault, what the test asserts).
SCENARIOS = [
    (
        "test_faults_volunteer_kill.py",
        "A volunteer process SIGKILLed in the middle of an averaging round (round deadline 5 s)",
        "The other two finish that round by its deadline (whatever the dead member had not delivered is "
        "dropped, the part it owned is skipped by every survivor alike), take every later step together with bit-identical, finite parameters, and "
        "the loss on a fixed batch falls.",
    ),
    (
        "test_faults_tracker_restart.py",
        "The tracker process SIGKILLed mid-step and restarted 4 s later on the same --db and port",
        "Volunteers keep accumulating while it is down and take no step; after the restart they resume "
        "averaging; the durable step history has every step exactly once (and, as a regression test, a "
        "restarted tracker does not group the first peer back alone); each volunteer took every step "
        "once, in order; every sample drawn went into a step or is still accumulated; parameters stay "
        "identical; the loss falls.",
    ),
    (
        "test_faults_seeder_gone.py",
        "The only seeder SIGKILLed once it has uploaded one copy of the data set (two volunteers hold all "
        "chunks between them); a third volunteer joins afterwards",
        "Every volunteer ends with every chunk, each verified once against the manifest's sha256 (and the "
        "files on disk re-hashed by the test); the newcomer got all of its chunks after the seeder died.",
    ),
    (
        "test_faults_unreachable.py",
        "A volunteer whose peer server cannot be reached: it advertises a port nobody listens on (in the test "
        "process, and as a `crowdtrain join --advertise :PORT` process that joins late), or runs with --client-mode",
        "The tracker marks it unreachable; it owns no part in any round but is a member of every one, "
        "contributes its samples, steps with the others with bit-identical parameters; no part is dropped.",
    ),
    (
        "test_faults_poisoned.py",
        "A volunteer whose gradient is poisoned: all NaN, scaled ×1e6, or half its length",
        "Every part owner among the honest volunteers refuses (NaN, wrong length) or clips (×1e6) its copy "
        "and says so in the round's events; the honest volunteers take every step with bit-identical, "
        "finite parameters, and the loss on a fixed batch falls.",
    ),
    (
        "test_faults_netem.py",
        "Group all-reduce between 3 processes in 3 network namespaces on a bridge, each link degraded "
        "with tc (netem: 25±5 ms delay and 2% loss; tbf: 20 Mbit/s)",
        "Every round gives every peer the same result, equal to the exact weighted mean (codec none); no "
        "part dropped or failed.",
    ),
]

COMMON = {"scenario", "t", "rounds_completed", "samples_lost", "time_to_recover_s"}


def run_tests(records: Path, junit: Path) -> int:
    files = [str(ROOT / "tests" / f) for f, _, _ in SCENARIOS]
    env = dict(os.environ, **{OUT_ENV: str(records)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    print("running:", " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def read_junit(path: Path) -> dict[str, list[tuple[str, str, str]]]:
    """test file -> [(test name, passed|failed|skipped, message)]."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        status, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                status = "skipped" if kind == "skipped" else "failed"
                message = (node.get("message") or "").strip().splitlines()[0] if node.get("message") else ""
                break
        out.setdefault(module, []).append((case.get("name", ""), status, message))
    return out


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def render(records: list[dict], results: dict[str, list[tuple[str, str, str]]]) -> str:
    lines = [
        "# Reliability: fault scenarios and what happened",
        "",
        "<!-- generated by `python bench/reliability.py`; do not edit by hand -->",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} "
        f"({os.cpu_count()} CPUs, Python {platform.python_version()}), from the fault tests' own output: "
        f"each test in `tests/test_faults_*.py` asserts the outcome and appends what it measured to "
        f"`${OUT_ENV}`. Regenerate with:",
        "",
        "    .venv/bin/python bench/reliability.py",
        "",
        "Every process below is real (`crowdtrain join`, `crowdtrain tracker serve`, `crowdtrain dataset "
        "seed`, or peer processes in network namespaces), killed with SIGKILL where a kill is the fault. "
        "Times are wall-clock on a shared 2-core machine: they describe this run, they are not asserted.",
        "",
        "| Fault | Test result | Rounds completed | Samples lost | Time to recover | Other measurements |",
        "|---|---|---|---|---|---|",
    ]
    for module, fault, _ in SCENARIOS:
        cases = results.get(module, [])
        mine = [r for r in records if r.get("module") == module]
        if not cases and not mine:
            lines.append(f"| {fault} | not run | | | | |")
            continue
        for name, status, message in cases or [("", "not in the JUnit report", "")]:
            rec = next((r for r in mine if r.get("test") == name), None)
            shown = status if not message else f"{status}: {message}"
            if rec is None:
                lines.append(f"| {fault} (`{name}`) | {shown} | | | | |")
                continue
            other = "; ".join(
                f"{k.replace('_', ' ')} {_fmt(v)}"
                for k, v in sorted(rec.items())
                if k not in COMMON and k not in ("test", "module")
            )
            recover = rec.get("time_to_recover_s")
            lines.append(
                f"| {rec['scenario']} (`{name}`) | {shown} | {_fmt(rec.get('rounds_completed', ''))} | "
                f"{_fmt(rec.get('samples_lost', ''))} | {'' if recover is None else f'{recover:g} s'} | {other} |"
            )
    lines += ["", "## What each test asserts", ""]
    for module, fault, asserts in SCENARIOS:
        lines += [f"- **{fault}** (`tests/{module}`): {asserts}"]
    lines += [
        "",
        "## Definitions",
        "",
        "- *Rounds completed*: global steps the surviving volunteers took (the fewest of any of them), or "
        "all-reduce rounds for the namespace test.",
        "- *Samples lost*: samples a volunteer computed gradients on that never reached an optimizer step "
        "and are not carried into the next one. For a killed volunteer, its weight in the round it died in "
        "(an upper bound: copies it had delivered before dying were averaged in; the slice of the gradient "
        "it owned was skipped by every survivor for that one step).",
        "- *Time to recover*: killed volunteer: from the kill until the survivors completed that round; "
        "tracker: from the restart until the first step after it; seeder: from the kill until every "
        "volunteer held every chunk.",
        "",
        "## Known limits",
        "",
        "- A tracker killed in the few milliseconds between forming a step's groups (the step is then in "
        "its durable history) and the volunteers receiving them: after the restart the volunteers see that "
        "step as missed. Nobody applied it, so parameters stay equal; each drops its samples and fetches "
        "the state, and the history counts a step no optimizer took. The restart test kills the tracker "
        "while the volunteers accumulate, away from that window.",
        "- A part owner that dies after answering some senders but not others leaves the group split for "
        "that part (some applied the mean, the others skipped it); parameter averaging "
        "(`average_state_every`) brings them back together.",
        "- A volunteer that misses a step (it joined late, or was not ready in time) drops what it "
        "accumulated (computed on parameters the others have left: no gradient outlives its parameters) "
        "and fetches the state, taking part with weight 0 meanwhile (the `--advertise` process test "
        "allows such a missed step).",
        "- `tc netem` needs the kernel's `sch_netem` module; where it is missing (as on the development VM) "
        "that variant is skipped with that reason and only the `tbf` (slow link) variant runs.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--records", type=Path, help="render these JSON-lines records instead of running the tests"
    )
    parser.add_argument("--junit", type=Path, help="the JUnit XML report that goes with --records")
    parser.add_argument(
        "--out", default=str(ROOT / "docs" / "reliability.md"), help="file to write, or - to print"
    )
    args = parser.parse_args()
    code = 0
    with tempfile.TemporaryDirectory(prefix="crowdtrain-reliability-") as tmp:
        records, junit = args.records, args.junit
        if records is None:
            records, junit = Path(tmp) / "records.jsonl", Path(tmp) / "junit.xml"
            code = run_tests(records, junit)
        text = render(read_records(records), read_junit(junit) if junit else {})
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
