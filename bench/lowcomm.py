"""Low communication (issue 30): every-step mode against local-steps mode (``[averaging] inner_steps = H``),
the same model, data and token budget, side by side in one run of this script.

One tracker, the built-in corpus (``builtin:stdlib``, 1 MiB cut in 16 chunks of 64 KiB, byte tokens) and one
libtorrent seeder live in this process; each configuration is a run of its own on them, trained by
``--volunteers`` ``crowdtrain join --json`` processes that leave at ``--max-steps``. The model is tiny-gpt
(default d_model 128 × 4 layers, 4 heads, seq_len 64), AdamW at 1e-3 with a constant rate (``--schedule
cosine``: a cosine decay, below), target batch 256 samples, micro-batch 16; local runs take inner steps of 64
samples (``inner_batch_size``) and the default outer step (Nesterov, outer_lr 0.7, momentum 0.9). Every run
has ``step_timeout_s = 600`` (a local round covers H × 256 samples) and ``[eval] holdout_chunks = 1``: the
last chunk is never trained on.

``--schedule cosine`` gives every row ``{"kind": "cosine", "warmup_steps": W, "total_steps": T,
"min_lr_ratio": 0.1}`` with T = ceil(tokens / (256 × seq_len)), the every-step run's step count for the budget
(120 for 1,966,080 tokens), and W = ``--warmup-steps`` (default 0; it applies to the constant schedule too).
A local run's inner learning rate follows the schedule at the global-equivalent step ``anchor_step × H + j``
(with "auto", the sum of the H before the anchor, + j)
(volunteer/local.py), so the same schedule decays over the same samples in both modes; the outer step keeps
its constant outer_lr.

    .venv/bin/python bench/lowcomm.py --markdown                     # 2M tokens per configuration
    .venv/bin/python bench/lowcomm.py --quick                        # ~200k tokens: a quick look
    .venv/bin/python bench/lowcomm.py --tokens 1966080 --markdown     # 4 × 30 × 256 × 64: equal for every row
    .venv/bin/python bench/lowcomm.py --tokens 1000000 --configs 1:int8,10:int8
    .venv/bin/python bench/lowcomm.py --configs 1:int8,10:sparse:1.0:0.0        # H:codec:outer_lr:outer_momentum
    .venv/bin/python bench/lowcomm.py --configs 1:int8,30:int2:0.7:0.9:128      # ...:inner_batch_size
    .venv/bin/python bench/lowcomm.py --tokens 1966080 --schedule cosine --configs 1:int8,30:int2
    .venv/bin/python bench/lowcomm.py --schedule cosine --warmup-steps 10       # linear warm-up, then cosine
    .venv/bin/python bench/lowcomm.py --quick --configs 1:int8,10:int8 --clip 5  # what the default clip of 1 costs
    .venv/bin/python bench/lowcomm.py --configs 1:int8,30:defaults,auto:defaults  # inner_steps alone, or "auto"

``H:defaults`` and ``auto:defaults``: the run's [averaging] sets ``inner_steps`` (and the group size) alone and
gets what ``run create`` fills in (the local-steps defaults: int2, delay 1, outer 0.7 / 0.9, the inner batch the
micro-batch's). An "auto" row's budget is counted at its smallest H (``inner_steps_min``): where the tracker
chose a larger one, it trained on more tokens (its tokens column says how many; give the other rows that many
with ``--tokens`` in a second run to compare at equal tokens) and its notes list each round's H.

How each figure is measured (from outside: the volunteers' JSON events, the tracker, their kept state):
- steps: global steps (outer rounds) the run closed; each run stops at the round that reaches the budget,
  ``--max-steps = ceil(tokens / (target × seq_len × H))``;
- tokens: Σ over those steps of the samples the tracker credited to the step (its step history,
  ``GET /api/v1/runs/{id}/history``) × seq_len; checked against Σ ``StepDone.contributed_samples``;
- bytes/vol: Σ ``RoundDone.bytes_sent`` of a volunteer's events (the all-reduce payload it sent: its parts to
  their owners and, as an owner, the averaged part back to the others; frame headers included, HTTP headers,
  the tracker's messages and BitTorrent not), mean over the volunteers; parameter-averaging rounds included;
- bytes/token: bytes/vol ÷ the run's tokens; × fewer: every-step's bytes/token ÷ this row's (every-step:
  the first row with H = 1, else the first row);
- held-out loss: the mean loss of the run's final state on 512 windows of the held-out chunk (the same ones
  for every row: a Sampler seeded with SEED). The state is what each volunteer keeps in its data folder on
  leaving (``crowdtrain-kept/RUN.safetensors``, what a rejoin or ``crowdtrain export`` would serve: export
  needs a volunteer online, and here they have all left at --max-steps); all volunteers' copies must agree;
- loss vs H=1: this row's held-out loss ÷ every-step's, minus 1;
- wall s: from starting the volunteers to the last one's exit (start-up and download included). The
  machine is shared: wall times are indicative only;
- compute share: the last ``StepDone.compute_share`` of each volunteer, mean over the volunteers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# (run as a script, bench/ is on sys.path: the process plumbing is bench/utilization.py's)
from utilization import KiB, Proc, cores, param_count, start_volunteer, stop_all, tails

SEED = 20261124  # the held-out samples' sampler
TARGET, MICRO, INNER_BATCH = 256, 16, 64
STEP_TIMEOUT_S = 600.0
MIN_LR_RATIO = 0.1  # --schedule cosine: the rate decays to this × 1e-3
NEVER = 1 << 30  # eval.every: the held-out split without the volunteers' own evaluations


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2_000_000, help="token budget per configuration")
    ap.add_argument("--quick", action="store_true", help="a budget of 200k tokens")
    ap.add_argument(
        "--schedule",
        default="constant",
        choices=("constant", "cosine"),
        help="every row's learning-rate schedule; cosine decays over the every-step run's steps of the budget",
    )
    ap.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps of the schedule")
    ap.add_argument(
        "--configs",
        default="1:int8,10:int8,30:int8,10:none,10:sparse,30:sparse",
        help="H:codec or H:codec:outer_lr:outer_momentum[:inner_batch], or H:defaults / auto:defaults, "
        "comma-separated (default outer step: 0.7, 0.9; inner batch 64)",
    )
    ap.add_argument("--delay", type=int, choices=(0, 1), default=None, help="every row's [averaging] delay")
    ap.add_argument("--volunteers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--heldout", type=int, default=512, help="held-out samples evaluated")
    ap.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads per volunteer; default cores / N")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one configuration may take")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table")
    ap.add_argument(
        "--clip",
        type=float,
        default=None,
        help="every row's [averaging] clip_multiple (default: the run spec's, 1)",
    )
    args = ap.parse_args()
    if args.quick:
        args.tokens = 200_000
    args.threads = args.threads or max(1, cores() // args.volunteers)
    args.configs = [config(c) for c in args.configs.split(",")]
    return args


DEFAULTS = "defaults"


def config(text: str) -> tuple[int | str, str, tuple[float, ...] | None]:
    """``H:codec``, ``H:codec:outer_lr:outer_momentum`` or ``H:codec:outer_lr:outer_momentum:inner_batch``
    → (H, codec, outer step [and inner batch] or None: the defaults); ``H:defaults`` or ``auto:defaults``: the
    run's [averaging] sets ``inner_steps`` alone (and the group size), the rest is what ``run create`` fills in
    (protocol.messages.with_mode_defaults)."""
    h, codec, *outer = text.split(":")
    if codec == DEFAULTS and not outer:
        return (h if h == "auto" else int(h)), codec, None
    if outer and len(outer) not in (2, 3):
        raise SystemExit(
            f"--configs: {text!r} is not H:codec or H:codec:outer_lr:outer_momentum[:inner_batch]"
        )
    return int(h), codec, tuple(float(x) for x in outer) if outer else None


def schedule_spec(args, seq_len: int) -> dict:
    """Every row's schedule: constant, or cosine over the every-step run's steps of the budget."""
    if args.schedule == "constant":
        return {"kind": "constant", "warmup_steps": args.warmup_steps, "total_steps": 1000}
    total = math.ceil(args.tokens / (TARGET * seq_len))
    return {"kind": "cosine", "warmup_steps": args.warmup_steps, "total_steps": total,
            "min_lr_ratio": MIN_LR_RATIO}  # fmt: skip


async def create_run(tracker, data: Path, h: int | str, codec: str, margs: dict, args, outer=None) -> Any:
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.protocol.messages import with_mode_defaults
    from crowdtrain.publisher import build_run_create

    averaging: dict[str, Any] = {"group_size": args.volunteers, "codec": codec, "inner_steps": h,
                                 "step_timeout_s": STEP_TIMEOUT_S}  # fmt: skip
    if codec == DEFAULTS:  # (as run create reads a run file that sets inner_steps alone)
        averaging = with_mode_defaults({"group_size": args.volunteers, "inner_steps": h})
    elif isinstance(h, int) and h > 1:
        averaging["inner_batch_size"] = INNER_BATCH if outer is None or len(outer) < 3 else int(outer[2])
    if outer is not None:
        averaging["outer_lr"], averaging["outer_momentum"] = outer[:2]
    if args.clip is not None:
        averaging["clip_multiple"] = args.clip
    if args.delay is not None:
        averaging["delay"] = args.delay
    create = await asyncio.to_thread(
        build_run_create, data, name=f"lowcomm H={h} {codec}", model={"recipe": "tiny-gpt", "args": margs},
        target_batch_size=TARGET, micro_batch_size=MICRO, optimizer={"name": "adamw", "lr": 1e-3},
        schedule=schedule_spec(args, margs["seq_len"]), averaging=averaging,
        eval={"every": NEVER, "holdout_chunks": 1, "samples": 1},
    )  # fmt: skip
    async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
        return (await client.create_run(create)).spec


def heldout_batch(manifest, data: Path, seq_len: int, n: int) -> Any:
    """``n`` windows of the data set's last chunk (the held-out one), drawn with SEED: the same for every row."""
    from crowdtrain.datasets.sampler import Sampler

    sampler = Sampler(manifest, data, seed=SEED, seq_len=seq_len, vocab=256)
    sampler.add_chunk(len(manifest.chunks) - 1)
    return sampler.batch(n)


