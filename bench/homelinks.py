"""Home links (issue 30): every-step mode against local-steps mode across four hosts whose uplinks are shaped
like home lines, side by side in one run of this script.

Each configuration gets fresh hosts (network namespaces on a bridge, ``tests/netns.py``; needs root): a
tracker, a seeder and four volunteers, each a ``crowdtrain`` process started with the README's commands
(``tests/test_across_hosts.py``'s ``Published``). Every volunteer's uplink is shaped with ``tbf`` (this kernel
has ``tbf`` and ``htb``, not ``netem``: rate, no added delay). The run file is ``tests/test_homelinks.py``'s:
tiny-gpt d_model 128 × 4 layers, seq_len 64 (0.86 M parameters), target 256, micro-batch 16, AdamW 1e-3,
group of 4; local rows add ``inner_steps = H`` and ``inner_batch_size = 64``.

    python bench/homelinks.py --markdown                               # 2 Mbit/s: every-step, H = 10
    python bench/homelinks.py --uplink 20mbit --configs 1:int8:0,10:int8:0
    python bench/homelinks.py --configs 10:sparse:0,10:sparse:1 --rounds 4
    python bench/homelinks.py --uplink 20mbit,2mbit,2mbit,2mbit --configs 1:int8:0:equal,1:int8:0:upload

A configuration is ``H:codec:delay`` or ``H:codec:delay:parts`` (``[averaging] part_sizes``: ``upload``, the
default, or ``equal``), or ``H:defaults`` (the run file sets ``inner_steps = H`` alone: the local-steps defaults;
``auto:defaults``: ``inner_steps = "auto"`` alone, and the row's notes list each round's H, from the step history); ``--uplink`` is one rate for every volunteer or one per volunteer (v1 to v4). Each runs until every volunteer applied ``--rounds`` global steps (an
every-step row ``--steps``), then the volunteers are stopped with Ctrl-C. Measured from outside, from the
volunteers' ``--json`` events and the hosts' qdiscs:
- compute share: each volunteer's last ``StepDone.compute_share`` (the share of its wall time since its first
  micro-batch spent computing gradients that entered an average); min and mean over the four;
- steps: global steps every volunteer applied (the first all four took on), and missed steps / failed rounds;
- s/step: median wall seconds between a volunteer's consecutive ``StepDone`` events;
- MB up/vol/step: bytes the volunteer's ``tbf`` qdisc sent (everything: all-reduce, BitTorrent, the
  tracker's requests), mean over the four, ÷ the steps;
- bytes/token: Σ ``RoundDone.bytes_sent`` (the all-reduce payload) ÷ the tokens of the steps counted (Σ of the
  steps' ``group_samples`` × seq_len), mean over volunteers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests/ holds the namespace helper and the README's publisher walk-through

from tests.netns import Host, Network  # noqa: E402
from tests.test_across_hosts import Cli, Published  # noqa: E402
from tests.test_homelinks import HOME_TOML, tbf_bytes_sent  # noqa: E402

SEQ_LEN = 64
NAMES = ("v1", "v2", "v3", "v4")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--uplink",
        default="2mbit",
        help="each volunteer's uplink rate (tc's units, e.g. 2mbit), or one per volunteer, comma-separated",
    )
    ap.add_argument("--configs", default="1:int8:0,1:int8:1,10:int8:0,10:int8:1,10:sparse:0,10:sparse:1")
    ap.add_argument("--rounds", type=int, default=4, help="global steps every volunteer takes (local rows)")
    ap.add_argument(
        "--steps", type=int, default=8, help="global steps every volunteer takes (every-step rows)"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one configuration may take")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table")
    ap.add_argument(
        "--verbose", action="store_true", help="each volunteer's compute / step seconds, step by step"
    )
    args = ap.parse_args()
    args.configs = [_config(c) for c in args.configs.split(",")]
    rates = args.uplink.split(",")
    args.uplinks = dict(
        zip(NAMES, rates if len(rates) == len(NAMES) else rates[:1] * len(NAMES), strict=True)
    )
    return args


def _config(text: str) -> tuple[int | str, str, int, str]:
    h, codec, *rest = text.split(":")
    if codec == DEFAULTS:  # ``H:defaults``: the run file sets inner_steps alone
        return (h if h == "auto" else int(h)), codec, -1, "upload"
    delay, *parts = rest
    return int(h), codec, int(delay), parts[0] if parts else "upload"


DEFAULTS = "defaults"


def run_file(h: int | str, codec: str, delay: int, parts: str = "upload") -> str:
    """The test's run file with this row's [averaging] lines (H = 1: the every-step mode; codec ``defaults``:
    ``inner_steps = H`` alone, the rest the spec's local-steps defaults)."""
    base = HOME_TOML
    for line in ('codec = "sparse"\n', "inner_steps = 10\n", "inner_batch_size = 64\n"):
        base = base.replace(line, "")
    if codec == DEFAULTS:
        return base + ('inner_steps = "auto"\n' if h == "auto" else f"inner_steps = {h}\n")
    lines = f'codec = "{codec}"\ndelay = {delay}\npart_sizes = "{parts}"\n'
    return base + lines + (f"inner_steps = {h}\ninner_batch_size = 64\n" if h > 1 else "")


def inner_steps_history(pub: Published, host: Host) -> list[int]:
    """Each closed step's H, oldest first, from the run's step history (``GET .../history``) read on ``host``."""
    url = f"{pub.url}/api/v1/runs/{pub.run_id}/history?limit=500"
    code = (
        "import json, urllib.request; "
        f"print(json.dumps([s['inner_steps'] for s in json.load(urllib.request.urlopen({url!r}))['steps']]))"
    )
    done = host.run([sys.executable, "-c", code], timeout=60)
    return json.loads(done.stdout) if done.returncode == 0 else []


def one_row(h: int | str, codec: str, delay: int, parts: str, args: argparse.Namespace, tmp: Path) -> dict:
    steps = args.steps if h == 1 else args.rounds
    with Network(["tracker", "seeder", *NAMES]) as net:
        for n in NAMES:
            net.hosts[n].shape(args.uplinks[n])
        pub = Published(net, tmp, run_toml=run_file(h, codec, delay, parts))
        vols: dict[str, Cli] = {n: pub.join(net.hosts[n], tmp) for n in NAMES}
        before = {n: tbf_bytes_sent(net.hosts[n]) for n in NAMES}
        started = time.monotonic()
        chosen: list[int] = []
        try:
            for v in vols.values():
                v.wait_for(f"{steps} steps", lambda v=v: len(v.of("StepDone")) >= steps + 1, args.timeout)
            if h == "auto":
                chosen = inner_steps_history(pub, net.hosts["seeder"])
        finally:
            for v in vols.values():
                v.interrupt(60)
            pub.stop()
        up = {n: tbf_bytes_sent(net.hosts[n]) - before[n] for n in NAMES}
    wall = time.monotonic() - started
    first = max(min(e["step"] for e in v.of("StepDone")) for v in vols.values())
    end = min(max(e["step"] for e in v.of("StepDone")) for v in vols.values()) + 1
    counted = range(first, end)
    shares, steady, per_token, gaps, notes, rounds = [], [], [], [], [], []
    for n, v in vols.items():
        done = [e for e in v.of("StepDone") if e["step"] in counted]
        shares.append(v.of("StepDone")[-1]["compute_share"] or 0.0)
        tokens = sum(e["group_samples"] for e in done) * SEQ_LEN
        sent = sum(e["bytes_sent"] for e in v.of("RoundDone") if e["step"] in counted)
        rounds += [e["duration_s"] for e in v.of("RoundDone") if e["step"] in counted and e["kind"] == "grad"]
        per_token.append(sent / tokens if tokens else float("nan"))
        times = [e["t"] for e in v.of("StepDone")]
        gaps += [b - a for a, b in itertools.pairwise(times)]
        # after its first counted step: the seconds computing gradients that entered a step ÷ the wall time
        later = [e for e in done if e["step"] > first]
        if later and len(done) > 1:
            span = later[-1]["t"] - done[0]["t"]
            steady.append(sum(e["compute_s"] for e in later) / span if span > 0 else float("nan"))
        if args.verbose:
            ups = [
                f"{e['step']}: p{e['my_part']} {e['bytes_sent'] / 1e3:.0f} kB / {e['phases'].get('upload', 0):.1f} s "
                f"in {e['duration_s']:.1f} s"
                for e in v.of("RoundDone")
                if e["kind"] == "grad"
            ]
            print(f"    {n} rounds: " + ", ".join(ups))
            print(
                f"    {n}: "
                + ", ".join(f"{e['step']}: {e['compute_s']:.1f}/{e['step_time_s']:.1f} s" for e in done)
            )
        if sorted(e["step"] for e in done) != list(counted):
            notes.append(f"{n} took steps {[e['step'] for e in done]} of {first}..{end - 1}")
        notes += [f"{n} missed step {e['step']}" for e in v.of("StepMissed")]
        notes += [f"{n}: round of step {e['step']} failed: {e['reason']}" for e in v.of("RoundFailed")]
    return {
        "h": h,
        "codec": codec,
        "delay": "default" if codec == DEFAULTS else delay,
        "parts": parts,
        "steps": len(counted),
        "share min": min(shares),
        "share mean": statistics.fmean(shares),
        "steady min": min(steady) if steady else float("nan"),
        "steady mean": statistics.fmean(steady) if steady else float("nan"),
        "s/step": statistics.median(gaps) if gaps else float("nan"),
        "round s": statistics.median(rounds) if rounds else float("nan"),
        "MB up/step": statistics.fmean(up.values()) / 1e6 / max(1, end),
        "bytes/token": statistics.fmean(per_token),
        "wall": wall,
        "notes": notes + ([f"H by round: {chosen}"] if chosen else []),
    }


HEADER = ("H", "codec", "delay", "parts", "steps", "compute share min / mean", "after the first step",
          "s/step", "round s", "MB up/vol/step", "bytes/token", "wall s")  # fmt: skip


def cells(r: dict) -> list[str]:
    return [
        str(r["h"]),
        r["codec"],
        str(r["delay"]),
        r["parts"],
        str(r["steps"]),
        f"{100 * r['share min']:.0f}% / {100 * r['share mean']:.0f}%",
        f"{100 * r['steady min']:.0f}% / {100 * r['steady mean']:.0f}%",
        f"{r['s/step']:.1f}",
        f"{r['round s']:.2f}",
        f"{r['MB up/step']:.2f}",
        f"{r['bytes/token']:.2f}",
        f"{r['wall']:.0f}",
    ]


def main() -> None:
    args = parse_args()
    print(
        f"4 volunteers on 4 hosts, uplinks {args.uplink} (tbf), tiny-gpt 128 × 4 (0.86 M parameters)",
        flush=True,
    )
    rows = []
    for h, codec, delay, parts in args.configs:
        with tempfile.TemporaryDirectory(prefix="crowdtrain-homelinks-") as tmp:
            row = one_row(h, codec, delay, parts, args, Path(tmp))
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in zip(HEADER, cells(row), strict=True)), flush=True)
        for note in row["notes"][:5]:
            print(f"    {note}", flush=True)
    if args.markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "---|" * len(HEADER))
        for row in rows:
            print("| " + " | ".join(cells(row)) + " |")


if __name__ == "__main__":
    main()
