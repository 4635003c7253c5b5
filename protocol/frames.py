"""Tensor frames: a fixed 96-byte header, then the codec's body: zstd, or the raw payload itself ("stored")
when zstd would not pay (``Compressor.pack``). A stored body is exactly ``raw length`` bytes long and a
zstd body from ``pack`` never is, so the header's lengths tell the two apart.

Header (little endian)::

    offset size  field
    0      4     magic b"CTFR"
    4      1     version (2; version 1 had a zlib CRC-32 and 4 reserved bytes where the checksum is)
    5      1     codec id (see codecs.Codec)
    6      1     dtype id (0 = float32, the only dtype on the wire)
    7      1     ndim (1..8)
    8      64    shape, 8 x u64 (unused dims are 0)
    72     8     raw length: bytes after the value transform, before zstd
    80     8     encoded length: bytes of the body that follows the header
    88     8     XXH3-64 of the body (seed 0)

Every length is checked against :class:`~crowdtrain.protocol.limits.Limits` and against the others before
anything is allocated (:func:`parse_header`); the checksum is verified before decompression (:func:`payload`).
A large tensor travels as several frames one after another (a stream of bounded sub-frames), each decodable
on its own: the all-reduce's reader (``volunteer/averaging/wire.py``) is the one decoder of such streams.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import xxhash

from crowdtrain.protocol.codecs import BytesLike, Codec, Compressor, raw_size
from crowdtrain.protocol.errors import LimitExceeded, ProtocolError
from crowdtrain.protocol.limits import DEFAULT_LIMITS, Limits

MAGIC = b"CTFR"
VERSION = 2
DTYPE_FLOAT32 = 0
_HEADER = struct.Struct("<4sBBBB8QQQQ")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 96


@dataclass(frozen=True, slots=True)
class FrameHeader:
    codec: Codec
    shape: tuple[int, ...]
    raw_length: int
    encoded_length: int
    checksum: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parse_header(buf: BytesLike, limits: Limits = DEFAULT_LIMITS) -> FrameHeader:
    """Parse and check a frame header; raises :class:`ProtocolError` naming what is wrong."""
    if len(buf) < HEADER_SIZE:
        raise ProtocolError(f"frame header needs {HEADER_SIZE} bytes, got {len(buf)}")
    magic, version, codec_id, dtype, ndim, *rest = _HEADER.unpack_from(buf)
    dims, (raw_len, enc_len, digest) = rest[:8], rest[8:]
    if magic != MAGIC:
        raise ProtocolError("frame does not start with the crowdtrain magic b'CTFR'")
    if version != VERSION:
        raise ProtocolError(f"frame version {version} is not supported (this peer speaks {VERSION})")
    try:
        codec = Codec(codec_id)
    except ValueError:
        raise ProtocolError(f"frame names unknown codec id {codec_id}") from None
    if dtype != DTYPE_FLOAT32:
        raise ProtocolError(f"frame names unknown dtype id {dtype}; only float32 (0) is allowed")
    if not 1 <= ndim <= limits.max_ndim:
        raise ProtocolError(f"frame has {ndim} dimensions; 1 to {limits.max_ndim} are allowed")
    if any(dims[ndim:]):
        raise ProtocolError("frame header has non-zero dimensions past its ndim")
    shape = tuple(dims[:ndim])
    if max(shape) > limits.max_elements:  # also keeps (0, 2**63) away from numpy, which cannot shape it
        raise LimitExceeded(
            f"frame declares a dimension of {max(shape)}, more than the limit of {limits.max_elements} elements"
        )
    numel = 1
    for d in shape:
        numel *= d
        if numel > limits.max_elements:
            raise LimitExceeded(f"frame declares more than the limit of {limits.max_elements} elements")
    if raw_len != raw_size(codec, numel):
        raise ProtocolError(
            f"frame declares {raw_len} raw bytes but {numel} values in codec {codec.label} need "
            f"{raw_size(codec, numel)}"
        )
    if enc_len > limits.max_frame_bytes:
        raise LimitExceeded(
            f"frame body declares {enc_len} bytes, more than the limit of {limits.max_frame_bytes}"
        )
    return FrameHeader(codec, shape, raw_len, enc_len, digest)


def checksum(body: bytes | bytearray | memoryview) -> int:
    """XXH3-64 of a frame body: 30–65 GB/s here (zlib's CRC-32 does ~5, a hardware CRC-32C 15–22), so
    checking every byte of a round costs little next to moving it; 64 bits let a corrupted body through
    with a chance of 2⁻⁶⁴."""
    return xxhash.xxh3_64_intdigest(body)


def pack_header(codec: Codec, shape: tuple[int, ...], raw_length: int, body: bytes | memoryview) -> bytes:
    """The header for ``body`` (bytes, or a byte-format memoryview: its length is its byte count)."""
    body = memoryview(body).cast("B")
    dims = list(shape) + [0] * (8 - len(shape))
    return _HEADER.pack(
        MAGIC, VERSION, int(codec), DTYPE_FLOAT32, len(shape), *dims, raw_length, body.nbytes, checksum(body)
    )


def check_body(header: FrameHeader, body: BytesLike) -> None:
    """Check a frame body against its header (its length, then its checksum); :class:`ProtocolError` if
    either is wrong. A body read straight into its destination is checked there, before its values count."""
    if len(body) != header.encoded_length:
        raise ProtocolError(
            f"frame body holds {len(body)} bytes but its header declares {header.encoded_length}"
        )
    if checksum(body) != header.checksum:
        raise ProtocolError("frame body fails its XXH3-64 checksum; it was corrupted in transit")


def payload(header: FrameHeader, body: BytesLike, compressor: Compressor) -> BytesLike:
    """The codec's payload of a frame (``header.raw_length`` bytes, ``header.numel`` values): the body checked
    (:func:`check_body`), then decompressed, or taken as it is when it is stored. Never more than the
    header's raw length is allocated, and that was bounded by :func:`parse_header`."""
    check_body(header, body)
    return compressor.decompress(body, header.raw_length)
