"""Helpers every command shares: running a coroutine with the project's Ctrl-C rule, reading globals."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

import typer

T = TypeVar("T")

log = logging.getLogger(__name__)

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
    loop: asyncio.AbstractEventLoop | None = None
    if os.environ.get("CROWDTRAIN_LOOP", "").lower() != "asyncio":
        try:
            import uvloop
        except ImportError:  # Windows: uvloop does not exist there
            pass
        else:
            loop = uvloop.new_event_loop()
    loop = loop or asyncio.new_event_loop()
    loop.set_exception_handler(quiet_upload_ends)
    return loop


def quiet_upload_ends(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: asyncio's, but for one failure aiohttp leaves unretrieved.

    aiohttp (3.14) writes a streamed request body in a task of its own; when the peer closes the
    connection while that task waits to drain the last chunk, the body ends "written" and the final
    ``write_eof`` raises ``ClientConnectionResetError`` out of the task. The request itself already failed
    (the caller got ``ServerDisconnected`` and said so), and aiohttp cancels the task only if it is still
    running, so the same failure came back a second time as "Task exception was never retrieved" and a
    traceback on the volunteer's screen (seen when an owner left mid-round: bench/churn.py). It is logged
    here as one line; every other unhandled failure goes to asyncio's handler as before.
    """
    task = context.get("task", context.get("future"))
    exc = context.get("exception")
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    if (
        isinstance(exc, ConnectionResetError)
        and getattr(coro, "__qualname__", "") == "ClientRequest.write_bytes"
    ):
        log.info("an upload's connection closed before its last bytes (%s); the request already failed", exc)
        return
    loop.default_exception_handler(context)


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
