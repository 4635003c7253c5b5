"""Helpers every command shares: running a coroutine with the project's Ctrl-C rule, reading globals."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import typer

T = TypeVar("T")
EXIT_INTERRUPTED = 130


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """One ``asyncio.run`` per command; Ctrl-C ends the command with exit code 130 after its cleanup ran."""
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def wants_json(ctx: typer.Context, local: bool = False) -> bool:
    """True when ``--json`` was given to the root command or to this command."""
    return local or bool(getattr(ctx.find_root().obj, "json", False))
