"""State snapshots for the tests, as the product holds them: files (``save_snapshot``) in a test's folder.

:func:`make_snapshot` writes a volunteer's state the product's way; :func:`snapshot_file` serves any bytes
under any manifest, so that a test can flip them, cut them or lie about them; :func:`content` reads a
snapshot's bytes back. :func:`manifest_of` hashes bytes into a manifest on its own (plain ``hashlib`` over
each range), so that a snapshot's manifest, hashed by the writer while it streams, is checked against a
second computation.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from crowdtrain.protocol.messages import StateManifest
from crowdtrain.volunteer.state.config import MiB
from crowdtrain.volunteer.state.snapshot import Snapshot, save_snapshot


def _new_file(directory: Path) -> Path:
    fd, name = tempfile.mkstemp(dir=directory, prefix="state-", suffix=".safetensors")
    os.close(fd)
    return Path(name)


def make_snapshot(directory: Path, **fields: Any) -> Snapshot:
    """:func:`save_snapshot` into a new file in ``directory`` (``fields`` as it takes them)."""
    return save_snapshot(_new_file(directory), **fields)


def snapshot_file(directory: Path, data: bytes, manifest: StateManifest) -> Snapshot:
    """A :class:`Snapshot` of ``manifest`` whose file in ``directory`` holds ``data``, true to it or not."""
    path = _new_file(directory)
    path.write_bytes(data)
    return Snapshot.of(manifest, path=path)


def content(snapshot: Snapshot) -> bytes:
    """The bytes of a snapshot's file."""
    return snapshot.path.read_bytes()


def manifest_of(data: bytes, *, run_id: str, step: int, range_bytes: int = 4 * MiB) -> StateManifest:
    """The manifest of any ``data``: the sha256 of the whole and of each ``range_bytes`` range."""
    ranges = [hashlib.sha256(data[a : a + range_bytes]).hexdigest() for a in range(0, len(data), range_bytes)]
    return StateManifest(
        run_id=run_id,
        step=step,
        content_hash=hashlib.sha256(data).hexdigest(),
        total_bytes=len(data),
        range_bytes=range_bytes,
        range_sha256=ranges,
    )
