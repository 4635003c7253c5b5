"""The publisher's side of a run as a library call: a data-set folder plus settings → a RunCreate.

`crowdtrain run create SPEC.toml` reads the same settings from TOML; the demo and the tests call this.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from crowdtrain.protocol.errors import ConfigError, ProtocolError
from crowdtrain.protocol.limits import MAX_TORRENT_BYTES
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


def param_hash_of(model: dict[str, Any], dataset_kind: str | None = None) -> str:
    """Build the recipe locally, as every volunteer will, and return its parameter-schema hash (imports
    torch; publisher side only). The pre-flight of ``run create``: a recipe of another kind than the data set
    (``dataset_kind``), arguments the recipe refuses, or a build whose initial values differ from one build to
    the next (each volunteer would train a different model) are refused here, each in one sentence."""
    import torch

    from crowdtrain.protocol.errors import CrowdtrainError, RecipeError
    from crowdtrain.volunteer.models.recipe import param_hash
    from crowdtrain.volunteer.models.registry import get_recipe

    name = str(model.get("recipe", ""))
    args = dict(model.get("args", {}))
    recipe = get_recipe(name)
    if dataset_kind is not None and recipe.kind != dataset_kind:
        raise RecipeError(
            f"recipe {name!r} trains on {recipe.kind} data sets, but this run's data set holds {dataset_kind}; "
            "choose a recipe of that kind or another data set"
        )
    try:
        built = [recipe.build(args) for _ in range(2)]
    except CrowdtrainError:
        raise
    except Exception as exc:  # the recipe's own code: its error, said in one sentence
        raise RecipeError(f"recipe {name!r} cannot build a model with the arguments {args}: {exc}") from None
    first, second = (m.state_dict() for m in built)
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    if differ:
        raise RecipeError(
            f"recipe {name!r} builds different initial values each time ({differ[0]} differs between two builds), "
            "so every volunteer would train a different model; draw them from a generator seeded by the arguments"
        )
    return param_hash(built[0])


def build_run_create(data_dir: Path, *, name: str, model: dict[str, Any], **settings: Any) -> RunCreate:
    """Read ``data_dir``'s manifest and torrent, fill in the recipe's parameter hash, validate.

    ``settings`` are the other RunCreate fields as plain data (``target_batch_size``, ``optimizer``,
    ``schedule``, ``averaging``, ``micro_batch_size``, ``join_policy``, ``join_token``, ``seed``).
    """
    dataset, torrent = read_dataset({"dir": str(data_dir)}, Path.cwd())
    model = dict(model)
    if not model.get("param_hash"):
        model["param_hash"] = param_hash_of(model, dataset["manifest"]["kind"])
    doc = {
        "name": name,
        "model": model,
        "dataset": dataset,
        "torrent": base64.b64encode(torrent).decode(),
        **settings,
    }
    create = convert(doc, RunCreate)
    check_run(create)  # the tracker and every volunteer make the same check
    return create
