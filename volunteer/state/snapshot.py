"""A volunteer's state as one verifiable blob: safetensors tensors plus a JSON header, cut into ranges.

Layout of :attr:`Snapshot.data` (a plain safetensors file, readable by any safetensors loader):

* ``model.<name>``: the model's ``state_dict()`` tensors;
* ``optim.state.<param index>.<key>``: the optimizer's per-parameter tensors (``exp_avg``, ``step``…);
* metadata key ``crowdtrain``: JSON of :class:`SnapshotHeader` (run, global step, recipe and args, the
  optimizer's ``param_groups`` and non-tensor per-parameter values, the scheduler's ``state_dict()``,
  and aliases for tensors that share storage, e.g. tied embeddings).

The :class:`StateManifest` gives the sha256 of the whole (the content hash the tracker's state directory
lists) and of each fixed-size range, so a newcomer checks every range as it arrives.

:func:`make_snapshot` and :func:`load_snapshot` are CPU-heavy (copying, hashing): call them with
``await asyncio.to_thread(...)``. Pass tensors that nothing mutates meanwhile (take the snapshot at a step
boundary, or pass ``detach().clone()`` copies). Nothing here uses pickle.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.protocol.messages import StateManifest, StateVersion
from crowdtrain.volunteer.state.config import KiB, MiB
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

FORMAT = 1
META_KEY = "crowdtrain"
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim.state."
_OPTIM_NAME = re.compile(r"^optim\.state\.(\d{1,9})\.([A-Za-z_][A-Za-z0-9_]{0,63})$")

Scalar = int | float | bool | str | None


class SnapshotHeader(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The JSON part of a snapshot (safetensors metadata key ``crowdtrain``)."""

    format: int
    run_id: str
    step: int
    recipe: str
    args: dict[str, int | float | str | bool]
    param_groups: list[dict[str, Any]]
    optim_scalars: dict[str, dict[str, Scalar]] = {}  # param index → non-tensor per-parameter values
    scheduler: dict[str, Any] | None = None
    aliases: dict[str, str] = {}  # tensor name → the stored tensor it shares storage with


@dataclass(frozen=True, slots=True)
class Snapshot:
    data: bytes
    manifest: StateManifest
    version: StateVersion

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def content_hash(self) -> str:
        return self.manifest.content_hash


@dataclass(frozen=True, slots=True)
class LoadedState:
    run_id: str
    step: int
    recipe: str
    args: dict[str, int | float | str | bool]
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]  # ready for ``optimizer.load_state_dict``
    scheduler_state: dict[str, Any] | None


def _check_range_bytes(range_bytes: int) -> None:
    if not 64 * KiB <= range_bytes <= 64 * MiB:
        raise ValueError(f"range_bytes is {range_bytes}; it must be between 64 KiB and 64 MiB")


def describe(data: bytes, *, run_id: str, step: int, range_bytes: int = 4 * MiB) -> Snapshot:
    """Hash ``data`` (the whole and each range) into a :class:`Snapshot`. CPU-heavy: use a thread."""
    _check_range_bytes(range_bytes)
    view = memoryview(data)
    whole = hashlib.sha256()
    ranges = []
    for start in range(0, len(data), range_bytes):
        piece = view[start : start + range_bytes]
        whole.update(piece)
        ranges.append(hashlib.sha256(piece).hexdigest())
    content_hash = whole.hexdigest()
    manifest = StateManifest(
        run_id=run_id,
        step=step,
        content_hash=content_hash,
        total_bytes=len(data),
        range_bytes=range_bytes,
        range_sha256=ranges,
    )
    return Snapshot(
        data=data,
        manifest=manifest,
        version=StateVersion(step=step, content_hash=content_hash, size=len(data)),
    )


def _json_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(
        f"snapshot header values must be JSON (numbers, strings, lists, dicts), not {type(obj).__name__}"
    )


