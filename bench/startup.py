"""How long from `python -m crowdtrain join` to a volunteer that can average?

Starts a tracker, a data set and a seeder in this process, then launches N volunteer processes at once
and reads their JSON events: seconds from process start (interpreter and imports included) to
`Joined` (peer server up, registered), and to the end of its first all-reduce round.

    .venv/bin/python bench/startup.py [--volunteers 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crowdtrain.volunteer.view.lines import parse_json_line
from tests.harness import published_run


async def one(run, data_dir: Path, steps: int) -> tuple[float, float | None]:
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "crowdtrain", "join", run.spec.run_id, "--tracker", run.tracker.url,
        "--json", "--data-dir", str(data_dir), "--max-steps", str(steps), "--host", "127.0.0.1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    joined = first_round = None
    async for raw in proc.stdout:
        event = parse_json_line(raw.decode())
        name = type(event).__name__
        if name == "Joined" and joined is None:
            joined = time.monotonic() - start
        if name == "RoundDone" and first_round is None:
            first_round = time.monotonic() - start
    await proc.wait()
    return joined, first_round


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with published_run(Path(tmp), target_batch_size=16) as run:
            rows = await asyncio.gather(*(one(run, Path(tmp) / f"v{i}", steps=3) for i in range(n)))
    print(f"{'volunteer':>9} {'to Joined s':>12} {'to 1st round s':>15}")
    for i, (j, r) in enumerate(rows):
        print(f"{i:>9} {j:>12.2f} {r if r is None else round(r, 2)!s:>15}")
    print(
        f"median to Joined {statistics.median(r[0] for r in rows):.2f} s (goal: ready to average within 3 s)"
    )
    print(f"load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--volunteers", type=int, default=3)
    asyncio.run(main(parser.parse_args().volunteers))
