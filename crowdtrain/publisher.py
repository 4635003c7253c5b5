"""The publisher's side of a run as a library call: a data-set folder plus settings → a RunCreate.

`crowdtrain run create SPEC.toml` reads the same settings from TOML; the demo and the tests call this.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from crowdtrain.protocol.messages import RunCreate, convert


def build_run_create(data_dir: Path, *, name: str, model: dict[str, Any], **settings: Any) -> RunCreate:
    """Read ``data_dir``'s manifest and torrent, fill in the recipe's parameter hash, validate.

    ``settings`` are the other RunCreate fields as plain data (``target_batch_size``, ``optimizer``,
    ``schedule``, ``averaging``, ``micro_batch_size``, ``join_policy``, ``join_token``, ``seed``).
    """
    from crowdtrain.commands.run import _param_hash, _read_dataset

    dataset, torrent = _read_dataset({"dir": str(data_dir)}, Path.cwd())
    model = dict(model)
    if not model.get("param_hash"):
        model["param_hash"] = _param_hash(model)
    doc = {
        "name": name,
        "model": model,
        "dataset": dataset,
        "torrent": base64.b64encode(torrent).decode(),
        **settings,
    }
    return convert(doc, RunCreate)
