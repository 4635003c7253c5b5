"""``crowdtrain demo``: the whole system on this machine in one command.

It starts a tracker on a free loopback port with a temporary database, cuts the built-in corpus (the
Python standard library's own source) into a small data set, seeds it, creates a run, and starts N
volunteer processes through the ordinary ``crowdtrain join`` path, the last one late so that it has to
catch up. Each volunteer prints its events as JSON lines; the demo folds them into one view and ends with
a summary. Ctrl-C stops everything; no process is left behind.

The late volunteer's process starts with the others, but it only imports what a volunteer runs on (torch
and the rest: seconds on a small CPU) and then waits; the demo tells it to go on with ``crowdtrain join``
once the run has taken :data:`LATE_STEP` steps. So it joins a run that has moved on, loads the run's state
from its peers, and still trains for most of the run, however long the imports took; the summary says at
which step it joined and what it did from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from crowdtrain.commands.common import EXIT_INTERRUPTED, run_async
from crowdtrain.procs import Child, child_env, json_events, stop_processes
from crowdtrain.protocol.errors import ConfigError, CrowdtrainError

if TYPE_CHECKING:  # imported where the demo runs: the CLI starts without torch
    from rich.console import Console, RenderableType
    from rich.live import Live

    from crowdtrain.protocol.messages import DatasetManifest, RunSpec
    from crowdtrain.volunteer.events import Event, StateLoaded
    from crowdtrain.volunteer.view.state import ViewState

DEMO_CHUNK_BYTES = 64 * 1024
DEMO_MAX_BYTES = 3 * 1024 * 1024
DEMO_SEEDER_RATE = 1_000_000  # bytes/s: slow enough that volunteers also fetch chunks from each other
DEMO_MODEL_ARGS = {"d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 64}  # tiny-gpt's
LATE_STEP = 1  # the late volunteer is told to join once the run has taken this many steps
# The late volunteer's process: `python -c WAIT_THEN_JOIN join RUN_ID ...` (see join_when_told).
WAIT_THEN_JOIN = (
    "import sys; from crowdtrain.commands.demo import join_when_told; join_when_told(sys.argv[1:])"
)


@dataclass(slots=True)
class VolunteerProc:
    name: str
    state: ViewState  # its events folded so far
    child: Child | None = None
    first_losses: list[float] = field(default_factory=list)
    last_losses: list[float] = field(default_factory=list)
    bytes_sent: int = 0
    raw_bytes: int = 0
    downloaded: int = 0
    late: bool = False  # its process waits to be told to join (see join_when_told)
    told_at: int | None = None  # the run's global step when it was told to join
    joined_step: int | None = None  # the run's global step when it joined, as the tracker said
    first_load: StateLoaded | None = None  # its first StateLoaded event
    steps_contributed: int = 0  # steps it put samples into
    samples_contributed: int = 0

    @property
    def proc(self) -> asyncio.subprocess.Process | None:
        return None if self.child is None else self.child.proc


def demo(
    volunteers: int = typer.Option(3, "--volunteers", min=1, max=8, help="Volunteer processes to start."),
    steps: int = typer.Option(30, "--steps", min=1, help="Global steps to train before stopping."),
    model: str = typer.Option("tiny-gpt", "--model", help="Model recipe (tiny-gpt on the built-in corpus)."),
    codec: str = typer.Option(
        "int8", "--codec", help="Gradient codec: none, fp16, bf16, int8, int2 or sparse."
    ),
    late: bool = typer.Option(
        True, "--late/--no-late", help="Start the last volunteer late, to show catch-up."
    ),
    plain: bool = typer.Option(False, "--plain", help="Print lines instead of the live view."),
) -> None:
    """Run a tracker, a seeder and N volunteers on this machine, show them train, and print a summary."""
    if model != "tiny-gpt":
        raise ConfigError("--model", "the demo's built-in corpus is text; only tiny-gpt is offered")
    if codec not in ("none", "fp16", "bf16", "int8", "int2", "sparse"):
        raise ConfigError("--codec", f"{codec!r} is not one of none, fp16, bf16, int8, int2, sparse")
    run_async(_demo(volunteers, steps, codec, late and volunteers > 1, plain or not sys.stdout.isatty()))


async def _demo(n: int, steps: int, codec: str, late: bool, plain: bool) -> None:
    from rich.console import Console

    from crowdtrain.tracker.config import TrackerConfig
    from crowdtrain.tracker.server import serve
    from crowdtrain.volunteer.view.state import ViewState

    console = Console(soft_wrap=True)  # one event, one line, whatever the width (a pipe is 80 columns)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crowdtrain-demo-") as tmp_name:
        tmp = Path(tmp_name)
        config = TrackerConfig(db=str(tmp / "tracker.db"), heartbeat_interval_s=0.5, peer_ttl_s=10.0)
        async with serve(config) as tracker:
            console.print(f"tracker      {tracker.url}")
            data = tmp / "dataset"
            manifest = await _make_data(data, tracker.announce_url, console)
            spec = await _create_run(data, tracker.url, tracker.admin_token, steps, codec)
            console.print(f"run          {spec.run_id} ({spec.model.recipe}, codec {codec}, {n} volunteers)")
            volunteers = DemoVolunteers(
                procs=[VolunteerProc(name=f"volunteer-{i + 1}", state=ViewState()) for i in range(n)],
                tracker_url=tracker.url,
                run_id=spec.run_id,
                tmp=tmp,
                steps=steps,
                late=late,
                plain=plain,
                console=console,
            )
            seeder_uploaded = await _seed_while(volunteers, data, manifest)
            _summary(console, volunteers.procs, steps, time.monotonic() - started, seeder_uploaded)


async def _make_data(data: Path, announce_url: str, console: Console) -> DatasetManifest:
    """The demo's data set in ``data``: the first few MiB of the standard library's source, as byte tokens."""
    from crowdtrain.datasets.make import make_dataset

    manifest = await asyncio.to_thread(
        make_dataset,
        "builtin:stdlib",
        data,
        chunk_bytes=DEMO_CHUNK_BYTES,
        name="stdlib-demo",
        announce_url=announce_url,
        max_bytes=DEMO_MAX_BYTES,
    )
    console.print(
        f"data set     {manifest.name}: {len(manifest.chunks)} chunks, "
        f"{manifest.total_samples / 1e6:.1f} M byte tokens of Python source"
    )
    return manifest


async def _create_run(data: Path, tracker_url: str, admin_token: str, steps: int, codec: str) -> RunSpec:
    """The demo's run of tiny-gpt on the data set in ``data``, created on the tracker; its spec."""
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.publisher import build_run_create

    create = await asyncio.to_thread(
        build_run_create,
        data,
        name="demo",
        model={"recipe": "tiny-gpt", "args": dict(DEMO_MODEL_ARGS)},
        target_batch_size=192,  # slow enough that the late volunteer (~7 s to start) finds the run
        micro_batch_size=16,
        optimizer={"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        schedule={"kind": "cosine", "warmup_steps": 3, "total_steps": max(steps, 10)},
        averaging={
            "group_size": 4,
            "codec": codec,
            "round_timeout_s": 15.0,
            "gather_s": 1.0,
            "step_timeout_s": 20.0,
            "average_state_every": 5,
        },
    )
    async with TrackerClient(tracker_url, admin_token=admin_token) as client:
        return (await client.create_run(create)).spec


async def _seed_while(volunteers: DemoVolunteers, data: Path, manifest: DatasetManifest) -> int:
    """Seed the data set in ``data`` (slowly: the volunteers fetch chunks from each other too) while the
    volunteers train; stop them all, then the seeder. The bytes the seeder uploaded."""
    from crowdtrain.datasets.session import SessionConfig, TorrentSession

    seeder = TorrentSession(SessionConfig(listen="127.0.0.1:0", upload_rate_limit=DEMO_SEEDER_RATE))
    await seeder.start()
    seed_download = await seeder.seed(
        data, (data / f"{manifest.name}.torrent").read_bytes(), manifest=manifest
    )
    try:
        await volunteers.run()
    finally:
        await stop_all(volunteers.procs)
        seeder_uploaded = seed_download.stats().uploaded
        await seeder.close()
    return seeder_uploaded


@dataclass(slots=True)
class DemoVolunteers:
    """The demo's volunteer processes, watched together until each has ended: their events folded into
    their rows of the view, the late one (the last, with ``late``) told to join once the run has taken
    :data:`LATE_STEP` steps, and the ones that failed reported."""

    procs: list[VolunteerProc]
    tracker_url: str
    run_id: str
    tmp: Path  # each volunteer's data folder is in it
    steps: int  # each leaves once the run reaches this global step
    late: bool
    plain: bool  # lines instead of the live view
    console: Console

    async def run(self) -> None:
        """Start every volunteer (the late one too: it imports, then waits to be told) and watch them until
        all have ended; raise a :class:`CrowdtrainError` when any failed."""
        from rich.live import Live

        on_time = self.procs[:-1] if self.late else self.procs
        if self.late:
            self.procs[-1].late = True
        async with asyncio.TaskGroup() as tg:
            for p in self.procs:
                await self.start(p, tg)
            live = (
                None
                if self.plain
                else Live(self.view(), console=self.console, auto_refresh=False, transient=False)
            )
            with live if live is not None else contextlib.nullcontext():
                while True:
                    if not await self._watch(live, on_time):
                        break
                    await asyncio.sleep(0.25)
                if live is not None:
                    live.update(self.view(), refresh=True)
        self._raise_failures()

    async def _watch(self, live: Live | None, on_time: list[VolunteerProc]) -> bool:
        """One look: redraw the view and tell the late volunteer to join when it is time; False once no
        volunteer runs and none waits to be told."""
        if live is not None:
            live.update(self.view(), refresh=True)
        running = [p for p in self.procs if p.child is not None and p.child.returncode is None]
        waiting = self.late and self.procs[-1].told_at is None
        if not waiting and not running:
            return False
        if waiting:
            step = max((p.state.collab.global_step or 0) for p in on_time)
            if step >= LATE_STEP or all(
                p.child is not None and p.child.returncode is not None for p in on_time
            ):
                await self.tell(self.procs[-1], step)
                if self.plain:
                    self.console.print(f"{self.procs[-1].name} joins late, at global step {step}")
        return True

    def on_event(self, p: VolunteerProc, event: Event) -> None:
        """Fold one of ``p``'s events into its state and counters; in plain mode print the ones worth a line."""
        from crowdtrain.volunteer import events as ev
        from crowdtrain.volunteer.view.lines import plain_line
        from crowdtrain.volunteer.view.state import apply

        p.state = apply(p.state, event)
        _tally(p, event)
        if self.plain and isinstance(
            event, ev.StepDone | ev.StateLoaded | ev.Joined | ev.Left | ev.RoundFailed
        ):
            line = plain_line(event)
            if line:
                self.console.print(f"{p.name}: {line}", markup=False, highlight=False)

    async def start(self, p: VolunteerProc, tg: asyncio.TaskGroup) -> None:
        """Start ``p``'s ``crowdtrain join`` on loopback, its output read in ``tg``; a late one's process
        waits to be told (see :func:`join_when_told`)."""
        args = [
            "join",
            self.run_id,
            "--tracker",
            self.tracker_url,
            "--host",
            "127.0.0.1",
        ]  # nothing on the network
        args += ["--json", "--data-dir", str(self.tmp / p.name), "--max-steps", str(self.steps)]
        on_line = json_events(functools.partial(self.on_event, p))
        if not p.late:
            p.child = await Child.start(args, name=p.name, on_line=on_line, tg=tg)  # output read in tg
            return
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WAIT_THEN_JOIN,
            *args,
            stdin=asyncio.subprocess.PIPE,  # where it is told to join
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=child_env(),
            start_new_session=True,  # as Child.start: Ctrl-C reaches the demo, which stops it
        )
        p.child = Child(p.name, proc, on_line, 40, tg)

    async def tell(self, p: VolunteerProc, step: int) -> None:
        """Tell the late volunteer ``p`` to join, the run being at global ``step``."""
        p.told_at = step
        stdin = None if p.child is None else p.child.proc.stdin
        if stdin is None:  # start() gives a late volunteer a pipe to be told through
            raise RuntimeError(f"{p.name} has no pipe to be told to join through")
        stdin.write(b"join\n")
        with contextlib.suppress(ConnectionError):  # it has already exited: the failure report says why
            await stdin.drain()
        stdin.close()

    def view(self) -> RenderableType:
        """The run's collaboration panel above one row per volunteer."""
        from crowdtrain.volunteer.view.demo import DemoRow, render_demo

        rows = [DemoRow.from_state(p.name, p.state) for p in self.procs]
        if self.late and self.procs[-1].told_at is None:
            rows[-1] = dataclasses.replace(rows[-1], phase=f"joins late, at step {LATE_STEP}")
        return render_demo(self.procs[0].state, rows)

    def _raise_failures(self) -> None:
        """Print each failed volunteer's exit code and last lines, then raise saying how many failed."""
        failed = [
            (p, p.child) for p in self.procs if p.child is not None and p.child.returncode not in (0, None)
        ]
        for p, child in failed:
            self.console.print(f"{p.name} exited with code {child.returncode}:", style="red")
            for line in child.tail(8):
                self.console.print(f"  {line}", markup=False, highlight=False)
        if failed:
            raise CrowdtrainError(
                f"{len(failed)} of {len(self.procs)} demo volunteers failed; their last output is above."
            )


