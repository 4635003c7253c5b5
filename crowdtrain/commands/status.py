"""``crowdtrain status RUN --tracker URL``: a run's collaboration progress, as text or JSON."""

from __future__ import annotations

import time

import typer

from crowdtrain.commands.common import run_async, wants_json
from crowdtrain.protocol.runcheck import printable
from crowdtrain.volunteer.view.fmt import fmt_bytes, fmt_eta, fmt_percent


def _upload(bps: float | None) -> str:
    """The rate a peer's answers went out at (what its part of the average is sized by), or a dash."""
    return fmt_bytes(bps) if bps is None else fmt_bytes(bps) + "/s"  # (None: the view's dash)


def _rate(x: float) -> str:
    return f"{x:,.1f}/s"


def _reach(p) -> str:  # p: PeerStatus
    if p.address is None:
        return "client mode (declared no address)"
    backbone = "backbone, " if p.backbone else ""
    if p.reachable:
        return f"{backbone}reachable at {p.address}"
    return f"{backbone}not reachable at {p.address} (client mode)"


def _bt(p) -> str:
    return {True: "reachable", False: "closed", None: "-"}[p.bt_reachable]


def mode(status) -> str:  # status: RunStatus
    """The run's averaging mode in a few words: every step, or local steps (a global step is an outer round)."""
    codec = f", codec {status.codec}" if status.codec else ""
    if status.inner_auto:
        return (
            f"local steps: a global step is an outer round of H × the target, H chosen by the tracker each round"
            f" (now {status.inner_steps}){codec}"
        )
    if status.inner_steps > 1:
        return f"local steps: a global step is an outer round of {status.inner_steps} × the target, in inner steps{codec}"
    return f"every step averages a gradient{codec}"


def _recent_steps(status) -> list[str]:  # status: RunStatus
    """The recent steps' table (with each round's H where the tracker chooses it)."""
    if not status.recent_steps:
        return []
    lines: list[str] = ["  recent steps:"]
    auto = status.inner_auto  # (each round's H, where the tracker chooses it)
    lines.append(
        f"    {'step':>6} {'duration':>9} {'samples':>9} {'peers':>6} {'groups':>6}"
        + (f" {'H':>4}" if auto else "")
        + f" {'loss':>7} {'closed':>10}"
    )
    for s in status.recent_steps:
        ago = max(0.0, time.time() - s.closed_at)
        lines.append(
            f"    {s.step:>6} {s.duration_s:>8.1f}s {s.samples:>9,} {s.peers:>6} {s.groups:>6}"
            + (f" {s.inner_steps:>4}" if auto else "")
            + f" {'-' if s.loss is None else f'{s.loss:.3f}':>7} {ago:>7.0f} s ago"
        )
    return lines


def _run_progress(status) -> str:  # status: RunStatus
    """The run's way to the schedule's end: ``12 / 1,000 steps (1 %), eta 3h 12m``."""
    if not status.total_steps:
        return "-"
    eta = "reached" if status.run_eta_s == 0 else f"eta {fmt_eta(status.run_eta_s)}"
    return f"{status.global_step:,} / {status.total_steps:,} steps ({fmt_percent(status.progress)}), {eta}"


def format_status(status) -> str:  # status: RunStatus
    lines = [
        f"run {status.run_id} ({printable(status.name)})",
        f"  mode          {mode(status)}",
        f"  global step   {status.global_step}",
        f"  run           {_run_progress(status)}",
        f"  samples       {status.samples:,} / {status.target:,} ({100 * status.samples / max(status.target, 1):.0f} %)",
        f"  eta           {fmt_eta(status.eta_s, status.samples_per_s)}",
        f"  peers online  {status.peers_online}",
        f"  throughput    {_rate(status.samples_per_s)} samples",
    ]
    if status.notice:
        lines.append(f"  notice        {printable(status.notice)}")
    if status.peers:
        lines.append("  peers:")
        lines.append(
            f"    {'peer':<18} {'step':>6} {'samples':>9} {'rate':>12} {'compute':>7} {'upload':>10}"
            f" {'chunks':>6}  {'bittorrent':<10}  averaging"
        )
        for p in status.peers:
            lines.append(
                f"    {p.peer_id:<18} {p.step:>6} {p.samples:>9,} {_rate(p.samples_per_s):>12}"
                f" {fmt_percent(p.compute_share):>7} {_upload(p.upload_bps):>10} {p.chunks_held:>6}  {_bt(p):<10}"
                f"  {_reach(p)}"
            )
    lines.extend(_recent_steps(status))
    if status.credits:
        # (spot-check columns only where the run draws checks: elsewhere they would only ever say 0)
        checks = status.spot_checked
        lines.append(
            "  credit ledger (samples of each volunteer key that entered the averages"
            + ("; spot-checks):" if checks else "):")
        )
        lines.append(
            f"    {'volunteer key':<18} {'samples':>10} {'steps':>6} {'last step':>9}"
            + (f" {'verified':>8} {'rejected':>8}" if checks else "")
        )
        for c in status.credits:
            lines.append(
                f"    {c.public_key[:16] + '…':<18} {c.samples:>10,} {c.steps:>6} {c.last_step:>9}"
                + (f" {c.verified:>8} {c.rejected:>8}" if checks else "")
                + (f"  barred: {printable(c.barred)}" if c.barred else "")
            )
    if status.evals:
        lines.append("  held-out evaluations:")
        for e in status.evals:
            metrics = "".join(f", {printable(k)} {v:.4g}" for k, v in sorted(e.metrics.items()))
            voices = f"{e.reports} volunteer" + ("s" if e.reports != 1 else "")
            lines.append(f"    step {e.step:>6}  loss {e.loss:.4f}{metrics}  ({voices})")
    return "\n".join(lines)


def status(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., help="The run id (from `crowdtrain run create`)."),
    tracker: str = typer.Option(..., "--tracker", help="Tracker URL, e.g. http://127.0.0.1:8470."),
    json_out: bool = typer.Option(False, "--json", help="Print the RunStatus JSON."),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds to wait for the tracker."),
) -> None:
    """Show a run's global step, samples toward the target, peers online, their throughput and compute
    share, recent steps, the credit ledger and held-out evaluations."""
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.protocol.messages import encode

    async def fetch():
        async with TrackerClient(tracker, timeout_s=timeout) as client:
            return await client.status(run_id)

    result = run_async(fetch())
    if wants_json(ctx, json_out):
        typer.echo(encode(result).decode())
    else:
        typer.echo(format_status(result))
