"""State snapshots for the tests, in memory: what a volunteer writes to a file (``save_snapshot``), held as
bytes so that a test can flip them, cut them or serve them from several donors at once.

:func:`describe` hashes bytes into a manifest on its own (plain ``hashlib`` over each range), so that a
snapshot's manifest, hashed by the writer while it streams, is checked against a second computation.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

from crowdtrain.protocol.messages import StateManifest
from crowdtrain.volunteer.state.config import MiB
from crowdtrain.volunteer.state.snapshot import Snapshot, write_snapshot


def make_snapshot(**fields: Any) -> Snapshot:
    """:func:`write_snapshot` into memory: a :class:`Snapshot` holding its bytes (``fields`` as it takes them)."""
    buffer = io.BytesIO()
    manifest = write_snapshot(buffer, **fields)
    return Snapshot.of(manifest, data=buffer.getvalue())


def describe(data: bytes, *, run_id: str, step: int, range_bytes: int = 4 * MiB) -> Snapshot:
    """A :class:`Snapshot` of any ``data``: the sha256 of the whole and of each ``range_bytes`` range."""
    ranges = [hashlib.sha256(data[a : a + range_bytes]).hexdigest() for a in range(0, len(data), range_bytes)]
    manifest = StateManifest(
        run_id=run_id,
        step=step,
        content_hash=hashlib.sha256(data).hexdigest(),
        total_bytes=len(data),
        range_bytes=range_bytes,
        range_sha256=ranges,
    )
    return Snapshot.of(manifest, data=data)
