"""A volunteer's state as one verifiable blob: safetensors tensors plus a JSON header, cut into ranges.

Layout of a snapshot (a plain safetensors file, readable by any safetensors loader):

* ``model.<name>``: the model's ``state_dict()`` tensors;
* ``optim.state.<param index>.<key>``: the optimizer's per-parameter tensors (``exp_avg``, ``step``…);
* metadata key ``crowdtrain``: JSON of :class:`SnapshotHeader` (run, global step, recipe and args, the
  optimizer's ``param_groups`` and non-tensor per-parameter values, the scheduler's ``state_dict()``,
  and aliases for tensors that share storage, e.g. tied embeddings).

The :class:`StateManifest` gives the sha256 of the whole (the content hash the tracker's state directory
lists) and of each fixed-size range, so a newcomer checks every range as it arrives.

:func:`write_snapshot` streams the tensors (live ones, on any device) into a file a piece at a time while
hashing, so a snapshot never costs a second copy of the state in memory; :func:`save_snapshot` gives a
file-backed :class:`Snapshot`. :func:`load_snapshot` reads a file (or a fetched state's bytes)
tensor by tensor. All are CPU-heavy (copying, hashing): call them with ``await asyncio.to_thread(...)``.
Pass tensors that nothing mutates meanwhile (the engine writes between two optimizer steps). Nothing here
uses pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import torch
from safetensors.torch import load as safetensors_load

from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.protocol.messages import StateManifest, StateVersion
from crowdtrain.volunteer.state.config import KiB, MiB

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
    """A snapshot's manifest and the file (``path``) it owns that holds its bytes."""

    manifest: StateManifest
    version: StateVersion
    path: Path

    @classmethod
    def of(cls, manifest: StateManifest, *, path: Path) -> Snapshot:
        version = StateVersion(
            step=manifest.step, content_hash=manifest.content_hash, size=manifest.total_bytes
        )
        return cls(manifest=manifest, version=version, path=path)

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def content_hash(self) -> str:
        return self.manifest.content_hash

    @property
    def size(self) -> int:
        return self.manifest.total_bytes

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of its file (blocking: call it in a thread for large spans)."""
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), end - start, start)

    def discard(self) -> None:
        """Delete its file (a snapshot no longer served)."""
        self.path.unlink(missing_ok=True)


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


def _json_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(
        f"snapshot header values must be JSON (numbers, strings, lists, dicts), not {type(obj).__name__}"
    )


_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


def _plan(tensors: dict[str, torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """The tensors to store, in name order, and aliases for names that view exactly a stored tensor (tied
    weights are stored once). Nothing is copied here: the writer copies one tensor at a time."""
    stored: list[tuple[str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in sorted(tensors):
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state entry {name!r} is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach()
        if t.dtype not in _DTYPES:
            raise TypeError(f"state entry {name!r} has dtype {t.dtype}, which a snapshot cannot hold")
        if t.numel():
            key = (
                str(t.device),
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
            )
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
        stored.append((name, t))
    return stored, aliases


class _RangeHasher:
    """sha256 of the whole stream and of each ``range_bytes`` range, fed as the bytes are written."""

    def __init__(self, range_bytes: int) -> None:
        self.range_bytes = range_bytes
        self.whole = hashlib.sha256()
        self.ranges: list[str] = []
        self._current = hashlib.sha256()
        self._filled = 0
        self.total = 0

    def update(self, data: memoryview) -> None:
        self.whole.update(data)
        self.total += len(data)
        while len(data):
            take = min(len(data), self.range_bytes - self._filled)
            self._current.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.range_bytes:
                self.ranges.append(self._current.hexdigest())
                self._current, self._filled = hashlib.sha256(), 0

    def finish(self) -> tuple[str, list[str]]:
        if self._filled:
            self.ranges.append(self._current.hexdigest())
            self._current, self._filled = hashlib.sha256(), 0
        return self.whole.hexdigest(), self.ranges


_WRITE_BYTES = 16 * MiB  # a tensor is copied to the host and written in pieces of at most this size


def _optimizer_tensors(
    model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Scalar]]]:
    """The tensors to store by name (the model's, the optimizer's per-parameter ones) and the optimizer's
    per-parameter scalars (kept in the header)."""
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
    return named, scalars


def _safetensors_header(meta: str, stored: list[tuple[str, torch.Tensor]]) -> bytes:
    """The safetensors header: each stored tensor's dtype, shape and offsets, and our metadata."""
    header: dict[str, Any] = {"__metadata__": {META_KEY: meta}}
    offset = 0
    for name, t in stored:
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % 8)  # safetensors pads its header to 8 bytes


