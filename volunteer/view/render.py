"""The view as rich panels: a pure function of a :class:`ViewState` (and ``now``, for the uptime).

Layout, for an 80–120 column terminal::

    ╭ crowdtrain · <run> ─────────────────────────────────────────╮   header: run, tracker, peer, device, uptime
    ╭ collaboration ──────────╮╭ local training ──────────────────╮
    ╭ data set ───────────────╮╭ state sync ──────────────────────╮
    ╭ averaging ──────────────────────────────────────────────────╮
    ╭ recent ─────────────────────────────────────────────────────╮   the last log lines
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from crowdtrain.volunteer.events import RoundDone
from crowdtrain.volunteer.view.fmt import (
    MISSING,
    fmt_bytes,
    fmt_duration,
    fmt_eta,
    fmt_float,
    fmt_percent,
    fmt_rate,
    fmt_ratio,
    fmt_speed,
    fmt_uptime,
    short_hash,
    short_id,
)
from crowdtrain.volunteer.view.lines import stamp
from crowdtrain.volunteer.view.panels import Collab, Training
from crowdtrain.volunteer.view.sentences import round_trouble
from crowdtrain.volunteer.view.state import ViewState

SPARK = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 16
SPARK_WIDTH = 24
LEVEL_STYLE = {"warning": "yellow", "error": "bold red", "critical": "bold red", "debug": "dim"}

Row = tuple[str, RenderableType]


def sparkline(values: Sequence[float], width: int = SPARK_WIDTH) -> str:
    """The last ``width`` values as block characters scaled between their min and max; NaN is a blank."""
    shown = list(values)[-width:] if width > 0 else []
    finite = [v for v in shown if math.isfinite(v)]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    span = high - low
    out = []
    for v in shown:
        if not math.isfinite(v):
            out.append(" ")
        elif span == 0:
            out.append(SPARK[len(SPARK) // 2 - 1])
        else:
            out.append(SPARK[round((v - low) / span * (len(SPARK) - 1))])
    return "".join(out)


def bar(fraction: float | None, width: int = BAR_WIDTH) -> Text:
    """A text progress bar, ``█`` done and ``░`` to go (readable without colour)."""
    f = 0.0 if fraction is None or not math.isfinite(fraction) else min(1.0, max(0.0, fraction))
    cells = f * width
    full = int(cells)
    half = full < width and cells - full >= 0.5
    done = "█" * full + ("▌" if half else "")
    return Text.assemble((done, "green"), ("░" * (width - len(done)), "dim"))


def _value(text: str, style: str = "bold") -> Text:
    return Text(text, style=style)


def _with_bar(fraction: float | None, label: str) -> Text:
    return Text.assemble(bar(fraction), " ", (label, "bold"))


def _kv(rows: Sequence[Row], pad_to: int = 0) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    for _ in range(pad_to - len(rows)):
        table.add_row("", "")
    return table


def _panel(title: str, rows: Sequence[Row], pad_to: int = 0) -> Panel:
    return Panel(_kv(rows, pad_to), title=title, title_align="left", border_style="blue")


class SideBySide:
    """Two panels in the halves of the width, stretched to the same height.

    Cheaper than a table grid: no measuring pass, each half is rendered at a known width.
    """

    def __init__(self, left: Panel, right: Panel) -> None:
        self.left = left
        self.right = right

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        left_width = options.max_width // 2
        widths = (left_width, options.max_width - left_width)
        panels = (self.left, self.right)
        rendered = [
            console.render_lines(p, options.update(width=w, height=None))
            for p, w in zip(panels, widths, strict=True)
        ]
        height = max(len(lines) for lines in rendered)
        for i, (panel, width) in enumerate(zip(panels, widths, strict=True)):
            if len(rendered[i]) < height:  # draw the shorter one again, as tall as the other
                panel.height = height
                rendered[i] = console.render_lines(panel, options.update(width=width, height=None))
        new_line = Segment.line()
        for left, right in zip(*rendered, strict=True):
            yield from left
            yield from right
            yield new_line


def _pair(left: tuple[str, Sequence[Row]], right: tuple[str, Sequence[Row]]) -> SideBySide:
    height = max(len(left[1]), len(right[1]))
    return SideBySide(_panel(*left, pad_to=height), _panel(*right, pad_to=height))


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _ids(ids: Sequence[str]) -> str:
    return ", ".join(short_id(i) for i in ids)


# ------------------------------------------------------------ panels


def header(state: ViewState, now: float | None) -> Panel:
    h = state.header
    lines = [Text(), Text()]

    def part(line: int, label: str, value: str, style: str = "bold") -> None:
        text = lines[line]
        if text:
            text.append("  ")
        text.append(label + " ", style="dim")
        text.append(value, style=style)

    if h.run_id:
        part(0, "run", h.run_id)
        part(0, "peer", h.peer_id, "bold cyan")
        part(0, "tracker", h.tracker)
        part(1, "device", h.device)
        if h.address is None:
            part(1, "mode", "client (sends only)")
        else:
            label = {True: "reachable at", False: "not reachable at", None: "address"}[h.reachable]
            part(1, label, h.address)
        part(1, "up", fmt_uptime(h.uptime(now)))
    else:
        lines[0].append("joining the run…", style="dim")
    part(1, "phase", h.phase, "bold magenta")
    if h.left_reason:
        part(1, "left", h.left_reason, "yellow")
    if h.reach_text:
        lines.append(Text(h.reach_text, style="yellow" if h.reach_level == "warning" else "dim"))
    if h.notice:
        lines.append(Text(f"run: {h.notice}", style="bold yellow"))
    title = f"crowdtrain · {h.run_name}" if h.run_name else "crowdtrain"
    return Panel(Group(*lines), title=title, title_align="left", border_style="bold blue")


def collaboration_rows(state: ViewState) -> list[Row]:
    c = state.collab
    target = f"{c.samples}/{c.target}" if c.target else MISSING
    peers = str(c.peers_online)
    if state.header.reachable is False:
        peers += " (this machine is not reachable)"
    return [
        ("global step", _value(MISSING if c.global_step is None else str(c.global_step))),
        ("run", _value(_run_text(c, state.training))),
        ("batch", _with_bar(c.target_fraction, target)),
        ("peers online", _value(peers)),
        ("run speed", _value(fmt_speed(c.run_samples_per_s))),
        *_step_time_rows(state.training),
        (
            "next round in" if state.training.local else "next step in",
            _value(fmt_eta(c.eta_s, c.run_samples_per_s)),
        ),
    ]


def _run_text(c: Collab, t: Training) -> str:
    """The run's way to its schedule's end, with an ETA at this peer's recent pace: ``40/100 steps, eta 40m``."""
    if not c.total_steps or c.global_step is None:
        return MISSING
    if c.global_step >= c.total_steps:
        return f"{c.global_step}/{c.total_steps} steps, reached"
    wall = t.wall_s
    eta = MISSING if wall is None else fmt_eta((c.total_steps - c.global_step) * wall)
    return f"{c.global_step}/{c.total_steps} steps, eta {eta}"


