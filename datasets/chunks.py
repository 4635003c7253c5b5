"""The chunk file format: one ``.npy`` file per chunk, self-describing and safe to load.

* ``tokens`` sets: a 1-D array of token ids (``uint8`` for byte-level text); samples = tokens.
* ``arrays`` sets: a 1-D structured array with fields ``x`` (one sample's shape) and, for supervised sets,
  ``y``; samples = rows.

``.npy`` is chosen because its header carries dtype and shape (the file describes itself), numpy reads it
without pickle (``allow_pickle=False``), and it is byte-for-byte deterministic, so the same input always
gives the same info-hash. A chunk is only ever loaded after its sha256 matched the manifest.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np

from crowdtrain.protocol.errors import DatasetError
from crowdtrain.protocol.messages import ChunkInfo, DatasetManifest

MANIFEST_NAME = "manifest.json"


def chunk_name(index: int) -> str:
    return f"chunk-{index:05d}.npy"


def header_bytes(dtype: np.dtype, count: int) -> int:
    """Size of the ``.npy`` header numpy writes for ``count`` rows of ``dtype``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)}
    )
    return buf.tell()


def samples_per_chunk(dtype: np.dtype, chunk_bytes: int) -> int:
    """How many rows of ``dtype`` fit in a chunk file of at most ``chunk_bytes`` bytes (0 if none fit)."""
    guess = max(0, (chunk_bytes - 128) // dtype.itemsize)
    while guess > 0 and header_bytes(dtype, guess) + guess * dtype.itemsize > chunk_bytes:
        guess -= 1
    return guess


def encode_chunk(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def expected_dtype(manifest: DatasetManifest) -> np.dtype:
    """The dtype every chunk of ``manifest`` must have."""
    try:
        if manifest.kind == "tokens":
            return np.dtype(manifest.dtype)
        fields: list[tuple] = [("x", np.dtype(manifest.dtype), tuple(manifest.sample_shape))]
        if manifest.label_dtype is not None:
            fields.append(("y", np.dtype(manifest.label_dtype)))
        return np.dtype(fields)
    except TypeError as exc:
        raise DatasetError(
            f"Manifest of data set {manifest.name!r} names a dtype numpy does not know ({exc}); "
            "the manifest is damaged or from a newer crowdtrain."
        ) from None


def expected_header(dtype: np.dtype, samples: int) -> bytes:
    """The exact .npy (version 1.0) header ``np.save`` writes for a 1-D array of ``samples`` x ``dtype``."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        out, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (samples,)}
    )
    return out.getvalue()


def load_chunk(
    path: Path, info: ChunkInfo, manifest: DatasetManifest, *, check_hash: bool = True, mmap: bool = False
) -> np.ndarray:
    """Read one chunk file, refusing anything that does not match the manifest.

    The sha256 is checked first (the file must be exactly what the publisher made); then the header is
    parsed with a bounded size, and dtype and row count must be those the manifest promises. With ``mmap``
    the result maps the file read-only instead of holding its bytes.
    """
    try:
        size = path.stat().st_size
        if size != info.bytes:
            raise DatasetError(
                f"Chunk {info.name} is {size} bytes on disk but the manifest says {info.bytes}; "
                "it is incomplete or damaged, fetch it again."
            )
        data = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"Cannot read chunk {path}: {exc.strerror or exc}.") from None
    if check_hash and hashlib.sha256(data).hexdigest() != info.sha256:
        raise DatasetError(
            f"Chunk {info.name} does not match the sha256 in the manifest; it is damaged, fetch it again."
        )
    # The header must be exactly what numpy writes for the manifest's dtype and sample count. Comparing
    # bytes, rather than parsing the header (numpy parses it with ast.literal_eval), needs no parser at all;
    # CPython 3.11.7's AST counter also breaks when two threads parse at once (gh-106905).
    want = expected_dtype(manifest)
    header = expected_header(want, info.samples)
    if not data.startswith(header):
        raise DatasetError(
            f"Chunk {info.name} does not start with the .npy header of ({info.samples},) {want} that the "
            "manifest promises; the data set is inconsistent or the file is damaged."
        )
    offset = len(header)
    if offset + info.samples * want.itemsize != len(data):
        raise DatasetError(
            f"Chunk {info.name} has {len(data) - offset} data bytes, not what its header says."
        )
    if mmap:  # the bytes were checked; keep only a read-only mapping of them in memory
        return np.memmap(path, dtype=want, mode="r", offset=offset, shape=(info.samples,))
    return np.frombuffer(data, dtype=want, count=info.samples, offset=offset)


def max_token_id(manifest: DatasetManifest, folder: Path) -> int:
    """The largest token id in a tokens data set's chunks (each checked against the manifest as it is read);
    -1 for a set without tokens."""
    top = -1
    for info in manifest.chunks:
        chunk = load_chunk(folder / info.name, info, manifest, mmap=True)
        if chunk.size:
            top = max(top, int(chunk.max()))
    return top
