"""Tensor frames for the tests: built from the protocol's own pieces, read back by the product's one decoder.

:func:`encode_frame` makes a frame of any shape and codec the way a peer's encoder does (value transform,
zstd or stored, header), so that a test can send what a broken or hostile peer would. :func:`read_frames`
reads a body of frames with the all-reduce's reader (:func:`~crowdtrain.volunteer.averaging.wire.read_part`),
the only decoder of frames in the product, fed as the network would feed it: in chunks cut anywhere.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
from aiohttp import StreamReader
from aiohttp.base_protocol import BaseProtocol

from crowdtrain.protocol.codecs import Codec, Compressor, raw_size, transform
from crowdtrain.protocol.frames import pack_header
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.wire import Coder, KeptPart, read_part, subframe_bounds


def encode_frame(x: np.ndarray, codec: Codec, compressor: Compressor | None = None) -> bytes:
    """One frame (header + body) of a float32 array of any shape (a scalar travels as shape ``(1,)``)."""
    shape = tuple(x.shape) or (1,)
    body = (compressor or Compressor()).pack(transform(x, codec))
    return pack_header(codec, shape, raw_size(codec, math.prod(shape)), body) + bytes(body)


def encode_part(values: np.ndarray, config: AveragingConfig) -> bytes:
    """A part as a peer sends it: sub-frames of ``config.frame_elements`` values in the round's codec."""
    coder = Coder(config)
    frames = [coder.encode(values[a:b]) for a, b in subframe_bounds(0, values.size, config.frame_elements)]
    return b"".join(header + bytes(body) for header, body in frames)


async def _read(
    chunks: Sequence[bytes], config: AveragingConfig, elements: int, kept: bool
) -> tuple[np.ndarray, float, int]:
    stream = StreamReader(BaseProtocol(asyncio.get_running_loop()), 1 << 20)
    for chunk in chunks:
        if chunk:
            stream.feed_data(chunk)
    stream.feed_eof()
    coder = Coder(config)
    step = config.frame_elements
    if kept:
        storage = np.zeros(KeptPart.nbytes(config.codec, elements, step), dtype=np.uint8)
        part = KeptPart(config.codec, elements, step, storage)
        norm2, nbytes = await read_part(stream, coder, elements, part)
        bounds = subframe_bounds(0, elements, step)
        values = np.concatenate([part.values(a, b) for a, b in bounds]) if bounds else np.zeros(0, np.float32)
        return values, norm2, nbytes
    values = np.full(elements, np.nan, dtype=np.float32)  # a value the reader did not write stays NaN
    norm2, nbytes = await read_part(stream, coder, elements, lambda a, b: values[a:b])
    return values, norm2, nbytes


def read_frames(
    buf: bytes,
    config: AveragingConfig,
    elements: int,
    *,
    kept: bool = False,
    cuts: Sequence[int] = (),
) -> tuple[np.ndarray, float, int]:
    """``(values, squared norm, bytes read)`` of a body of ``elements`` values, read by ``read_part``: into
    float32 values, or (``kept``) into a :class:`KeptPart` as a lossy codec's part owner keeps it, then
    decoded. ``cuts``: where the body is cut into the chunks the reader receives (offsets, any order).

    Raises what ``read_part`` raises: :class:`ProtocolError` for what it refuses, and
    :class:`asyncio.IncompleteReadError` for a body that ends early."""
    edges = sorted({0, len(buf), *(c % (len(buf) + 1) for c in cuts)})
    chunks = [buf[a:b] for a, b in pairwise(edges)]
    return asyncio.run(_read(chunks, config, elements, kept))
