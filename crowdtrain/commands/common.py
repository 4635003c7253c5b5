"""Helpers every command shares: running a coroutine with the project's Ctrl-C rule, reading globals."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

import typer

T = TypeVar("T")

# The exit codes of every command (README "Exit codes"): here, below the commands and crowdtrain.cli both.
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


async def _cancel_on_sigterm(coro: Coroutine[Any, Any, T]) -> T:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await coro
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (Linux and macOS), else asyncio's.

    uvloop's transports are C, so a peer spends less CPU per socket read and write, which is most of what
    an all-reduce round does besides copying (see docs/benchmarks.md, "All-reduce"). ``CROWDTRAIN_LOOP=
    asyncio`` chooses asyncio's own loop, e.g. to rule uvloop out when chasing a bug.
    """
    if os.environ.get("CROWDTRAIN_LOOP", "").lower() != "asyncio":
        try:
            import uvloop
        except ImportError:  # Windows: uvloop does not exist there
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """One event loop per command (see :func:`new_event_loop`). Ctrl-C (SIGINT) and SIGTERM cancel it, its
    cleanup runs (a volunteer tells the tracker it leaves), and the command ends with exit code 130."""
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(_cancel_on_sigterm(coro))
    except (KeyboardInterrupt, asyncio.CancelledError):
        typer.echo("interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def wants_json(ctx: typer.Context, local: bool = False) -> bool:
    """True when ``--json`` was given to the root command or to this command."""
    return local or bool(getattr(ctx.find_root().obj, "json", False))
