"""The ``crowdtrain`` command: a typer root that mounts one sub-app per area, and the exit codes.

Exit codes: 0 ok, 1 an error a user can cause (its sentence on stderr, no traceback), 2 usage, 130
interrupted. Errors a user can cause: a :class:`CrowdtrainError` (also from inside a task group), an
operating-system refusal (a port in use, a path that cannot be written) and a file that is not the SQLite
database it was said to be.
"""

from __future__ import annotations

import importlib
import logging
import sqlite3
import sys
from dataclasses import dataclass

import typer

from crowdtrain import __version__
from crowdtrain.commands.common import EXIT_ERROR, EXIT_INTERRUPTED
from crowdtrain.protocol.errors import CrowdtrainError

app = typer.Typer(
    name="crowdtrain",
    help="Train one PyTorch model together with strangers' machines, the way BitTorrent shares a file.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@dataclass(frozen=True, slots=True)
class Globals:
    """Options given before the sub-command, passed to it through ``ctx.obj``."""

    json: bool = False
    log_level: str = "INFO"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"crowdtrain {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    log_level: str = typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING or ERROR."),
    json: bool = typer.Option(
        False, "--json", help="Print machine-readable JSON where a command supports it."
    ),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        raise typer.BadParameter(
            f"{log_level!r} is not a log level; use DEBUG, INFO, WARNING or ERROR", param_hint="--log-level"
        )
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx.obj = Globals(json=json, log_level=log_level.upper())


# One sub-app per area, mounted once the area exists: (module, attribute, command name). The modules live
# in crowdtrain/commands/, on top of the areas they drive.
SUBAPPS: list[tuple[str, str, str]] = [
    ("crowdtrain.commands.dataset", "app", "dataset"),
    ("crowdtrain.commands.tracker", "app", "tracker"),
    ("crowdtrain.commands.run", "app", "run"),
]
# Single commands that sit at the root: (module, attribute, command name).
COMMANDS: list[tuple[str, str, str]] = [
    ("crowdtrain.commands.status", "status", "status"),
    ("crowdtrain.commands.join", "join", "join"),
    ("crowdtrain.commands.export", "export", "export"),
    ("crowdtrain.commands.recipes", "recipes", "recipes"),
    ("crowdtrain.commands.demo", "demo", "demo"),
]

for _module, _attr, _name in SUBAPPS:
    app.add_typer(getattr(importlib.import_module(_module), _attr), name=_name)
for _module, _attr, _name in COMMANDS:
    app.command(_name)(getattr(importlib.import_module(_module), _attr))


def main(argv: list[str] | None = None) -> None:
    """Run the CLI and turn every outcome into an exit code.

    typer (standalone mode) answers usage errors with exit 2 and help with 0; commands turn Ctrl-C into
    exit 130 through :func:`crowdtrain.commands.common.run_async`; a :class:`CrowdtrainError` from any
    command ends here as one sentence on stderr and exit 1.
    """
    try:
        app(args=argv, prog_name="crowdtrain")
    except BaseExceptionGroup as group:  # from a task group: the first error a user can cause, if any
        sentence = _sentence(group)
        if sentence is None:
            raise
        typer.echo(f"error: {sentence}", err=True)
        sys.exit(EXIT_ERROR)
    except (CrowdtrainError, OSError, sqlite3.DatabaseError) as exc:
        typer.echo(f"error: {_sentence(exc)}", err=True)
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)


def _sentence(exc: BaseException) -> str | None:
    """The one sentence for an error a user can cause; None for anything else (a bug: its traceback shows)."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            sentence = _sentence(inner)
            if sentence is not None:
                return sentence
        return None
    if isinstance(exc, CrowdtrainError):
        return str(exc)
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc) or type(exc).__name__
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{what}{where}"
    if isinstance(exc, sqlite3.DatabaseError):
        return f"the tracker's database cannot be used: {exc}; give --db a path of a crowdtrain database or a new file"
    return None
