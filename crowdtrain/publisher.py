"""The publisher's side of a run as a library call: a data-set folder plus settings → a RunCreate.

`crowdtrain run create SPEC.toml` reads the same settings from TOML; the demo and the tests call this.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

from crowdtrain.protocol.errors import ConfigError, ProtocolError
from crowdtrain.protocol.limits import MAX_TOKENIZER_BYTES, MAX_TORRENT_BYTES
from crowdtrain.protocol.messages import RunCreate, convert
from crowdtrain.protocol.runcheck import check_run


def read_dataset(section: dict[str, Any], base: Path) -> tuple[dict[str, Any], bytes]:
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


def read_tokenizer(folder: Path, manifest: dict[str, Any]) -> bytes | None:
    """The data set's ``tokenizer.json`` when its manifest names one (checked against the manifest's size and
    sha256), else None: what ``RunCreate.tokenizer`` carries to the tracker."""
    from crowdtrain.datasets.make import TOKENIZER_NAME

    info = manifest.get("tokenizer")
    if not isinstance(info, dict):
        return None
    path = folder / TOKENIZER_NAME
    try:
        if path.stat().st_size > MAX_TOKENIZER_BYTES:
            raise ConfigError("dataset.dir", f"{path} is larger than {MAX_TOKENIZER_BYTES} bytes")
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            "dataset.dir",
            f"cannot read {path} ({exc.strerror}), the tokenizer its manifest names; run `dataset make` again",
        ) from None
    if hashlib.sha256(data).hexdigest() != info.get("sha256"):
        raise ConfigError(
            "dataset.dir",
            f"{path} is not the tokenizer its manifest names (its sha256 differs); it changed after "
            "`dataset make`: run `dataset make` again",
        )
    return data


PREFLIGHT_BATCH = (
    64  # samples in the pre-flight's micro-batch at most (the spec's micro_batch_size if smaller)
)


def preflight(
    model: dict[str, Any], folder: Path, manifest: dict[str, Any] | Any, micro_batch_size: int = 8
) -> dict[str, Any]:
    """Build the recipe as every volunteer will and run one micro-batch of the data set through it; return
    the ``[model]`` table the run spec carries: the recipe, its whole argument set (defaults filled in), the
    parameter-schema hash and the hash of the initial values. Imports torch (publisher side only).

    Refused, each in one sentence (:mod:`crowdtrain.volunteer.models.preflight`): a recipe of another kind
    than the data set, arguments its code refuses, a token recipe without ``seq_len``, token ids beyond its
    ``vocab``, a build whose values differ between two builds, a micro-batch its ``loss`` cannot take.
    """
    from crowdtrain.datasets.chunks import max_token_id
    from crowdtrain.datasets.sampler import Sampler
    from crowdtrain.protocol.messages import DatasetManifest
    from crowdtrain.volunteer.models import preflight as pf
    from crowdtrain.volunteer.models.origin import code_hash, package_of
    from crowdtrain.volunteer.models.recipe import param_hash
    from crowdtrain.volunteer.models.registry import get_recipe

    if not isinstance(manifest, DatasetManifest):
        manifest = convert(manifest, DatasetManifest)
    recipe = get_recipe(str(model.get("recipe", "")))
    pf.check_kind(recipe, manifest.kind)
    args = pf.resolved_args(recipe, dict(model.get("args", {})))
    seq_len = pf.window(recipe, args)
    built = pf.build(recipe, args)
    pf.check_deterministic(recipe, args, built)
    hashes = {"param_hash": param_hash(built), "init_hash": pf.initial_hash(built)}  # before a forward pass
    if manifest.kind == "tokens":
        pf.check_token_ids(recipe, args, max_token_id(manifest, folder), f"data set {manifest.name!r}")
    sampler = Sampler(manifest, folder, seed=0, seq_len=seq_len)
    for index in range(len(manifest.chunks)):
        sampler.add_chunk(index)
        if sampler.ready:
            break
    batch = sampler.batch(min(micro_batch_size, PREFLIGHT_BATCH))
    pf.check_micro_batch(recipe, built, batch.x, batch.y)
    name = str(model["recipe"])
    origin = {"package": package_of(name), "code_hash": code_hash(name, recipe)}
    return {**model, "args": args, **hashes, **origin}


def build_run_create(data_dir: Path, *, name: str, model: dict[str, Any], **settings: Any) -> RunCreate:
    """Read ``data_dir``'s manifest and torrent, fill in the recipe's parameter hash, validate.

    ``settings`` are the other RunCreate fields as plain data (``target_batch_size``, ``optimizer``,
    ``schedule``, ``averaging``, ``micro_batch_size``, ``join_policy``, ``join_token``, ``seed``).
    """
    dataset, torrent = read_dataset({"dir": str(data_dir)}, Path.cwd())
    tokenizer = read_tokenizer(Path(data_dir).resolve(), dataset["manifest"])
    model = dict(model)
    if not model.get("param_hash"):
        micro = int(settings.get("micro_batch_size", 8))
        model = preflight(model, Path(data_dir), dataset["manifest"], micro)
    doc = {
        "name": name,
        "model": model,
        "dataset": dataset,
        "torrent": base64.b64encode(torrent).decode(),
        **settings,
    }
    if tokenizer is not None:
        doc["tokenizer"] = base64.b64encode(tokenizer).decode()
    create = convert(doc, RunCreate)
    check_run(create)  # the tracker and every volunteer make the same check
    return create