def heldout_loss(spec, model_state: dict | None, batch) -> float:
    """The mean loss over ``batch`` of the run's model holding ``model_state`` (None: its initial one)."""
    from crowdtrain.volunteer.models import get_recipe
    from crowdtrain.volunteer.trainer import Trainer

    recipe = get_recipe(spec.model.recipe)
    trainer = Trainer(recipe, recipe.build(dict(spec.model.args)), spec.optimizer, spec.schedule)
    if model_state is not None:
        trainer.model.load_state_dict(model_state, strict=True)
    return trainer.evaluate_with_metrics(batch.x, batch.y, 64)[0]


def final_state(procs: list[Proc], workdir: Path, run_id: str, steps: int) -> dict:
    """The state each volunteer kept on leaving: all of step ``steps`` and equal; returns its model tensors."""
    import torch

    from crowdtrain.volunteer.state.snapshot import load_snapshot

    states = []
    for p in procs:
        path = workdir / p.name / "crowdtrain-kept" / f"{run_id}.safetensors"
        if not path.is_file():
            print(f"  note: {p.name} kept no state ({path} is missing)", flush=True)
            continue
        loaded = load_snapshot(path)
        if loaded.step != steps:
            raise SystemExit(f"{p.name} kept the state of step {loaded.step}, not of step {steps}")
        states.append(loaded.model_state)
    if not states:
        raise SystemExit(f"no volunteer kept the state of run {run_id}")
    for other in states[1:]:
        if any(not torch.equal(other[k], states[0][k]) for k in states[0]):
            raise SystemExit("the volunteers kept different parameters for the same step")
    return states[0]


