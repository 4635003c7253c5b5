"""``crowdtrain join RUN_ID --tracker URL``: lend this machine to a run until Ctrl-C."""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from crowdtrain.commands.common import run_async, wants_json

if TYPE_CHECKING:  # imported where a volunteer runs: the CLI starts without torch
    from crowdtrain.volunteer.config import VolunteerConfig


def default_data_dir(run_id: str) -> Path:
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "crowdtrain" / "runs" / run_id


MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """Cap glibc's malloc arenas (as ``MALLOC_ARENA_MAX`` does; a value set there wins). glibc gives each
    thread that allocates an arena of its own, up to 8 per core, and each keeps the high-water mark of the
    temporaries freed in it; the all-reduce encodes and decodes megabyte slices in several threads, and
    their high-water marks add up (see docs/benchmarks.md, Memory). Threads started afterwards share the
    capped arenas; elsewhere than glibc this does nothing."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(ctypes.c_int(-8), ctypes.c_int(arenas))  # M_ARENA_MAX
    except (OSError, AttributeError):
        return  # not glibc (musl has no arenas to cap)


# ------------------------------------------------------------------ the command's options
# Declared here, one name each, so that the command reads as what it does: a volunteer's settings, then its run.

RunId = Annotated[str, typer.Argument(help="The run to join (see `crowdtrain status` or the publisher).")]
Tracker = Annotated[
    str, typer.Option("--tracker", envvar="CROWDTRAIN_TRACKER", help="The run's tracker URL.")
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token", envvar="CROWDTRAIN_JOIN_TOKEN", help="Join token of a private run.", show_default=False
    ),
]
Device = Annotated[str, typer.Option("--device", help="auto, cpu or cuda (mixed precision on CUDA).")]
DataDir = Annotated[
    Path | None,
    typer.Option(
        "--data-dir", help="Where chunks are kept and seeded. Default: ~/.local/share/crowdtrain/runs/RUN_ID."
    ),
]
Host = Annotated[
    str,
    typer.Option(
        "--host", help="Interface the peer server and BitTorrent listen on (default: every interface)."
    ),
]
Port = Annotated[
    int, typer.Option("--port", help="TCP port of the peer server (averaging, state); 0: any free.")
]
BtPort = Annotated[int, typer.Option("--bt-port", help="TCP port of BitTorrent; 0: any free.")]
Advertise = Annotated[
    str | None,
    typer.Option(
        "--advertise",
        metavar="HOST[:PORT]",
        help="Where others reach the peer server (port forwarding, a relay). Default: the address the "
        "tracker sees this machine at, with --port.",
        show_default=False,
    ),
]
ClientMode = Annotated[
    bool,
    typer.Option("--client-mode", help="Behind NAT: declare no address, own no all-reduce part, only send."),
]
PortMapping = Annotated[
    bool,
    typer.Option(
        "--port-mapping/--no-port-mapping",
        envvar="CROWDTRAIN_PORT_MAPPING",
        help="Ask the home router (UPnP-IGD, NAT-PMP) to forward --port and --bt-port while joined, as "
        "BitTorrent clients do; never on a loopback --host.",
    ),
]
Backbone = Annotated[
    bool,
    typer.Option(
        "--backbone",
        help="Compute no gradients: on a reachable machine (no GPU needed), own parts of the average, serve "
        "the run's state to newcomers and seed the data set, for volunteers behind NAT.",
    ),
]
MaxBatch = Annotated[int | None, typer.Option("--max-batch", help="Cap on the micro-batch size (memory).")]
MaxSteps = Annotated[
    int | None,
    typer.Option(
        "--max-steps", help="Leave once the run reaches this global step (default: stay until Ctrl-C)."
    ),
]
InitFrom = Annotated[
    Path | None,
    typer.Option(
        "--init-from",
        help="Restore the run from a `crowdtrain export` checkpoint when no peer serves its state and this "
        "volunteer kept none of the run's step (the step gap is told).",
    ),
]
Plain = Annotated[bool, typer.Option("--plain", help="One line per event instead of the live view.")]
JsonOut = Annotated[bool, typer.Option("--json", help="One JSON object per event (JSON lines).")]


def join(
    ctx: typer.Context,
    run_id: RunId,
    tracker: Tracker,
    token: Token = None,
    device: Device = "auto",
    data_dir: DataDir = None,
    host: Host = "0.0.0.0",
    port: Port = 0,
    bt_port: BtPort = 0,
    advertise: Advertise = None,
    client_mode: ClientMode = False,
    port_mapping: PortMapping = True,
    backbone: Backbone = False,
    max_batch: MaxBatch = None,
    max_steps: MaxSteps = None,
    init_from: InitFrom = None,
    plain: Plain = False,
    json_out: JsonOut = False,
) -> None:
    """Join a run: download its data over BitTorrent, train, average gradients with peers, until Ctrl-C."""
    from crowdtrain.volunteer.config import VolunteerConfig

    config = VolunteerConfig(
        run_id=run_id,
        tracker_url=tracker.rstrip("/"),
        data_dir=data_dir or default_data_dir(run_id),
        token=token,
        device=device,
        host=host,
        port=port,
        bt_port=bt_port,
        advertise=advertise,
        client_mode=client_mode,
        port_mapping=port_mapping,
        backbone=backbone,
        max_batch=max_batch,
        max_steps=max_steps,
        init_from=init_from,
    )
    run_volunteer(config, "json" if wants_json(ctx, json_out) else "plain" if plain else "live")


def run_volunteer(config: VolunteerConfig, requested: str) -> None:
    """Run one volunteer until it leaves, its events shown as ``requested`` (live, plain or json; a live
    view falls back to lines where stdout is no terminal)."""
    from crowdtrain.volunteer.engine import Volunteer
    from crowdtrain.volunteer.view.live import ViewSink, choose_mode

    sink = ViewSink(choose_mode(requested, sys.stdout))

    limit_malloc_arenas()

    async def main() -> None:
        volunteer = Volunteer(config, emit=sink.emit)
        async with asyncio.TaskGroup() as tg:
            view = tg.create_task(sink.run())
            try:
                await volunteer.run()
            finally:
                await sink.close()
                await view

    run_async(main())