def _flat_cpu(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Contiguous CPU tensors; tensors sharing storage are stored once (identical views) or copied."""
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen_views: dict[tuple[Any, ...], str] = {}
    seen_storage: set[tuple[str, int]] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state entry {name!r} is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach()
        storage = (str(t.device), t.untyped_storage().data_ptr()) if t.numel() else None
        view_key = (storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if storage is not None and view_key in seen_views:
            aliases[name] = seen_views[view_key]
            continue
        shares = storage is not None and storage in seen_storage
        t = t.to("cpu").contiguous()
        if shares or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses tensors that share or only partly use their storage
        if storage is not None:
            seen_views[view_key] = name
            seen_storage.add(storage)
        out[name] = t
    return out, aliases


def make_snapshot(
    *,
    run_id: str,
    step: int,
    recipe: str,
    args: dict[str, int | float | str | bool],
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any] | None,
    range_bytes: int = 4 * MiB,
) -> Snapshot:
    """Serialise a volunteer's state (``optimizer_state`` is ``optimizer.state_dict()``).

    CPU-heavy and blocking: call ``await asyncio.to_thread(make_snapshot, ...)`` from the event loop.
    """
    _check_range_bytes(range_bytes)
    named: dict[str, torch.Tensor] = {MODEL_PREFIX + k: v for k, v in model_state.items()}
    scalars: dict[str, dict[str, Scalar]] = {}
    for index, per_param in optimizer_state.get("state", {}).items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                named[f"{OPTIM_PREFIX}{int(index)}.{key}"] = value
            elif value is None or isinstance(value, int | float | bool | str):
                scalars.setdefault(str(int(index)), {})[key] = value
            else:
                raise TypeError(
                    f"optimizer state {index}.{key} is a {type(value).__name__}; expected a tensor"
                )
    tensors, aliases = _flat_cpu(named)
    header = {
        "format": FORMAT,
        "run_id": run_id,
        "step": step,
        "recipe": recipe,
        "args": dict(args),
        "param_groups": optimizer_state.get("param_groups", []),
        "optim_scalars": scalars,
        "scheduler": scheduler_state,
        "aliases": aliases,
    }
    meta = json.dumps(header, default=_json_default, sort_keys=True, allow_nan=False)
    data = safetensors_save(tensors, metadata={META_KEY: meta})
    return describe(data, run_id=run_id, step=step, range_bytes=range_bytes)


def _read_header(data: bytes) -> SnapshotHeader:
    if len(data) < 8:
        raise ProtocolError("state snapshot is shorter than a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > min(len(data) - 8, 100 * MiB):
        raise ProtocolError("state snapshot declares a header larger than the snapshot itself")
    try:
        raw = json.loads(bytes(data[8 : 8 + size]))
        meta = raw.get("__metadata__", {}) if isinstance(raw, dict) else {}
        text = meta.get(META_KEY) if isinstance(meta, dict) else None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"state snapshot header is not valid JSON ({exc})") from None
    if not isinstance(text, str):
        raise ProtocolError(f"state snapshot lacks the {META_KEY!r} metadata; it was not made by crowdtrain")
    try:
        header = msgspec.json.decode(text, type=SnapshotHeader, strict=True)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"state snapshot header: {exc}") from None
    if header.format != FORMAT:
        raise ProtocolError(f"state snapshot format {header.format} is not {FORMAT}; upgrade crowdtrain")
    return header


def load_snapshot(data: bytes) -> LoadedState:
    """Parse snapshot bytes (from a peer: already checked against the content hash) without pickle.

    CPU-heavy and blocking: call ``await asyncio.to_thread(load_snapshot, data)``.
    """
    header = _read_header(data)
    try:
        tensors = safetensors_load(data)  # safetensors, never pickle
    except Exception as exc:  # safetensors raises its own SafetensorError for any defect
        raise ProtocolError(f"state snapshot is not a valid safetensors file ({exc})") from None
    for name, target in header.aliases.items():
        if target not in tensors or name in tensors:
            raise ProtocolError(f"state snapshot alias {name!r} → {target!r} does not name a stored tensor")
        tensors[name] = tensors[target]
    model: dict[str, torch.Tensor] = {}
    optim: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        if name.startswith(MODEL_PREFIX):
            model[name[len(MODEL_PREFIX) :]] = tensor
            continue
        match = _OPTIM_NAME.match(name)
        if match is None:
            raise ProtocolError(f"state snapshot holds an unexpected tensor {name!r}")
        optim.setdefault(int(match[1]), {})[match[2]] = tensor
    for index, values in header.optim_scalars.items():
        if not index.isdigit():
            raise ProtocolError(f"state snapshot optimizer scalars use a bad parameter index {index!r}")
        optim.setdefault(int(index), {}).update(values)
    return LoadedState(
        run_id=header.run_id,
        step=header.step,
        recipe=header.recipe,
        args=header.args,
        model_state=model,
        optimizer_state={"state": dict(sorted(optim.items())), "param_groups": header.param_groups},
        scheduler_state=header.scheduler,
    )