def _tally(p: VolunteerProc, event: Event) -> None:
    """Count into ``p`` what the summary says of it: samples and steps it contributed, its first and last
    losses, when it joined, its first state load, bytes sent and data downloaded."""
    from crowdtrain.volunteer import events as ev

    if isinstance(event, ev.StepDone):
        if event.contributed_samples > 0:
            p.steps_contributed += 1
            p.samples_contributed += event.contributed_samples
        if event.loss is not None:  # its mean loss over the step
            if len(p.first_losses) < 3:
                p.first_losses.append(event.loss)
            p.last_losses = [*p.last_losses[-2:], event.loss]
    elif isinstance(event, ev.Joined):
        p.joined_step = event.global_step
    elif isinstance(event, ev.StateLoaded) and p.first_load is None:
        p.first_load = event
    elif isinstance(event, ev.RoundDone):
        p.bytes_sent += event.bytes_sent
        p.raw_bytes += event.raw_bytes
    elif isinstance(event, ev.TorrentStats):
        p.downloaded = event.downloaded


def join_when_told(argv: list[str]) -> None:
    """The late volunteer's process (``python -c WAIT_THEN_JOIN ARGV``): import what a volunteer runs on
    and build the demo's model once (torch loads more of itself on its first build, a second on a small
    CPU), wait for a line on stdin, then run ``crowdtrain ARGV`` (``join ...``) like any volunteer: it
    fetches the run, builds its model, joins and loads the run's state as usual. It ends without joining
    when stdin ends first (the demo is gone) or on Ctrl-C while it waits."""
    try:
        for module in ("crowdtrain.volunteer.engine", "crowdtrain.volunteer.view.live"):
            importlib.import_module(module)  # torch and the rest of a volunteer: the slow part of its start
        from crowdtrain.cli import main
        from crowdtrain.volunteer.models import get_recipe

        get_recipe("tiny-gpt").build(dict(DEMO_MODEL_ARGS))  # thrown away: only torch's first-use work

        told = sys.stdin.readline()
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    if not told:
        return
    main(argv)


