"""The demo's combined view: the run's collaboration panel and one row per volunteer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from crowdtrain.volunteer.view.fmt import MISSING, fmt_duration, fmt_float, fmt_percent, fmt_ratio
from crowdtrain.volunteer.view.render import bar, collaboration_panel
from crowdtrain.volunteer.view.state import ViewState


@dataclass(frozen=True, slots=True)
class DemoRow:
    """One volunteer in the demo's table. Build it with :meth:`from_state` from that volunteer's folded
    events (e.g. its ``--json`` lines read back with ``lines.parse_json_line``)."""

    name: str
    phase: str = "starting"
    step: int | None = None
    lag: int | None = None
    chunks_held: int = 0
    chunks_total: int = 0
    samples_per_s: float | None = None
    loss: float | None = None
    last_round_step: int | None = None
    last_round_s: float | None = None
    last_round_ratio: float | None = None
    sync_fraction: float | None = None  # set while catching up
    note: str = ""  # e.g. why it left

    @classmethod
    def from_state(cls, name: str, state: ViewState) -> DemoRow:
        r = state.averaging.last_round
        header, training, data, sync = state.header, state.training, state.data, state.sync
        return cls(
            name=name,
            phase=header.phase,
            step=training.local_step,
            lag=state.lag,
            chunks_held=data.chunks_held,
            chunks_total=data.chunks_total,
            samples_per_s=training.local_samples_per_s if training.micro_batches else None,
            loss=training.loss,
            last_round_step=None if r is None else r.step,
            last_round_s=None if r is None else r.duration_s,
            last_round_ratio=None if r is None else r.compression_ratio,
            sync_fraction=sync.sync_fraction if sync.syncing else None,
            note=header.left_reason or "",
        )


def _state_cell(row: DemoRow) -> Text:
    text = Text(row.phase, style="magenta")
    if row.sync_fraction is not None:
        text.append(f" {fmt_percent(row.sync_fraction)}", style="bold")
    if row.note:
        text.append(f" ({row.note})", style="yellow")
    return text


def volunteers_table(rows: Sequence[DemoRow]) -> Table:
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        expand=True,
        header_style="bold",
        border_style="blue",
        padding=(0, 1),
    )
    table.add_column("volunteer", no_wrap=True, min_width=6, ratio=1)
    table.add_column("state", min_width=11, ratio=2, overflow="fold")
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("chunks", no_wrap=True)
    table.add_column("speed", justify="right", no_wrap=True)
    table.add_column("loss", justify="right", no_wrap=True)
    table.add_column("last round", no_wrap=True)
    for row in rows:
        step = MISSING if row.step is None else str(row.step)
        if row.lag:
            step += f" −{row.lag}"
        chunks = Text.assemble(
            bar(row.chunks_held / row.chunks_total if row.chunks_total else None, 4),
            f" {row.chunks_held}/{row.chunks_total}" if row.chunks_total else f" {MISSING}",
        )
        speed = MISSING if row.samples_per_s is None else f"{row.samples_per_s:.1f}/s"
        if row.last_round_step is None:
            last = MISSING
        else:
            last = f"{row.last_round_step} · {fmt_duration(row.last_round_s)} · {fmt_ratio(row.last_round_ratio)}"
        table.add_row(row.name, _state_cell(row), step, chunks, speed, fmt_float(row.loss), last)
    return table


def render_demo(collab_state: ViewState, volunteer_rows: Sequence[DemoRow]) -> RenderableType:
    """The run's collaboration panel (from ``collab_state``) above one table row per volunteer."""
    run_name = collab_state.header.run_name
    title = f"collaboration · {run_name}" if run_name else "collaboration"
    return Group(collaboration_panel(collab_state, title), volunteers_table(volunteer_rows))
