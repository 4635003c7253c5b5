"""The all-reduce wire: headers of a part request and streams of bounded tensor sub-frames.

A part travels as frames of at most ``subframe_elements`` values each (see
:mod:`crowdtrain.protocol.frames`), one after another in one HTTP body. The reader takes one frame at a
time with sizes checked before reading, so no body is ever joined in memory; received chunks are copied
once, straight to where they belong (a stored codec-none body into the destination values), and a frame
is decoded in a thread while the next one arrives.

Codec none skips zstd when it does not pay (``AveragingConfig.zstd_min_gain``): the body is then the
fp32 bytes as they are, which the frame header shows by an encoded length equal to the raw length. A whole
part judged dense (:meth:`Coder.stores`) is sent as such stored frames with a known length
(:func:`stored_length`), each body a view of the sender's values (:func:`stored_frame`).
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
from collections.abc import Callable

import numpy as np
from aiohttp import StreamReader

from crowdtrain.protocol.codecs import Codec, Compressor, ErrorFeedback, Residual, raw_size, untransform
from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.protocol.frames import (
    HEADER_SIZE,
    FrameHeader,
    check_body,
    pack_header,
    parse_header,
    payload,
)
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
            cfg = self.config
            min_gain = 0.0 if cfg.codec.lossy else cfg.zstd_min_gain
            c = self._local.compressor = Compressor(cfg.zstd_level, cfg.limits, min_gain)
        return c

    def stores(self, values: np.ndarray) -> bool:
        """True when ``values`` (a whole part) go stored: codec none, and a sample shows zstd would not
        save ``zstd_min_gain`` of the bytes (dense fp32). A stored part has a length known before it is
        sent, so it travels with a Content-Length straight from the caller's memory (see
        :func:`stored_frames`) instead of as chunks that aiohttp joins into new bytes."""
        if self.config.codec is not Codec.NONE:
            return False
        return self._compressor().stores(np.ascontiguousarray(values).data.cast("B"))

    def encode(
        self, values: np.ndarray, residual: Residual | None = None
    ) -> tuple[bytes, bytes | memoryview]:
        """One frame of ``values`` in the configured codec as (header, body) (call in a thread)."""
        header, body, _ = self.encode_sent(values, residual)
        return header, body

    def encode_sent(
        self, values: np.ndarray, residual: Residual | None = None, *, stored: bool = False
    ) -> tuple[bytes, bytes | memoryview, np.ndarray]:
        """One frame of ``values`` as (header, body) and the values its receiver will decode (in a thread).

        With a lossy codec and a ``residual`` (of ``values``' length), the quantisation error is fed back:
        ``residual`` is added before encoding and then keeps what this encode dropped. ``stored`` (codec none
        only): the body is a copy of the fp32 bytes, never compressed, so the frame's length is known
        before it is encoded.
        """
        header, body, sent, _ = self.encode_raw(values, residual, stored=stored)
        return header, body, sent

    def encode_raw(
        self, values: np.ndarray, residual: Residual | None = None, *, stored: bool = False
    ) -> tuple[bytes, bytes | memoryview, np.ndarray, bytes | None]:
        """:meth:`encode_sent`, and the codec's payload before zstd (None for codec none): what its
        receiver decodes, kept in the codec's size (:func:`untransform` gives the values back)."""
        codec = self.config.codec
        if not codec.lossy:
            fp32 = np.ascontiguousarray(values).data.cast("B")
            if stored:
                body: bytes | memoryview = fp32.tobytes()
            else:  # zstd (or the stored body) reads the float32 memory directly: no intermediate copy
                body = self._compressor().pack(fp32)
            return pack_header(codec, (values.size,), len(fp32), body), body, values, None
        feedback = ErrorFeedback(codec)
        if residual is not None:
            feedback.residual = residual.values()
        raw, sent = feedback.transform(values)
        if residual is not None and feedback.residual is not None:  # (transform always leaves one)
            residual.keep(feedback.residual)
        body = self._compressor().pack(raw)
        return pack_header(codec, (values.size,), len(raw), body), body, sent, raw

    def decode_into(self, header: FrameHeader, body: bytes | bytearray | None, out: np.ndarray) -> float:
        """Decode one frame body into ``out``; return the squared L2 norm. Raises on non-finite values.

        ``body`` None: the frame is a stored codec-none body that :func:`read_part` already read straight
        into ``out``'s memory; only its checksum and values are checked here.
        """
        if body is None:
            if header.codec is not Codec.NONE or header.encoded_length != 4 * header.numel:
                raise ProtocolError("internal: only a stored codec-none body can be read in place")
            check_body(header, out.data.cast("B"))
        else:
            raw = payload(header, body, self._compressor())
            if header.codec is Codec.NONE:
                out[:] = np.frombuffer(raw, dtype=np.float32)
            else:
                out[:] = untransform(raw, header.codec, header.numel)
        return _norm2(out)

    def decode_kept(self, header: FrameHeader, body: bytes | bytearray, kept: KeptPart, start: int) -> float:
        """Keep one frame's payload in ``kept`` at value ``start`` as the codec wrote it; return the squared
        L2 norm of the values it decodes to. Raises on non-finite values."""
        raw = payload(header, body, self._compressor())
        kept.slot(start, start + header.numel)[:] = np.frombuffer(raw, dtype=np.uint8)
        return _norm2(untransform(raw, header.codec, header.numel))


def _norm2(values: np.ndarray) -> float:
    """The squared L2 norm of float32 ``values``; :class:`NonFinite` if one of them is NaN or infinite."""
    with np.errstate(over="ignore", invalid="ignore"):
        norm2 = float(np.dot(values, values))  # finite only if every value is: one pass for both
    if not math.isfinite(norm2):
        if not np.isfinite(values).all():
            raise NonFinite("contribution holds NaN or infinite values; check the sender's gradients")
        wide = values.astype(np.float64)  # finite but its square overflowed float32
        norm2 = float(np.dot(wide, wide))
    return norm2


class KeptPart:
    """A received copy of a part held in its codec's payload (int8: about 1 byte a value, fp16/bf16: 2, sparse: 0.055)
    instead of float32, until the owner reduces it: a part owner holds every member's copy of its part, and
    decoding each slice once more when it is reduced costs less than holding 4 bytes a value.

    Frames sit at fixed places: frame ``k`` holds values ``[k·step, min((k+1)·step, length))``, as every
    sender cuts a part (:func:`subframe_bounds` with the run's ``subframe_elements``), and the owner reduces
    the part in the same slices. ``storage`` is a byte buffer of at least :meth:`nbytes`; it is reused.
    """

    __slots__ = ("_frame", "codec", "length", "step", "storage")

    def __init__(self, codec: Codec, length: int, step: int, storage: np.ndarray) -> None:
        self.codec = codec
        self.length = length
        self.step = step
        self.storage = storage
        self._frame = raw_size(codec, step)  # bytes of a full frame's payload

    @staticmethod
    def nbytes(codec: Codec, length: int, step: int) -> int:
        full, rest = divmod(length, step)
        return full * raw_size(codec, step) + (raw_size(codec, rest) if rest else 0)

    def _where(self, a: int, b: int) -> int:
        if a % self.step or b != min(a + self.step, self.length):
            raise ProtocolError(
                f"sub-frame of values {a}..{b} does not start a frame of this part: frames hold "
                f"{self.step} values each (the last the rest of {self.length})"
            )
        return a // self.step * self._frame

    def slot(self, a: int, b: int) -> np.ndarray:
        """The bytes that hold the payload of the frame of values ``[a, b)``."""
        at = self._where(a, b)
        return self.storage[at : at + raw_size(self.codec, b - a)]

    def values(self, a: int, b: int) -> np.ndarray:
        """Values ``[a, b)`` (one frame) decoded, as a new float32 array."""
        return untransform(self.slot(a, b).data, self.codec, b - a)


class NonFinite(ProtocolError):
    """A frame decoded to NaN or infinite values."""


class _Reader:
    """Exact reads from an aiohttp stream into memory the caller gives: each received chunk is copied once,
    straight to where it belongs (``StreamReader.readexactly`` joins chunks, twice for a large read)."""

    def __init__(self, stream: StreamReader) -> None:
        self.stream = stream
        self.chunk = b""  # the last chunk received; bytes before ``offset`` are consumed
        self.offset = 0

    async def _fill(self) -> bool:
        """Make sure unconsumed bytes are at hand; False at the end of the body."""
        while self.offset >= len(self.chunk):
            if self.stream.at_eof():  # also the empty body's reader, whose readchunk never says "end"
                return False
            data, end_of_http_chunk = await self.stream.readchunk()
            if data:
                self.chunk, self.offset = data, 0
            elif not end_of_http_chunk:
                return False
        return True

    async def readinto(self, dest: np.ndarray) -> None:
        """Fill ``dest`` (a flat uint8 array) from the stream."""
        pos, n = 0, dest.size
        while pos < n:
            if not await self._fill():
                raise asyncio.IncompleteReadError(dest[:pos].tobytes(), n)
            k = min(len(self.chunk) - self.offset, n - pos)
            # numpy copies at memcpy speed; a memoryview slice assignment is ~15x slower
            dest[pos : pos + k] = np.frombuffer(self.chunk, np.uint8, count=k, offset=self.offset)
            self.offset += k
            pos += k

    async def readexactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.readinto(np.frombuffer(buf, np.uint8))
        return buf

    async def at_end(self) -> bool:
        return not await self._fill()


def _checked_subframe(header: FrameHeader, coder: Coder, got: int, elements: int) -> int:
    """The sub-frame's value count, once its codec, shape and body length fit the round and the part."""
    config = coder.config
    if header.codec is not config.codec:
        raise ProtocolError(f"frame uses codec {header.codec.label} but this round uses {config.codec.label}")
    n = header.numel
    if len(header.shape) != 1 or n < 1 or n > config.frame_elements:
        raise ProtocolError(
            f"sub-frame has shape {list(header.shape)}; expected one dimension of 1 to "
            f"{config.frame_elements} values"
        )
    if got + n > elements:
        raise ProtocolError(
            f"sub-frames carry more than the {elements} values this part holds; check the part bounds"
        )
    if header.encoded_length > config.max_body_bytes(n):
        raise ProtocolError(
            f"sub-frame body declares {header.encoded_length} bytes, more than {n} values can need"
        )
    return n


async def _read_body(
    reader: _Reader,
    coder: Coder,
    header: FrameHeader,
    into: Callable[[int, int], np.ndarray] | KeptPart,
    got: int,
    n: int,
) -> Callable[[], float]:
    """Read a sub-frame's body; returns its decoding (for a worker thread)."""
    if isinstance(into, KeptPart):
        into.slot(got, got + n)  # a frame out of place is refused before its body is read
        body = await reader.readexactly(header.encoded_length)
        return functools.partial(coder.decode_kept, header, body, into, got)
    out = into(got, got + n)
    if header.codec is Codec.NONE and header.encoded_length == 4 * n:  # stored fp32: in place
        await reader.readinto(out.view(np.uint8))
        return functools.partial(coder.decode_into, header, None, out)
    body = await reader.readexactly(header.encoded_length)
    return functools.partial(coder.decode_into, header, body, out)


async def read_part(
    stream: StreamReader,
    coder: Coder,
    elements: int,
    into: Callable[[int, int], np.ndarray] | KeptPart,
    trailer: bytearray | None = None,
) -> tuple[float, int]:
    """Read ``elements`` values as sub-frames from ``stream`` into ``into(start, stop)`` (decoded to
    float32), or into a :class:`KeptPart` (payloads as they are, each frame where it belongs).

    Returns (squared norm, bytes read). Every size is checked before anything is read; the stream must end
    right after the last frame. The caller bounds the whole read with a timeout. A stored codec-none body
    is read straight into the destination (its checksum is checked right after, before the values count).
    """
    reader = _Reader(stream)
    got = 0
    nbytes = 0
    norm2 = 0.0
    pending: asyncio.Future[float] | None = None  # the previous sub-frame, decoding while this one arrives
    try:
        while got < elements:
            header = parse_header(await reader.readexactly(HEADER_SIZE), coder.config.limits)
            n = _checked_subframe(header, coder, got, elements)
            decode = await _read_body(reader, coder, header, into, got, n)
            nbytes += HEADER_SIZE + header.encoded_length
            if pending is not None:
                norm2 += await pending
            pending = asyncio.ensure_future(asyncio.to_thread(decode))
            got += n
        if pending is not None:
            norm2 += await pending
        if trailer is not None:  # (an answer's receipt: a fixed size after the last frame)
            trailer[:] = await reader.readexactly(len(trailer))
            nbytes += len(trailer)
        if not await reader.at_end():
            raise ProtocolError(f"body continues after the {elements} values this part holds")
    finally:
        # never return (or fail) while a thread still writes into the caller's memory
        if pending is not None and not pending.done():
            await asyncio.wait([pending])
        if pending is not None and pending.done() and not pending.cancelled():
            pending.exception()  # retrieved: an error already raised above is the one that counts
    return norm2, nbytes


def subframe_bounds(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


def stored_length(elements: int, step: int) -> int:
    """Bytes of ``elements`` fp32 values sent stored in sub-frames of at most ``step`` values."""
    return HEADER_SIZE * -(-elements // step) + 4 * elements


def stored_frame(values: np.ndarray) -> tuple[bytes, memoryview]:
    """A stored codec-none frame of ``values`` as (header, body), the body a view of their memory: nothing
    is copied, so ``values`` must not change until the frame is sent."""
    body = np.ascontiguousarray(values).data.cast("B")
    return pack_header(Codec.NONE, (values.size,), body.nbytes, body), body


__all__ = [
    "HEADER_ELEMENTS",
    "HEADER_WEIGHT",
    "PURPOSE",
    "Coder",
    "NonFinite",
    "read_part",
    "stored_frame",
    "stored_length",
    "subframe_bounds",
]