def _step_time_rows(t: Training) -> list[Row]:
    """A step's time; in local-steps mode the round's wall time and its averaging, named apart (a round takes
    its inner steps' compute, then an averaging of a fraction of a second)."""
    if not t.local:
        return [("step time", _value(fmt_duration(t.step_time_s)))]
    return [
        ("round time", _value(fmt_duration(t.wall_s))),
        ("averaging", _value(fmt_duration(t.step_time_s))),
    ]


def local_rows(state: ViewState) -> list[Row]:
    t = state.training
    loss = Text.assemble((fmt_float(t.loss), "bold"), " ", (sparkline(t.loss_history), "cyan"))
    share, samples = t.contribution_share, state.collab.samples
    share_text = fmt_percent(share)
    if share is not None:
        share_text += f" (last {_plural(len(t.recent_steps), 'step')})"
    elif samples > 0:  # (before its first step: its part of what the run gathered for this one so far)
        so_far = "this round" if t.local else "this step"
        share_text = f"{fmt_percent(min(1.0, t.local_samples / samples))} ({so_far} so far)"
    steps = f"{t.steps_done} done, {t.steps_missed} missed"
    if t.samples_dropped:
        steps += f" ({t.samples_dropped} dropped)"
    return [
        ("loss", loss),
        ("speed", _value(fmt_speed(t.local_samples_per_s) if t.micro_batches else MISSING)),
        ("compute", _value(fmt_percent(t.compute_share))),
        (
            (
                "this round",
                _value(f"{_plural(t.local_samples, 'sample')}, {_plural(t.inner_steps, 'inner step')}"),
            )
            if t.inner_steps is not None
            else ("this step", _value(_plural(t.local_samples, "sample")))
        ),
        ("my share", _value(share_text)),
        ("steps", _value(steps)),
        ("lr", _value(_lr_text(t))),
        *_held_out_rows(t),
    ]


def _lr_text(t: Training) -> str:
    """The learning rate; in local-steps mode the inner optimizer's and the outer step's."""
    lr = MISSING if t.lr is None else f"{t.lr:.3g}"
    if not t.local:
        return lr
    inner = MISSING if t.inner_lr is None else f"{t.inner_lr:.3g}"
    return f"inner {inner} · outer {lr}"


def _held_out_rows(training: Training) -> list[Row]:
    """The newest held-out evaluation: its loss and step, then up to three of the recipe's metrics."""
    if training.held_out is None:
        return []
    step, loss, metrics = training.held_out
    rows: list[Row] = [("held-out", _value(f"{fmt_float(loss)} (step {step})"))]
    return rows + [(name[:12], _value(f"{value:.4g}")) for name, value in sorted(metrics.items())[:3]]