async def stop_all(procs) -> None:
    """SIGINT each running volunteer (it leaves the run cleanly), then SIGKILL what is still there after
    :data:`~crowdtrain.procs.STOP_GRACE_S`. ``procs``: anything with a ``proc`` (an asyncio process or None)."""
    await stop_processes([p.proc for p in procs if p.proc is not None])


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _summary(console, procs: list[VolunteerProc], steps: int, wall_s: float, seeder_uploaded: int) -> None:
    first = _mean([v for p in procs for v in p.first_losses[:1]])
    last = _mean([v for p in procs for v in p.last_losses[-1:]])
    sent = sum(p.bytes_sent for p in procs)
    raw = sum(p.raw_bytes for p in procs)
    downloaded = sum(p.downloaded for p in procs)
    from_peers = max(0, downloaded - seeder_uploaded)
    final_step = max((p.state.collab.global_step or 0) for p in procs)
    console.rule("demo summary")
    console.print(f"global steps      {final_step} (asked for {steps})")
    console.print(f"wall time         {wall_s:.1f} s")
    if first is not None and last is not None:
        console.print(f"training loss     {first:.3f} → {last:.3f} ({(1 - last / first) * 100:.0f}% lower)")
    if raw:
        console.print(
            f"gradient bytes    {sent / 1e6:.2f} MB sent vs {raw / 1e6:.2f} MB as fp32 ({raw / max(sent, 1):.1f}× smaller)"
        )
    console.print(
        f"data set chunks   {downloaded / 1e6:.2f} MB downloaded: {seeder_uploaded / 1e6:.2f} MB from the seeder, "
        f"{from_peers / 1e6:.2f} MB from other volunteers"
    )
    console.print(f"compute share     {_compute_shares(procs)}")
    caught = [p.name for p in procs if p.state.sync.last_sync_s is not None]
    if caught:
        console.print(f"state catch-up    {', '.join(caught)} loaded the run's state from peers")
    for p in procs:
        if p.late:
            console.print(f"late joiner       {_late_joiner(p, final_step)}")


