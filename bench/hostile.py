"""One hostile volunteer in four, side by side with the clean run (issue 48).

Each role of tests/hostile.py (a part owner answering ×−10, one answering the reversed mean with a receipt
forged to hold by itself, a backbone owner answering ×−10, a member sending −4.9× its pseudo-gradient) runs in
every-step and local-steps mode beside the clean run, ``--runs`` seeds each (real tracker, seeder and four
volunteers over HTTP; tiny-gpt, int8, groups of 4). Printed per mode and role: the honest volunteers' loss (mean
of their last 5 steps, then of the runs) and its ratio to the clean run's, steps, bytes per honest volunteer per
step, wall seconds, answers refused (proven by the receipt), whether the hostile key ended barred, whether the
honest volunteers ended bit-identical. ``--clip`` also runs the clean run at another clip multiple (what the
default clip of 1 costs an honest run: compare with ``--clip 5``).

    python bench/hostile.py                 # 3 runs of each, about 3 minutes on 2 cores
    python bench/hostile.py --runs 1 --json-out /tmp/hostile.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hostile import MODES, ROLES, hostile_run


async def main(args: argparse.Namespace) -> list[dict]:
    rows = []
    for mode in MODES:
        variants = [(role, {}) for role in ROLES]
        if args.clip is not None:
            variants.append(("clean", {"clip_multiple": args.clip}))
        for role, over in variants:
            runs = []
            for seed in range(1, args.runs + 1):
                with tempfile.TemporaryDirectory() as d:
                    runs.append(await hostile_run(Path(d), role, mode, seed=seed, **over))
            label = role + (f" (clip {over['clip_multiple']:g})" if over else "")
            rows.append(
                {
                    "mode": mode,
                    "role": label,
                    "honest_loss": statistics.fmean(r["honest_loss"] for r in runs),
                    "losses": [round(r["honest_loss"], 3) for r in runs],
                    "steps": min(min(r["honest_steps"]) for r in runs),
                    "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in runs),
                    "wall_s": statistics.fmean(r["wall_s"] for r in runs),
                    "refused": sum(r["refused_answers"] for r in runs),
                    "proven": sum(r["refused_proven"] for r in runs),
                    "barred": sum(r["hostile_barred"] for r in runs),
                    "identical": sum(r["honest_identical"] for r in runs),
                    "accused_honest": sum(len(r["accused_honest"]) for r in runs),
                    "pulls": sum(r["pulls_reported"] for r in runs),
                    "pulls_of_honest": sum(len(r["pulls_of_honest"]) for r in runs),
                    "runs": len(runs),
                }
            )
            print(_line(rows[-1], rows), flush=True)
    return rows


def _line(row: dict, rows: list[dict]) -> str:
    clean = next(r for r in rows if r["mode"] == row["mode"] and r["role"] == "clean")
    ratio = row["honest_loss"] / clean["honest_loss"]
    n = row["runs"]
    return (
        f"{row['mode']:<12} {row['role']:<22} loss {row['honest_loss']:7.3f} ({ratio:5.3f}× clean) "
        f"{row['losses']}  steps {row['steps']:>3}  {row['bytes_per_step'] / 1e3:6.1f} kB/step  "
        f"{row['wall_s']:5.1f} s  refused {row['refused']} (proven {row['proven']})  "
        f"barred {row['barred']}/{n}  identical {row['identical']}/{n}  honest accused {row['accused_honest']}  "
        f"pulls reported {row['pulls']} (of honest {row['pulls_of_honest']})"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="seeds per mode and role (default 3)")
    parser.add_argument(
        "--clip", type=float, default=None, help="also run the clean run at this clip multiple"
    )
    parser.add_argument("--json-out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    out = asyncio.run(main(args))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(out, indent=1))