async def step_history(url: str, run_id: str) -> dict[int, Any]:
    import aiohttp

    from crowdtrain.protocol.messages import StepHistory, decode

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/api/v1/runs/{run_id}/history", params={"limit": "500"}) as r:
            r.raise_for_status()
            history = decode(await r.read(), StepHistory)
    return {s.step: s for s in history.steps}


async def one_run(
    tracker, data: Path, h: int | str, codec: str, margs: dict, args, workdir: Path, outer=None
) -> dict:
    spec = await create_run(tracker, data, h, codec, margs, args, outer)
    # ("auto": the budget at its smallest H; a larger H the tracker chooses trains on more tokens, as reported)
    least = (
        spec.averaging.inner_steps_min
        if spec.averaging.auto_inner_steps
        else spec.averaging.first_inner_steps
    )
    steps = math.ceil(args.tokens / (TARGET * margs["seq_len"] * least))
    workdir = workdir / (f"h{h}-{codec}" + ("-" + "-".join(f"{x:g}" for x in outer) if outer else ""))
    if codec == DEFAULTS:  # (the row's label: what the defaults were)
        a = spec.averaging
        codec = f"defaults: {a.codec}, delay {a.delay}, outer {a.outer_lr:g}/{a.outer_momentum:g}"
    if outer is not None:  # (the row's label)
        codec = f"{codec}, outer {outer[0]:g}/{outer[1]:g}" + (
            f", inner {outer[2]:g}" if len(outer) > 2 else ""
        )
    procs = [Proc(f"v{i + 1}") for i in range(args.volunteers)]
    opts = argparse.Namespace(steps=steps, threads=args.threads, device=args.device)
    print(f"H = {h}, codec {codec}: {steps} steps of {h} × {TARGET} samples ...", flush=True)
    started = time.monotonic()
    try:
        for p in procs:
            await start_volunteer(p, tracker.url, spec.run_id, workdir, opts)
        try:
            async with asyncio.timeout(args.timeout):
                await asyncio.gather(*(p.child.wait() for p in procs))
        except TimeoutError:
            raise SystemExit(
                f"H = {h}: not done within {args.timeout:.0f} s (--timeout)\n" + tails(procs)
            ) from None
    finally:
        await stop_all(procs)
    wall = time.monotonic() - started
    failed = [p for p in procs if p.proc.returncode != 0]
    if failed:
        raise SystemExit(f"H = {h}: {len(failed)} volunteer(s) exited with an error\n" + tails(failed))
    records = await step_history(tracker.url, spec.run_id)
    state = await asyncio.to_thread(final_state, procs, workdir, spec.run_id, steps)
    row = measure(procs, records, steps, margs["seq_len"])
    row.update(h=h, codec=codec, wall=wall, spec=spec, loss=None)
    if h == "auto":  # (each round's H, as the tracker recorded it)
        chosen = [records[s].inner_steps for s in sorted(records) if s < steps]
        row["h"] = f"auto ({min(chosen)}–{max(chosen)})"
        row["notes"].insert(0, f"H by round: {chosen}")
    row["loss"] = await asyncio.to_thread(heldout_loss, spec, state, args.batch)
    return row


