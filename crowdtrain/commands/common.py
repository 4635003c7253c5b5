"""Helpers every command shares: running a coroutine with the project's Ctrl-C rule, reading globals."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

import typer

T = TypeVar("T")
EXIT_INTERRUPTED = 130


async def _cancel_on_sigterm(coro: Coroutine[Any, Any, T]) -> T:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await coro
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """One ``asyncio.run`` per command. Ctrl-C (SIGINT) and SIGTERM cancel it, its cleanup runs (a volunteer
    tells the tracker it leaves), and the command ends with exit code 130."""
    try:
        return asyncio.run(_cancel_on_sigterm(coro))
    except (KeyboardInterrupt, asyncio.CancelledError):
        typer.echo("interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def wants_json(ctx: typer.Context, local: bool = False) -> bool:
    """True when ``--json`` was given to the root command or to this command."""
    return local or bool(getattr(ctx.find_root().obj, "json", False))