def _late_joiner(p: VolunteerProc, final_step: int) -> str:
    """``volunteer-3 joined at step 2, caught up from peers (the state of step 2 in 0.05 s), then put 1,234
    samples into 26 of the 28 steps since and computed 71% of its time``."""
    from crowdtrain.volunteer.view.fmt import fmt_percent

    if p.joined_step is None:
        return f"{p.name} never joined the run"
    said = f"{p.name} joined at step {p.joined_step}"
    load = p.first_load
    if load is not None and load.donors_used:
        said += f", caught up from peers (the state of step {load.step} in {load.duration_s:.2f} s)"
    elif p.joined_step > 0:
        said += ", loaded no state from peers"
    since = max(0, final_step - p.joined_step)
    return (
        f"{said}, then put {p.samples_contributed:,} samples into {p.steps_contributed} of the {since} steps "
        f"since and computed {fmt_percent(p.state.training.compute_share)} of its time"
    )


def _compute_shares(procs: list[VolunteerProc]) -> str:
    """``mean 84%: volunteer-1 87%, volunteer-2 86%, volunteer-3 —``: each volunteer's share of its wall
    time (since its first micro-batch) spent computing gradients that entered an average, as its last
    StepDone or LocalTraining event said (the figure its engine's ``Summary.compute_share`` holds; the
    volunteers are other processes)."""
    from crowdtrain.volunteer.view.fmt import fmt_percent

    shares = [p.state.training.compute_share for p in procs]
    mean = _mean([s for s in shares if s is not None])
    each = ", ".join(f"{p.name} {fmt_percent(s)}" for p, s in zip(procs, shares, strict=True))
    return f"mean {fmt_percent(mean)}: {each}"