def _write_tensor(t: torch.Tensor, put: Callable[[memoryview], None]) -> None:
    """A tensor's bytes, copied to the host and handed to ``put`` a piece of at most _WRITE_BYTES at a time."""
    flat = t.reshape(-1)
    step_elems = max(1, _WRITE_BYTES // t.element_size())
    for start in range(0, flat.numel(), step_elems):
        piece = flat[start : start + step_elems]
        if piece.device.type != "cpu":
            piece = piece.to("cpu")  # sync: one piece at a time, device→host
        piece = piece.contiguous()
        put(piece.view(torch.uint8).numpy().data)


def write_snapshot(
    out: BinaryIO,
    *,
    run_id: str,
    step: int,
    recipe: str,
    args: dict[str, int | float | str | bool],
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any] | None,
    range_bytes: int = 4 * MiB,
) -> StateManifest:
    """Write a volunteer's state (``optimizer_state`` is ``optimizer.state_dict()``) as one safetensors
    file to ``out``, straight from the tensors: each is copied to the host a piece at a time, so the
    snapshot never exists as a second copy in memory. Returns its manifest (hashes computed while writing).

    The tensors may be live (on any device) as long as nothing changes them until this returns: the engine
    writes between two optimizer steps. CPU-heavy and blocking: run it in a thread.
    """
    _check_range_bytes(range_bytes)
    named, scalars = _optimizer_tensors(model_state, optimizer_state)
    stored, aliases = _plan(named)
    header_values = {
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
    meta = json.dumps(header_values, default=_json_default, sort_keys=True, allow_nan=False)
    hasher = _RangeHasher(range_bytes)

    def put(data: memoryview) -> None:
        hasher.update(data)
        out.write(data)

    encoded = _safetensors_header(meta, stored)
    put(memoryview(len(encoded).to_bytes(8, "little")))
    put(memoryview(encoded))
    for _, t in stored:
        _write_tensor(t, put)
    content_hash, ranges = hasher.finish()
    return StateManifest(
        run_id=run_id,
        step=step,
        content_hash=content_hash,
        total_bytes=hasher.total,
        range_bytes=range_bytes,
        range_sha256=ranges,
    )


def save_snapshot(path: Path, **fields: Any) -> Snapshot:
    """:func:`write_snapshot` into the file ``path`` (replaced atomically): a file-backed :class:`Snapshot`."""
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            manifest = write_snapshot(f, **fields)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return Snapshot.of(manifest, path=path)


def _read_header(data: bytes) -> tuple[SnapshotHeader, dict[str, Any], int]:
    """The crowdtrain header, the safetensors tensor table and where the tensor data starts, from the
    first bytes of a snapshot (at least the whole safetensors header)."""
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
    table = {k: v for k, v in raw.items() if k != "__metadata__"}
    return header, table, 8 + size


def _assemble(header: SnapshotHeader, tensors: dict[str, torch.Tensor]) -> LoadedState:
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


def read_snapshot_header(path: Path) -> SnapshotHeader:
    """The crowdtrain header of a snapshot file (its step, run, recipe), without reading its tensors."""
    with open(path, "rb") as f:
        header, _ = _read_table(f)
    return header


def _read_table(
    f: BinaryIO,
) -> tuple[SnapshotHeader, list[tuple[str, torch.dtype, list[int], int]]]:
    """The header and every tensor's (name, dtype, shape, data offset) of an open snapshot file, in file
    order, each checked against the file's size."""
    total = os.fstat(f.fileno()).st_size
    first = f.read(8)
    size = int.from_bytes(first, "little") if len(first) == 8 else 0
    head = first + f.read(min(size, 100 * MiB))
    header, table, base = _read_header(head)
    entries = []
    expected = 0
    for name, entry in sorted(table.items(), key=lambda kv: _offsets(kv[0], kv[1])[0]):
        begin, end = _offsets(name, entry)
        dtype = _TORCH_DTYPES.get(str(entry.get("dtype"))) if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (
            dtype is None
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise ProtocolError(f"state snapshot tensor {name!r} has a bad dtype or shape")
        if begin != expected or end - begin != math.prod(shape) * dtype.itemsize or base + end > total:
            raise ProtocolError(f"state snapshot tensor {name!r} has bad data offsets")
        expected = end
        entries.append((name, dtype, shape, base + begin))
    if base + expected != total:
        raise ProtocolError("state snapshot has bytes after its last tensor")
    return header, entries


def load_snapshot(source: bytes | Path, *, into: Mapping[str, torch.Tensor] | None = None) -> LoadedState:
    """Parse a snapshot (from a peer: already checked against the content hash) without pickle: its bytes,
    or a file, read tensor by tensor into fresh tensors (never held twice in memory).

    ``into`` (a file only): the live model's ``state_dict()`` tensors. When the snapshot's model tensors
    match them one for one (names, dtypes, shapes; contiguous CPU tensors), they are read straight into
    them, and the returned ``model_state`` holds those very tensors: loading a state then costs no copy of
    the model beside the model. The whole table is checked first, so a snapshot that does not match
    changes nothing (it is read into fresh tensors as without ``into``).

    CPU-heavy and blocking: call ``await asyncio.to_thread(load_snapshot, source)``.
    """
    if not isinstance(source, Path):
        header, _, _ = _read_header(source)
        try:
            tensors = safetensors_load(source)  # safetensors, never pickle
        except Exception as exc:  # safetensors raises its own SafetensorError for any defect
            raise ProtocolError(f"state snapshot is not a valid safetensors file ({exc})") from None
        return _assemble(header, tensors)
    with open(source, "rb") as f:
        header, entries = _read_table(f)
        live = _live_targets(header, entries, into) if into is not None else {}
        tensors = {}
        for name, dtype, shape, offset in entries:
            t = live.get(name)
            if t is None:
                t = torch.empty(shape, dtype=dtype)
            view = t.view(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
            f.seek(offset)
            if f.readinto(view) != len(view):
                raise ProtocolError(f"state snapshot ends inside tensor {name!r}")
            tensors[name] = t
    return _assemble(header, tensors)


def _live_targets(
    header: SnapshotHeader,
    entries: list[tuple[str, torch.dtype, list[int], int]],
    into: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Stored model tensor name → the live tensor to read it into; empty unless they match one for one."""
    stored = {name: (dtype, shape) for name, dtype, shape, _ in entries if name.startswith(MODEL_PREFIX)}
    names = set(stored) | {a for a in header.aliases if a.startswith(MODEL_PREFIX)}
    if names != {MODEL_PREFIX + k for k in into}:
        return {}
    live = {}
    for name, (dtype, shape) in stored.items():
        t = into[name[len(MODEL_PREFIX) :]]
        if t.device.type != "cpu" or t.dtype != dtype or list(t.shape) != shape or not t.is_contiguous():
            return {}
        live[name] = t
    return live


def _offsets(name: str, entry: Any) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise ProtocolError(f"state snapshot tensor {name!r} has no valid data_offsets")
    return offsets[0], offsets[1]
