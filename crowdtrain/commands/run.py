"""``crowdtrain run create SPEC.toml``: publish a run on a tracker (format: docs/run-spec.md)."""

from __future__ import annotations

import base64
import tomllib
from pathlib import Path
from typing import Any

import typer

from crowdtrain.commands.common import run_async, wants_json
from crowdtrain.protocol.errors import ConfigError, ProtocolError

app = typer.Typer(help="Publish and inspect training runs on a tracker.", no_args_is_help=True)

MAX_SPEC_BYTES = 1 << 20
MAX_TORRENT_BYTES = 8 << 20


def _read_dataset(section: dict[str, Any], base: Path) -> tuple[dict[str, Any], bytes]:
    """The ``[dataset]`` table → (DatasetRef as a dict, torrent bytes)."""
    from crowdtrain.protocol import bencode
    from crowdtrain.protocol.messages import DatasetManifest, decode, to_builtins

    unknown = sorted(set(section) - {"dir", "torrent", "web_seed"})
    if unknown:
        raise ConfigError(f"dataset.{unknown[0]}", "is not a known key; use dir, torrent and web_seed")
    if not isinstance(section.get("dir"), str):
        raise ConfigError("dataset.dir", "must name the folder `crowdtrain dataset make` wrote")
    folder = (base / section["dir"]).resolve()
    manifest_path = folder / "manifest.json"
    try:
        manifest = decode(manifest_path.read_bytes(), DatasetManifest)
    except OSError as exc:
        raise ConfigError("dataset.dir", f"cannot read {manifest_path}: {exc.strerror}") from None
    except ProtocolError as exc:
        raise ConfigError("dataset.dir", f"{manifest_path} is not a data-set manifest ({exc})") from None
    if "torrent" in section:
        torrent_path = (base / str(section["torrent"])).resolve()
    else:
        torrent_path = folder / f"{manifest.name}.torrent"
        if not torrent_path.exists():
            found = sorted(folder.glob("*.torrent"))
            if len(found) == 1:
                torrent_path = found[0]
    try:
        if torrent_path.stat().st_size > MAX_TORRENT_BYTES:
            raise ConfigError("dataset.torrent", f"{torrent_path} is larger than {MAX_TORRENT_BYTES} bytes")
        torrent = torrent_path.read_bytes()
    except OSError as exc:
        raise ConfigError("dataset.torrent", f"cannot read {torrent_path}: {exc.strerror}") from None
    try:
        infohash = bencode.infohash_v1(torrent)
        top = bencode.decode(torrent)
    except ProtocolError as exc:
        raise ConfigError("dataset.torrent", f"{torrent_path} is not a .torrent file ({exc})") from None
    web_seed = section.get("web_seed")
    if web_seed is None:
        urls = top.get(b"url-list")
        if isinstance(urls, bytes):
            web_seed = urls.decode(errors="replace")
        elif isinstance(urls, list) and urls and isinstance(urls[0], bytes):
            web_seed = urls[0].decode(errors="replace")
    return {"infohash": infohash, "manifest": to_builtins(manifest), "web_seed": web_seed}, torrent


def _param_hash(model: dict[str, Any]) -> str:
    """Build the recipe locally to compute its parameter-schema hash (imports torch; publisher side only)."""
    from crowdtrain.volunteer.models.recipe import param_hash
    from crowdtrain.volunteer.models.registry import get_recipe

    recipe = get_recipe(str(model.get("recipe", "")))
    return param_hash(recipe.build(dict(model.get("args", {}))))


def load_spec(path: Path):  # -> RunCreate
    """Read a run-spec TOML file into a validated :class:`RunCreate`."""
    from crowdtrain.protocol.messages import RunCreate, convert

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
    dataset, torrent = _read_dataset(doc["dataset"], path.parent)
    doc["dataset"] = dataset
    doc["torrent"] = base64.b64encode(torrent).decode()
    model = doc.get("model")
    if isinstance(model, dict) and not model.get("param_hash"):
        model["param_hash"] = _param_hash(model)
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
    from crowdtrain.protocol.messages import encode
    from crowdtrain.tracker.client import TrackerClient

    if not admin_token:
        raise ConfigError("--admin-token", "is required (the token `crowdtrain tracker serve` printed)")
    create_msg = load_spec(spec)

    async def send():
        async with TrackerClient(tracker, timeout_s=timeout, admin_token=admin_token) as client:
            return await client.create_run(create_msg)

    created = run_async(send())
    typer.echo(encode(created).decode() if wants_json(ctx, json_out) else created.run_id)