def measure(procs: list[Proc], records: dict[int, Any], steps: int, seq_len: int) -> dict:
    from crowdtrain.volunteer import events as ev

    closed = [records[s] for s in sorted(records) if s < steps]
    samples = sum(r.samples for r in closed)
    credited = sum(e.contributed_samples for p in procs for e in p.events
                   if isinstance(e, ev.StepDone) and e.step < steps)  # fmt: skip
    sent, params_sent, shares, notes = [], [], [], []
    for p in procs:
        rounds = [e for e in p.events if isinstance(e, ev.RoundDone)]
        sent.append(sum(e.bytes_sent for e in rounds))
        params_sent.append(sum(e.bytes_sent for e in rounds if e.kind != "grad"))
        share = [
            e.compute_share for e in p.events if isinstance(e, ev.StepDone) and e.compute_share is not None
        ]
        shares += share[-1:]
        notes += [f"{p.name}: round of step {e.step} failed: {e.reason}" for e in p.events
                  if isinstance(e, ev.RoundFailed)]  # fmt: skip
        notes += [f"{p.name}: missed step {e.step}" for e in p.events if isinstance(e, ev.StepMissed)]
        notes += [f"{p.name}: {e.level} {e.message}" for e in p.events
                  if isinstance(e, ev.LogLine) and e.level in ("WARNING", "ERROR", "CRITICAL")]  # fmt: skip
    if credited != samples:
        notes.append(f"the tracker credited {samples} samples, the volunteers' StepDone say {credited}")
    tokens = samples * seq_len
    per_vol = statistics.fmean(sent)
    return {
        "steps": len(closed),
        "tokens": tokens,
        "bytes/vol": per_vol,
        "params bytes/vol": statistics.fmean(params_sent),
        "bytes/token": per_vol / tokens,
        "s/round": statistics.median(r.duration_s for r in closed),
        "compute share": statistics.fmean(shares) if shares else None,
        "notes": notes,
    }


HEADER = ("H", "codec", "steps", "tokens", "MB sent/vol", "bytes/vol/token", "× fewer", "held-out loss", "loss vs H=1",
          "wall s", "compute share")  # fmt: skip


def cells(row: dict, base: dict) -> list[str]:
    share = row["compute share"]
    return [
        str(row["h"]),
        row["codec"],
        str(row["steps"]),
        f"{row['tokens']:,}",
        f"{row['bytes/vol'] / 1e6:.1f}",
        f"{row['bytes/token']:.2f}",
        f"{base['bytes/token'] / row['bytes/token']:.1f}",
        f"{row['loss']:.3f}",
        f"{100 * (row['loss'] / base['loss'] - 1):+.1f}%",
        f"{row['wall']:.0f}",
        "—" if share is None else f"{100 * share:.0f}%",
    ]


