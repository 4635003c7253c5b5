"""``crowdtrain run create SPEC.toml``: publish a run on a tracker (format: docs/run-spec.md)."""

from __future__ import annotations

import base64
import tomllib
from pathlib import Path

import typer

from crowdtrain.commands.common import run_async, wants_json
from crowdtrain.protocol.errors import ConfigError, ProtocolError
from crowdtrain.protocol.runcheck import MAX_MICRO_BATCH
from crowdtrain.publisher import preflight, read_dataset, read_tokenizer

app = typer.Typer(help="Publish and inspect training runs on a tracker.", no_args_is_help=True)

MAX_SPEC_BYTES = 1 << 20


def load_spec(path: Path):  # -> RunCreate
    """Read a run-spec TOML file into a validated :class:`RunCreate`."""
    from crowdtrain.protocol.messages import RunCreate, convert, with_mode_defaults

    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError("SPEC", f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise ConfigError("SPEC", f"{path} is larger than {MAX_SPEC_BYTES} bytes")
    try:
        doc = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("SPEC", f"{path} is not valid TOML ({exc})") from None
    if not isinstance(doc.get("dataset"), dict):
        raise ConfigError("dataset", f"{path} needs a [dataset] table with dir = the data-set folder")
    if "tokenizer" in doc:
        raise ConfigError(
            "SPEC",
            f"{path}: tokenizer is not a run-spec key; `run create` sends the tokenizer.json of [dataset] dir "
            "when its manifest names one",
        )
    if isinstance(doc.get("averaging"), dict):  # (a local-steps run: the defaults measured for home links)
        doc["averaging"] = with_mode_defaults(doc["averaging"])
    folder = path.parent / str(doc["dataset"].get("dir"))
    dataset, torrent = read_dataset(doc["dataset"], path.parent)
    doc["dataset"] = dataset
    doc["torrent"] = base64.b64encode(torrent).decode()
    tokenizer = read_tokenizer(folder.resolve(), dataset["manifest"])
    if tokenizer is not None:
        doc["tokenizer"] = base64.b64encode(tokenizer).decode()
    model = doc.get("model")
    if isinstance(model, dict) and not model.get("param_hash"):
        micro = doc.get("micro_batch_size", 8)
        if isinstance(micro, bool) or not isinstance(micro, int) or not 1 <= micro <= MAX_MICRO_BATCH:
            raise ConfigError("micro_batch_size", f"must be a whole number from 1 to {MAX_MICRO_BATCH}")
        doc["model"] = preflight(model, folder.resolve(), dataset["manifest"], micro)
    try:
        return convert(doc, RunCreate)
    except ProtocolError as exc:
        raise ConfigError("SPEC", f"{path}: {exc}") from None


@app.command("create")
def create(
    ctx: typer.Context,
    spec: Path = typer.Argument(..., help="The run's TOML spec (see docs/run-spec.md)."),
    tracker: str = typer.Option(..., "--tracker", help="Tracker URL, e.g. http://127.0.0.1:8470."),
    admin_token: str | None = typer.Option(
        None, "--admin-token", envvar="CROWDTRAIN_ADMIN_TOKEN", help="The tracker's admin token."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the RunCreated JSON instead of the run id."),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds to wait for the tracker."),
) -> None:
    """Register the run described by SPEC on the tracker; prints the new run id."""
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.protocol.messages import encode

    if not admin_token:
        raise ConfigError("--admin-token", "is required (the token `crowdtrain tracker serve` printed)")
    create_msg = load_spec(spec)

    async def send():
        async with TrackerClient(tracker, timeout_s=timeout, admin_token=admin_token) as client:
            return await client.create_run(create_msg)

    created = run_async(send())
    typer.echo(encode(created).decode() if wants_json(ctx, json_out) else created.run_id)


def _admin_call(tracker: str, admin_token: str | None, timeout: float, call) -> None:
    from crowdtrain.protocol.client import TrackerClient

    if not admin_token:
        raise ConfigError("--admin-token", "is required (the token `crowdtrain tracker serve` printed)")

    async def send():
        async with TrackerClient(tracker, timeout_s=timeout, admin_token=admin_token) as client:
            await call(client)

    run_async(send())


TRACKER = typer.Option(..., "--tracker", help="Tracker URL, e.g. http://127.0.0.1:8470.")
ADMIN_TOKEN = typer.Option(
    None, "--admin-token", envvar="CROWDTRAIN_ADMIN_TOKEN", help="The tracker's admin token."
)
TIMEOUT = typer.Option(10.0, "--timeout", help="Seconds to wait for the tracker.")


@app.command("close")
def close(
    run_id: str = typer.Argument(..., help="The run to close."),
    tracker: str = TRACKER,
    admin_token: str | None = ADMIN_TOKEN,
    timeout: float = TIMEOUT,
) -> None:
    """Close RUN_ID: no more steps or joins; its volunteers are told and leave (its history stays)."""
    _admin_call(tracker, admin_token, timeout, lambda client: client.close_run(run_id))
    typer.echo(f"run {run_id} closed")


@app.command("delete")
def delete(
    run_id: str = typer.Argument(..., help="The run to delete."),
    tracker: str = TRACKER,
    admin_token: str | None = ADMIN_TOKEN,
    timeout: float = TIMEOUT,
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
) -> None:
    """Delete RUN_ID and its step history from the tracker; its volunteers are told and leave."""
    if not yes:
        typer.confirm(f"Delete run {run_id} and its step history from {tracker}?", abort=True)
    _admin_call(tracker, admin_token, timeout, lambda client: client.delete_run(run_id))
    typer.echo(f"run {run_id} deleted")
