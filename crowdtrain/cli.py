"""The ``crowdtrain`` command: a typer root that mounts one sub-app per area, and the exit codes.

Exit codes live here and nowhere else: 0 ok, 1 a :class:`CrowdtrainError` (its sentence on stderr, no
traceback), 2 usage, 130 interrupted.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass

import typer

from crowdtrain import __version__
from crowdtrain.protocol.errors import CrowdtrainError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

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
    except CrowdtrainError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