def report(row: dict, base: dict) -> str:
    c = dict(zip(HEADER, cells(row, base), strict=True))
    lines = [
        f"H = {c['H']}, codec {c['codec']}: {c['steps']} steps, {c['tokens']} tokens, {c['MB sent/vol']} MB "
        f"sent per volunteer ({row['params bytes/vol'] / 1e6:.1f} MB of it parameter rounds), "
        f"{c['bytes/vol/token']} bytes/token ({c['× fewer']}× fewer than every-step), held-out loss "
        f"{c['held-out loss']} ({c['loss vs H=1']} against every-step), wall {c['wall s']} s ({row['s/round']:.1f} s/round median), compute share "
        f"{c['compute share']}"
    ]
    if row["notes"]:
        lines.append(f"  {len(row['notes'])} notes, e.g.:")
        lines += [f"    {n}" for n in row["notes"][:5]]
    return "\n".join(lines)


def baseline(rows: list[dict]) -> dict:
    """The row the others are compared with: the first every-step one, else the first."""
    return next((r for r in rows if r["h"] == 1), rows[0])


@contextlib.asynccontextmanager
async def seeded_corpus(workdir: Path):
    """A tracker in this process and the built-in corpus cut and seeded: yields (tracker, data dir, manifest)."""
    from crowdtrain.datasets.make import make_dataset
    from crowdtrain.datasets.session import SessionConfig, TorrentSession
    from crowdtrain.protocol.bencode import infohash_v1
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.tracker.config import TrackerConfig
    from crowdtrain.tracker.server import serve

    async with serve(TrackerConfig(db=":memory:")) as tracker:
        data = workdir / "data"
        manifest = await asyncio.to_thread(
            make_dataset, "builtin:stdlib", data, chunk_bytes=64 * KiB, name="lowcomm",
            announce_url=tracker.announce_url, max_bytes=1024 * KiB,
        )  # fmt: skip
        torrent = (data / f"{manifest.name}.torrent").read_bytes()
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
            # registered before the seeder's first announce, which an unknown info-hash would refuse
            await client.register_dataset(infohash_v1(torrent), manifest.name)
        async with TorrentSession(SessionConfig(listen="127.0.0.1:0")) as seeder:
            await seeder.seed(data, torrent, manifest=manifest)
            yield tracker, data, manifest


async def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.ERROR)
    import torch

    margs = {"d_model": args.d_model, "n_layer": args.layers, "n_head": args.heads, "seq_len": args.seq_len}
    sched = schedule_spec(args, args.seq_len)
    schedule = sched["kind"]
    if sched["kind"] == "cosine":
        schedule += f" over {sched['total_steps']} steps to {MIN_LR_RATIO:g} × 1e-3"
    if args.warmup_steps:
        schedule += f" after {args.warmup_steps} warm-up steps"
    n_params = await asyncio.to_thread(param_count, margs)
    print(
        f"machine: {cores()} cores (shared: wall times are indicative only), torch {torch.__version__}, "
        f"{args.threads} torch thread(s) per volunteer, device {args.device}; tiny-gpt {margs}: "
        f"{n_params / 1e6:.2f} M parameters; {args.volunteers} volunteers, target {TARGET}, micro {MICRO}, "
        f"inner_batch_size {INNER_BATCH} (local runs), AdamW 1e-3 {schedule}; budget {args.tokens:,} tokens",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="crowdtrain-lowcomm-") as tmp:
        async with seeded_corpus(Path(tmp)) as (tracker, data, manifest):
            args.batch = heldout_batch(manifest, data, args.seq_len, args.heldout)
            for h, codec, outer in args.configs:
                row = await one_run(tracker, data, h, codec, margs, args, Path(tmp), outer)
                if not rows:
                    initial = await asyncio.to_thread(heldout_loss, row["spec"], None, args.batch)
                    print(f"held-out loss of the initial parameters: {initial:.3f}", flush=True)
                rows.append(row)
                print(report(row, baseline(rows)), flush=True)
    base = baseline(rows)
    print(f"(× fewer, loss vs H=1: against the {'every-step' if base['h'] == 1 else 'first'} row)")
    if args.markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "---|" * len(HEADER))
        for row in rows:
            print("| " + " | ".join(cells(row, base)) + " |")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