def data_rows(state: ViewState) -> list[Row]:
    d = state.data
    chunks = f"{d.chunks_held}/{d.chunks_total}" if d.chunks_total else MISSING
    ratio = d.seeding_ratio
    seeding = MISSING if ratio is None else f"{ratio:.2f}"
    return [
        ("chunks", _with_bar(d.chunks_fraction, chunks)),
        ("down", _value(f"{fmt_rate(d.download_rate)} ({fmt_bytes(d.downloaded)} in all)")),
        ("up", _value(f"{fmt_rate(d.upload_rate)} ({fmt_bytes(d.uploaded)} in all)")),
        ("swarm", _value(f"{_plural(d.swarm_peers, 'peer')}, {_plural(d.swarm_seeds, 'seed')}")),
        ("seed ratio", _value(seeding)),
    ]


def _lag_text(lag: int | None) -> Text:
    if lag is None:
        return _value(MISSING)
    if lag == 0:
        return _value("0 steps (in sync)", "bold green")
    return _value(f"{_plural(lag, 'step')} behind", "bold yellow")


def sync_rows(state: ViewState) -> list[Row]:
    s, local_step = state.sync, state.training.local_step
    version = MISSING if local_step is None else f"step {local_step}"
    if s.state_hash and s.state_step == local_step:
        version += f" · {short_hash(s.state_hash)}"
    rows: list[Row] = [("state", _value(version)), ("lag", _lag_text(state.lag))]
    if s.syncing:
        done = f"{fmt_bytes(s.sync_done_bytes)}/{fmt_bytes(s.sync_total_bytes)}"
        rows.append(("catching up", _with_bar(s.sync_fraction, done)))
        eta = fmt_eta(s.sync_eta_s, s.sync_rate)
        rows.append(("download", _value(f"{fmt_rate(s.sync_rate)}, eta {eta}, {s.donors_active} donors")))
    elif s.last_sync_s is not None:
        rows.append(("caught up in", _value(fmt_duration(s.last_sync_s))))
    if s.served_step is not None:
        rows.append(("serving", _value(f"step {s.served_step} ({fmt_bytes(s.served_size)})")))
    if s.donors_banned:
        reason = s.donors_banned[-1][1]
        banned = f"{_ids([d for d, _ in s.donors_banned])}: {reason}"
        rows.append(("donors banned", _value(banned, "bold red")))
    return rows


def _round_rows(r: RoundDone) -> list[Row]:
    """The newest round in full: its kind and time, its members (and my part), its bytes, its trouble."""
    mode = " (client mode: sent only)" if r.my_part < 0 else f" (I own part {r.my_part})"
    rows: list[Row] = [
        (
            "last round",
            _value(
                f"{r.kind} round for step {r.step}, {fmt_duration(r.duration_s)}, {len(r.members)} members"
            ),
        ),
        ("members", _value(_ids(r.members) + mode)),
        (
            "bytes",
            _value(
                f"sent {fmt_bytes(r.bytes_sent)}, received {fmt_bytes(r.bytes_received)}, "
                f"{fmt_ratio(r.compression_ratio)} smaller than fp32"
            ),
        ),
    ]
    if r.phases:
        rows.append(("timing", _value(", ".join(f"{k} {fmt_duration(v)}" for k, v in r.phases.items()))))
    trouble = round_trouble(r, fmt_ids=_ids)
    rows.append(("trouble", _value("; ".join(trouble), "bold yellow") if trouble else _value("none")))
    return rows


def averaging_rows(state: ViewState) -> list[Row]:
    a = state.averaging
    rows: list[Row] = [("phase", _value(state.header.phase, "bold magenta"))]
    if a.last_round is None:
        rows.append(("last round", _value("none yet")))
    else:
        rows += _round_rows(a.last_round)
    rounds = f"{a.rounds_done} done, {a.rounds_failed} failed"
    overall = a.overall_compression
    if overall is not None:
        rounds += f", {fmt_ratio(overall)} overall"
    rows.append(("rounds", _value(rounds)))
    if a.last_failure:
        rows.append(("last failure", _value(a.last_failure, "bold yellow")))
    return rows


def log_panel(state: ViewState) -> Panel:
    text = Text(no_wrap=True, overflow="ellipsis")
    for i, entry in enumerate(state.log):
        if i:
            text.append("\n")
        text.append(stamp(entry.t) + " ", style="dim")
        if entry.level != "info":
            text.append(entry.level.upper() + " ", style=LEVEL_STYLE.get(entry.level, "bold"))
        text.append(entry.message, style=LEVEL_STYLE.get(entry.level, ""))
    if not state.log:
        text.append("nothing yet", style="dim")
    return Panel(text, title="recent", title_align="left", border_style="blue")


def collaboration_panel(state: ViewState, title: str = "collaboration") -> Panel:
    return _panel(title, collaboration_rows(state))


def render(state: ViewState, now: float | None = None) -> RenderableType:
    """All panels for ``state``. ``now`` (unix seconds) only feeds the uptime; it defaults to the newest
    event's time, so the same state always renders the same text."""
    now = state.last_t if now is None else now
    return Group(
        header(state, now),
        _pair(("collaboration", collaboration_rows(state)), ("local training", local_rows(state))),
        _pair(("data set", data_rows(state)), ("state sync", sync_rows(state))),
        _panel("averaging", averaging_rows(state)),
        log_panel(state),
    )
