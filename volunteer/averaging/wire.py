"""The all-reduce wire: headers of a part request and streams of bounded tensor sub-frames.

A part travels as frames of at most ``subframe_elements`` values each (see
:mod:`crowdtrain.protocol.frames`), one after another in one HTTP body. The reader takes one frame at a
time with sizes checked before reading, so no body is ever joined in memory.
"""

from __future__ import annotations

import asyncio
import math
import threading
import zlib
from collections.abc import Callable

import numpy as np
from aiohttp import StreamReader
from crowdtrain.protocol.codecs import Codec, Compressor, ErrorFeedback, raw_size, untransform
from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.protocol.frames import HEADER_SIZE, FrameHeader, encode_raw_frame, pack_header, parse_header
from crowdtrain.volunteer.averaging.config import AveragingConfig

HEADER_WEIGHT = "X-Crowdtrain-Weight"
HEADER_ELEMENTS = "X-Crowdtrain-Elements"
PURPOSE = "allreduce"


class Coder:
    """Encodes and decodes sub-frames in worker threads, one zstd context per thread."""

    def __init__(self, config: AveragingConfig) -> None:
        self.config = config
        self._local = threading.local()

    def _compressor(self) -> Compressor:
        c = getattr(self._local, "compressor", None)
        if c is None:
            c = self._local.compressor = Compressor(self.config.zstd_level, self.config.limits)
        return c

    def encode(self, values: np.ndarray, residual: np.ndarray | None = None) -> bytes:
        """One frame of ``values`` in the configured codec (call in a thread)."""
        return self.encode_sent(values, residual)[0]

    def encode_sent(self, values: np.ndarray, residual: np.ndarray | None = None) -> tuple[bytes, np.ndarray]:
        """One frame of ``values`` and the values its receiver will decode (call in a thread).

        With a lossy codec and a ``residual`` slice, the quantisation error is fed back: ``residual`` is
        added before encoding and updated in place with what this encode dropped.
        """
        codec = self.config.codec
        if not codec.lossy:
            # zstd reads the float32 memory directly: no intermediate bytes copy
            body = self._compressor().compress(memoryview(np.ascontiguousarray(values)).cast("B"))
            return pack_header(codec, (values.size,), 4 * values.size, body) + body, values
        feedback = ErrorFeedback(codec)
        if residual is not None:
            feedback.residual = residual
        raw, sent = feedback.transform(values)
        if residual is not None:
            residual[:] = feedback.residual
        return encode_raw_frame(raw, codec, (values.size,), self._compressor()), sent

    def decode_into(self, header: FrameHeader, body: bytes, out: np.ndarray) -> float:
        """Decode one frame body into ``out``; return the squared L2 norm. Raises on non-finite values."""
        if len(body) != header.encoded_length:
            raise ProtocolError(
                f"frame body holds {len(body)} bytes but its header declares {header.encoded_length}"
            )
        if zlib.crc32(body) != header.crc32:
            raise ProtocolError("frame body fails its crc32 checksum; it was corrupted in transit")
        n = header.numel
        raw = self._compressor().decompress(body, raw_size(header.codec, n))
        if header.codec is Codec.NONE:
            out[:] = np.frombuffer(raw, dtype=np.float32)
        else:
            out[:] = untransform(raw, header.codec, n)
        with np.errstate(over="ignore", invalid="ignore"):
            norm2 = float(np.dot(out, out))  # finite only if every value is: one pass for both
        if not math.isfinite(norm2):
            if not np.isfinite(out).all():
                raise NonFinite("contribution holds NaN or infinite values; check the sender's gradients")
            wide = out.astype(np.float64)  # finite but its square overflowed float32
            norm2 = float(np.dot(wide, wide))
        return norm2


class NonFinite(ProtocolError):
    """A frame decoded to NaN or infinite values."""


async def read_part(
    stream: StreamReader,
    coder: Coder,
    elements: int,
    out_for: Callable[[int, int], np.ndarray],
) -> tuple[float, int]:
    """Read ``elements`` values as sub-frames from ``stream`` into ``out_for(start, stop)``.

    Returns (squared norm, bytes read). Every size is checked before anything is read; the stream must end
    right after the last frame. The caller bounds the whole read with a timeout.
    """
    config = coder.config
    got = 0
    nbytes = 0
    norm2 = 0.0
    while got < elements:
        head = await stream.readexactly(HEADER_SIZE)
        header = parse_header(head, config.limits)
        if header.codec is not config.codec:
            raise ProtocolError(
                f"frame uses codec {header.codec.label} but this round uses {config.codec.label}"
            )
        n = header.numel
        if len(header.shape) != 1 or n < 1 or n > config.subframe_elements:
            raise ProtocolError(
                f"sub-frame has shape {list(header.shape)}; expected one dimension of 1 to "
                f"{config.subframe_elements} values"
            )
        if got + n > elements:
            raise ProtocolError(
                f"sub-frames carry more than the {elements} values this part holds; check the part bounds"
            )
        if header.encoded_length > config.max_body_bytes(n):
            raise ProtocolError(
                f"sub-frame body declares {header.encoded_length} bytes, more than {n} values can need"
            )
        body = await stream.readexactly(header.encoded_length)
        nbytes += HEADER_SIZE + len(body)
        norm2 += await asyncio.to_thread(coder.decode_into, header, body, out_for(got, got + n))
        got += n
    tail = await stream.read(1)
    if tail:
        raise ProtocolError(f"body continues after the {elements} values this part holds")
    return norm2, nbytes


def subframe_bounds(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


__all__ = [
    "HEADER_ELEMENTS",
    "HEADER_WEIGHT",
    "PURPOSE",
    "Coder",
    "NonFinite",
    "read_part",
    "subframe_bounds",
]
