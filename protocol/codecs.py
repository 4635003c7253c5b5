"""Tensor codecs: a value transform (none, fp16, bf16, int8 and int2 blockwise, sparse top-k) followed by zstd.

All codecs take and return flat ``float32`` numpy arrays (a CPU torch tensor gives one for free with
``tensor.numpy()``). zstd releases the GIL; numpy's casts run in C.

What each codec does with non-finite values (a peer's own encoder; a malicious sender can put anything in
a payload, so receivers check finiteness after decoding):

* ``none`` keeps NaN and ±inf bit for bit.
* ``fp16`` keeps NaN (as the quiet NaN 0x7E00, sign kept) and ±inf; rounding is to nearest even,
  bit-exact with numpy's cast, so finite values of magnitude ≥ 65520 become ±inf (the receiver's
  finiteness check then rejects the contribution, which is the point: such a gradient is broken anyway)
  and values of magnitude ≤ 2⁻²⁵ ≈ 3e-8 flush to ±0.
* ``bf16`` keeps NaN (quiet, sign kept) and ±inf; rounding is to nearest even, so finite values beyond
  bfloat16's largest (≈ 3.39e38) become ±inf.
* ``int8`` quantises per block of ``INT8_BLOCK`` values with an fp32 absmax scale; a block holding any
  NaN or inf gets a NaN scale, so the whole block decodes as NaN and is rejected by the receiver.
  Finite values decode within half a quantisation step (absmax / 254) of the input (for blocks whose
  absmax is a normal float32 well above 127 × 2⁻¹²⁶, i.e. every real gradient).
* ``int2`` quantises per block of ``INT2_BLOCK`` (256) values to 2 bits each: the nearest of ±0.5 and ±1.5
  times the block's RMS (an fp32 scale), the 4-level quantiser of least squared error for normally
  distributed values; values beyond 2 RMS are clipped to 1.5 RMS (error feedback carries the rest). A block
  holding NaN or inf gets a NaN scale and decodes as all NaN. ``4 / 256 + 1/4`` ≈ 0.27 bytes a value before
  zstd (int8: ~1.0); every value is sent every time, within half an RMS (a relative error of ~0.34 for normal
  values, which error feedback spreads over the next encodes).
* ``sparse`` sends only the ``SPARSE_K`` values of largest magnitude in each chunk of ``SPARSE_CHUNK``
  (8 of 256, 3.1 %; a shorter last chunk keeps min(8, its length)), each as 2 bits: the nearest of ±scale
  and ±scale/3, where the chunk's fp32 scale is its largest magnitude. Every other value decodes as 0
  (error feedback sends it later), and a kept value decodes within scale/3 of the input. A chunk holding
  any NaN or inf gets a NaN scale and decodes as all NaN, rejected by the receiver, as int8's blocks do.
  It is ``(4 + k + k/4) / 256`` ≈ 0.055 bytes a value before zstd (int8: ~1.0); the SparseLoCo recipe,
  and only sensible with error feedback.

The 16-bit codecs write their payload as two byte planes (all low bytes, then all high bytes): the high
bytes of gradients (sign and exponent) are repetitive, and zstd compresses them far better apart.
The sparse payload is three arrays, one entry per chunk or per kept value in chunk order: all scales
(float32), then all kept indices within their chunk (uint8, increasing within a chunk), then all 2-bit
codes, four to a byte from the low bits up (0, 1, 2, 3 mean -1, -1/3, 1/3, 1 times the scale).

zstd is skipped where it does not pay: a frame body from :meth:`Compressor.pack` is the payload as is
when zstd would not shrink it (or not by the compressor's ``min_gain``: dense fp32 gradients, where zstd
level 1 saves ~7 % of the bytes for about half of an all-reduce round's CPU). A stored body is exactly as
long as the raw payload and a zstd body from ``pack`` never is, so a frame header's raw and encoded lengths
say which one follows; the decoder needs no setting.

Lossy codecs are used through :class:`ErrorFeedback`, which carries the quantisation error into the next
encode so that it is not lost, only delayed.
"""

from __future__ import annotations

import enum

import numpy as np
import zstandard

from crowdtrain.protocol.errors import ConfigError, LimitExceeded, ProtocolError
from crowdtrain.protocol.limits import DEFAULT_LIMITS, Limits

INT8_BLOCK = 4096
SPARSE_CHUNK = 256  # values per sparse chunk: an index within one fits in a byte
SPARSE_K = 8  # values a sparse chunk sends
# chunks the sparse encoder selects from at a time: argpartition over a block that fits in cache is ~4x
# faster on 25M values than over the whole array at once
_SPARSE_BLOCK = 1024
# what each 2-bit sparse code decodes to, times its chunk's scale
_SPARSE_LEVELS = np.array([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0], dtype=np.float32)
_SPARSE_LEVELS.flags.writeable = False
INT2_BLOCK = 256  # values per int2 block, each with its own scale
# what each 2-bit int2 code decodes to, times its block's RMS: the 4-level uniform quantiser of least squared
# error for a normal distribution has its levels at ±0.5 and ±1.5 of the standard deviation (step ≈ 1σ)
_INT2_LEVELS = np.array([-1.5, -0.5, 0.5, 1.5], dtype=np.float32)
_INT2_LEVELS.flags.writeable = False
# what a received body may be (read whole into bytes or a bytearray, or a view of a buffer): numpy and zstd
# read all three
BytesLike = bytes | bytearray | memoryview
# Compressor's sample of a large payload when it has a minimum gain: strips spread over the payload.
_SAMPLE_MIN = 1 << 18
_SAMPLE_STRIPS = 8
_SAMPLE_STRIP = 8192


class Codec(enum.IntEnum):
    NONE = 0
    FP16 = 1
    BF16 = 2
    INT8 = 3
    SPARSE = 4
    INT2 = 5

    @classmethod
    def parse(cls, name: str) -> Codec:
        try:
            return cls[name.upper()]
        except KeyError:
            choices = ", ".join(c.name.lower() for c in cls)
            raise ConfigError("codec", f"unknown codec {name!r}; choose one of {choices}") from None

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def lossy(self) -> bool:
        return self is not Codec.NONE

    @property
    def withholds(self) -> bool:
        """Whether its error-feedback residual holds back most of a vector for rounds (sparse sends 8 values
        of 256), not just a quantisation error: such a residual must outlive a part changing owners."""
        return self is Codec.SPARSE


def raw_size(codec: Codec, n: int) -> int:
    """Bytes of the value-transformed (pre-zstd) payload for ``n`` float32 values."""
    if codec is Codec.NONE:
        return 4 * n
    if codec in (Codec.FP16, Codec.BF16):
        return 2 * n
    if codec is Codec.INT8:
        blocks = -(-n // INT8_BLOCK)
        return 4 * blocks + n
    if codec is Codec.INT2:
        return 4 * -(-n // INT2_BLOCK) + -(-n // 4)
    chunks, kept = _sparse_counts(n)
    return 4 * chunks + kept + -(-kept // 4)


def block(codec: Codec) -> int:
    """Values the codec quantises together, under one scale (1 for the element-wise codecs): a vector cut
    only at multiples of it is quantised alike however it is cut, which is what lets several groups that
    hold the same values encode them to the same bytes."""
    if codec is Codec.INT8:
        return INT8_BLOCK
    if codec is Codec.INT2:
        return INT2_BLOCK
    if codec is Codec.SPARSE:
        return SPARSE_CHUNK
    return 1


def _sparse_counts(n: int) -> tuple[int, int]:
    """The chunks of a sparse payload of ``n`` values and the values it keeps."""
    chunks = -(-n // SPARSE_CHUNK)
    if not chunks:
        return 0, 0
    return chunks, (chunks - 1) * SPARSE_K + min(SPARSE_K, n - (chunks - 1) * SPARSE_CHUNK)


def _split_planes(halves: np.ndarray) -> bytes:
    """Write 16-bit values (held in a uint32 array) as two byte planes: all low bytes, then all high bytes.

    The high bytes (sign and exponent) of gradients are very repetitive; planed, zstd finds that.
    """
    n = halves.size
    out = np.empty(2 * n, dtype=np.uint8)
    np.copyto(out[:n], halves, casting="unsafe")  # keeps the low byte
    halves >>= 8
    np.copyto(out[n:], halves, casting="unsafe")
    return out.tobytes()


def _join_planes(raw: BytesLike, n: int, dtype: type[np.unsignedinteger]) -> np.ndarray:
    """Invert :func:`_split_planes` into an array of ``dtype`` (uint16 or uint32)."""
    planes = np.frombuffer(raw, dtype=np.uint8)
    out = planes[n:].astype(dtype)
    out <<= 8
    out |= planes[:n]
    return out


def _to_fp16(x: np.ndarray) -> np.ndarray:
    """float32 → IEEE half bits (in a uint32 array), round to nearest even, NaN kept, overflow → ±inf.

    Bit-exact with ``x.astype(np.float16)`` but branch-free: numpy's cast takes a slow path for every
    half-precision subnormal, and half of a gradient's values are that small. (The algorithm is
    Maratyszcza's ``fp16_ieee_from_fp32_value``: the FPU does the rounding.)
    """
    w = x.view(np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        base = np.abs(x)
        base *= np.float32(2.0**112)
        base *= np.float32(2.0**-110)
        bias = np.left_shift(w, 1)
        nan = bias > np.uint32(0xFF000000)
        bias &= np.uint32(0xFF000000)
        np.maximum(bias, np.uint32(0x71000000), out=bias)
        bias >>= 1
        bias += np.uint32(0x07800000)
        base += bias.view(np.float32)
    bits = base.view(np.uint32)
    half = bias  # reuse the buffer
    np.right_shift(bits, 13, out=half)
    half &= np.uint32(0x7C00)
    bits &= np.uint32(0x0FFF)
    half += bits
    if nan.any():
        half[nan] = 0x7E00
    sign = np.right_shift(w, 16)
    sign &= np.uint32(0x8000)
    half |= sign
    return half


# Every half-precision value as float32: a 256 KiB table lookup is 5x faster than numpy's cast, which
# (like the encoder's) takes a slow path for half subnormals. Bit-exact with numpy by construction.
_FP16_TO_FP32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_FP16_TO_FP32.flags.writeable = False


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits (in a uint32 array), round to nearest even, NaN kept quiet."""
    bits = x.view(np.uint32)
    rounding = np.right_shift(bits, 16)
    rounding &= np.uint32(1)
    rounding += np.uint32(0x7FFF)
    rounding += bits  # wraps only for NaN payloads, which are fixed below
    rounding >>= 16
    nan = np.isnan(x)
    if nan.any():
        rounding[nan] = (bits[nan] >> 16) | 0x40
    return rounding


def _int8_encode(x: np.ndarray) -> bytes:
    return _int8_encode_sent(x)[0]


def _int8_encode_sent(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The int8 payload of ``x`` and the values it decodes to (computed here, without decoding it).

    Three passes over the values and one temporary (the quotients, rounded and clipped in place), where
    ``np.abs``, ``nan_to_num`` and ``astype`` each made one more: ~3x faster, bit for bit the same payload.
    """
    n = x.size
    blocks = -(-n // INT8_BLOCK)
    if n % INT8_BLOCK:
        padded = np.zeros(blocks * INT8_BLOCK, dtype=np.float32)
        padded[:n] = x
    else:
        padded = np.ascontiguousarray(x, dtype=np.float32)
    view = padded.reshape(blocks, INT8_BLOCK)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        # absmax without an |x| temporary: NaN propagates through max and min, ±inf makes the scale inf
        absmax = np.abs(np.maximum(view.max(axis=1), -view.min(axis=1)))  # abs: -0.0 → 0.0
        scales = absmax / np.float32(127.0)
        scales[~np.isfinite(scales)] = np.nan
        # near float32's largest value, 127 × scale can round past it and decode as inf: step such scales
        # down an ulp at a time (at most a few) until the largest integer decodes finite
        while (over := np.isinf(scales * np.float32(127.0))).any():
            scales[over] = np.nextafter(scales[over], np.float32(0.0))
        safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        q = np.divide(view, safe[:, None])
        np.rint(q, out=q)
        np.clip(q, -127, 127, out=q)
        q[np.isnan(q)] = 0.0
        out = bytearray(4 * blocks + n)
        np.frombuffer(out, dtype=np.float32, count=blocks)[:] = scales
        np.frombuffer(out, dtype=np.int8, offset=4 * blocks)[:] = q.reshape(-1)[:n]
        # what _int8_decode gives: the integer times its block's scale (NaN for a non-finite block); + 0.0
        # turns the -0.0 that rint gives small negative values into the +0.0 an int8 decodes to
        q += np.float32(0.0)
        q *= scales[:, None]
    return bytes(out), q.reshape(-1)[:n]


def int8_steps(x: np.ndarray) -> np.ndarray:
    """Each value's int8 step: its block's absmax ÷ 127 (blocks of INT8_BLOCK values from ``x``'s start)."""
    n = x.size
    blocks = -(-n // INT8_BLOCK)
    padded = np.zeros(blocks * INT8_BLOCK, dtype=np.float32)
    padded[:n] = x
    view = padded.reshape(blocks, INT8_BLOCK)
    absmax = np.abs(np.maximum(view.max(axis=1), -view.min(axis=1)))
    return np.repeat(absmax / np.float32(127.0), INT8_BLOCK)[:n]


def _within_half_step(residual: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``residual`` clipped to half an int8 step of ``x``'s block, value by value (a new array)."""
    bound = int8_steps(x) / np.float32(2.0)
    return np.clip(residual, -bound, bound)


def _int8_decode(raw: BytesLike, n: int) -> np.ndarray:
    blocks = -(-n // INT8_BLOCK)
    scales = np.frombuffer(raw, dtype=np.float32, count=blocks)
    q = np.empty(blocks * INT8_BLOCK, dtype=np.float32)
    q[:n] = np.frombuffer(raw, dtype=np.int8, offset=4 * blocks, count=n)
    q[n:] = 0
    view = q.reshape(blocks, INT8_BLOCK)
    # a peer's scale may be inf or NaN: the values are then non-finite and the receiver's check rejects them
    with np.errstate(invalid="ignore", over="ignore"):
        view *= scales[:, None]
    return q[:n]


def _sparse_pick(rows: np.ndarray, mags: np.ndarray, picks: np.ndarray, values: np.ndarray) -> None:
    """Write the in-chunk indices of each row's ``SPARSE_K`` largest ``mags`` to ``picks`` (increasing) and
    their values to ``values``. NaN counts as the largest magnitude (numpy sorts it last), so a chunk with
    a NaN or inf always keeps it."""
    top = np.argpartition(mags, SPARSE_CHUNK - SPARSE_K, axis=1)[:, SPARSE_CHUNK - SPARSE_K :]
    top.sort(axis=1)
    picks[:] = top
    values[:] = np.take_along_axis(rows, top, axis=1)


def _pack2(codes: np.ndarray) -> np.ndarray:
    """2-bit codes (values 0..3, any numeric dtype) four to a byte, from the low bits up (the last byte padded
    with code 0): what sparse and int2 payloads carry."""
    padded = np.zeros(-(-codes.size // 4) * 4, dtype=np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def _unpack2(packed: np.ndarray) -> np.ndarray:
    """The codes of :func:`_pack2`'s bytes, four a byte (padding included), as a flat uint8 array."""
    return ((packed[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & np.uint8(3)).reshape(-1)


def _sparse_encode(x: np.ndarray) -> bytes:
    n = x.size
    chunks, kept = _sparse_counts(n)
    full, rest = divmod(n, SPARSE_CHUNK)
    picks = np.empty((chunks, SPARSE_K), dtype=np.intp)
    values = np.empty((chunks, SPARSE_K), dtype=np.float32)
    rows = x[: full * SPARSE_CHUNK].reshape(full, SPARSE_CHUNK)
    for a in range(0, full, _SPARSE_BLOCK):
        b = min(a + _SPARSE_BLOCK, full)
        _sparse_pick(rows[a:b], np.abs(rows[a:b]), picks[a:b], values[a:b])
    if rest:
        # the short last chunk, padded to a whole one whose padding is never picked before a value: its
        # picks past ``rest`` sort last, and are cut off with the kept values
        tail = np.zeros((1, SPARSE_CHUNK), dtype=np.float32)
        tail[0, :rest] = x[full * SPARSE_CHUNK :]
        mags = np.abs(tail)
        mags[0, rest:] = -1.0
        _sparse_pick(tail, mags, picks[full:], values[full:])
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        scales = np.abs(values).max(axis=1)  # the chunk's largest magnitude; NaN or inf if it holds one
        scales[~np.isfinite(scales)] = np.nan
        safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        # value / scale in [-1, 1] to the nearest of the codes 0..3 (-1, -1/3, 1/3, 1)
        q = np.divide(values, safe[:, None])
        q += np.float32(1.0)
        q *= np.float32(1.5)
        np.rint(q, out=q)
        np.clip(q, 0, 3, out=q)
        q[np.isnan(q)] = 0.0  # a broken chunk: it decodes as NaN whatever its codes
    packed = _pack2(q.reshape(-1)[:kept])
    out = bytearray(4 * chunks + kept + packed.size)
    np.frombuffer(out, dtype=np.float32, count=chunks)[:] = scales
    np.frombuffer(out, dtype=np.uint8, offset=4 * chunks, count=kept)[:] = picks.reshape(-1)[:kept]
    np.frombuffer(out, dtype=np.uint8, offset=4 * chunks + kept)[:] = packed
    return bytes(out)


def _sparse_decode(raw: BytesLike, n: int) -> np.ndarray:
    """Decode a sparse payload of the right length; any bytes decode to values (NaN for a chunk with a
    non-finite scale). A pick past the end of a short last chunk lands in padding that is cut off, and two
    equal picks in a chunk write one place (numpy keeps one of the two values)."""
    chunks, kept = _sparse_counts(n)
    scales = np.frombuffer(raw, dtype=np.float32, count=chunks)
    picks = np.frombuffer(raw, dtype=np.uint8, offset=4 * chunks, count=kept)
    codes = _unpack2(np.frombuffer(raw, dtype=np.uint8, offset=4 * chunks + kept))
    # the chunk of kept value j is j // SPARSE_K, its place in the padded output that chunk's start + pick
    where = np.repeat(np.arange(0, chunks * SPARSE_CHUNK, SPARSE_CHUNK), SPARSE_K)[:kept]
    where += picks
    with np.errstate(invalid="ignore", over="ignore"):
        values = np.take(_SPARSE_LEVELS, codes[:kept])
        values *= np.repeat(scales, SPARSE_K)[:kept]
    out = np.zeros(chunks * SPARSE_CHUNK, dtype=np.float32)
    out[where] = values
    broken = ~np.isfinite(scales)
    if broken.any():
        out.reshape(chunks, SPARSE_CHUNK)[broken] = np.nan
    return out[:n]


def _int2_encode(x: np.ndarray) -> bytes:
    n = x.size
    blocks = -(-n // INT2_BLOCK)
    if not blocks:
        return b""
    padded = np.zeros(blocks * INT2_BLOCK, dtype=np.float32)
    padded[:n] = x
    rows = padded.reshape(blocks, INT2_BLOCK)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        # the block's RMS over its real values (a short last block is not diluted by its padding)
        counts = np.full(blocks, INT2_BLOCK, dtype=np.float32)
        counts[-1] = n - (blocks - 1) * INT2_BLOCK
        wide = rows.astype(np.float64)
        scales = np.sqrt(np.einsum("ij,ij->i", wide, wide) / counts).astype(np.float32)
        scales[~np.isfinite(scales)] = np.nan  # a block holding NaN or inf decodes as all NaN
        safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        q = rows / safe[:, None]  # in units of the RMS: the nearest of -1.5, -0.5, 0.5, 1.5 (codes 0..3)
        q += np.float32(1.5)
        np.rint(q, out=q)
        np.clip(q, 0, 3, out=q)
        q[np.isnan(q)] = 0.0
    return scales.tobytes() + _pack2(q.reshape(-1)[:n]).tobytes()


def _int2_decode(raw: BytesLike, n: int) -> np.ndarray:
    """Decode an int2 payload of the right length (any bytes decode to values; NaN for a non-finite scale)."""
    blocks = -(-n // INT2_BLOCK)
    scales = np.frombuffer(raw, dtype=np.float32, count=blocks)
    codes = _unpack2(np.frombuffer(raw, dtype=np.uint8, offset=4 * blocks))
    out = np.zeros(blocks * INT2_BLOCK, dtype=np.float32)
    out[: codes.size] = np.take(_INT2_LEVELS, codes)
    with np.errstate(invalid="ignore", over="ignore"):
        out.reshape(blocks, INT2_BLOCK)[:] *= scales[:, None]
    return out[:n]


def transform(x: np.ndarray, codec: Codec) -> bytes:
    """Apply the codec's value transform (no zstd)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if codec is Codec.NONE:
        return x.tobytes()
    if codec is Codec.FP16:
        return _split_planes(_to_fp16(x))
    if codec is Codec.BF16:
        return _split_planes(_to_bf16(x))
    if codec is Codec.INT8:
        return _int8_encode(x)
    if codec is Codec.INT2:
        return _int2_encode(x)
    return _sparse_encode(x)


def untransform(raw: BytesLike, codec: Codec, n: int) -> np.ndarray:
    """Invert :func:`transform`; ``raw`` must hold exactly ``raw_size(codec, n)`` bytes."""
    if len(raw) != raw_size(codec, n):
        raise ProtocolError(
            f"payload holds {len(raw)} bytes but {n} values in codec {codec.label} need {raw_size(codec, n)}"
        )
    if codec is Codec.NONE:
        return np.frombuffer(raw, dtype=np.float32).copy()
    if codec is Codec.FP16:
        return np.take(_FP16_TO_FP32, _join_planes(raw, n, np.uint16))
    if codec is Codec.BF16:
        bits = _join_planes(raw, n, np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    if codec is Codec.INT8:
        return _int8_decode(raw, n)
    if codec is Codec.INT2:
        return _int2_decode(raw, n)
    return _sparse_decode(raw, n)


class Compressor:
    """zstd around the value transforms. One instance per thread (zstd contexts are not thread-safe)."""

    def __init__(self, level: int = 1, limits: Limits = DEFAULT_LIMITS, min_gain: float = 0.0) -> None:
        if not -7 <= level <= 22:
            raise ConfigError("zstd_level", "must be between -7 and 22")
        if not 0.0 <= min_gain < 1.0:
            raise ConfigError("zstd_min_gain", "must be a fraction of the bytes, at least 0 and below 1")
        self.level = level
        self.limits = limits
        self.min_gain = min_gain
        self._c = zstandard.ZstdCompressor(level=level)
        self._d = zstandard.ZstdDecompressor()

    def compress(self, raw: bytes | memoryview) -> bytes:
        """zstd of ``raw``, always (see :meth:`pack` for the body a frame carries)."""
        return self._c.compress(raw)

    def pack(self, raw: bytes | memoryview) -> bytes | memoryview:
        """The body of a frame: zstd of ``raw``, or ``raw`` itself (stored) when zstd would not shrink it
        by ``min_gain`` of its bytes (and never when it would not shrink it at all).

        A stored body is exactly as long as the raw payload, and a zstd body from here never is (one that
        would be is stored instead), so :meth:`decompress` tells them apart by length alone: the frame
        header's raw and encoded lengths say which it is. With ``min_gain`` > 0, a large payload is first
        judged on a sample (``_SAMPLE_STRIPS`` strips spread over it), so an incompressible one costs ~2 %
        of a full compression instead of all of it.
        """
        n = len(raw)
        if self.stores(raw):
            return raw
        body = self._c.compress(raw)
        if len(body) >= n or (self.min_gain > 0 and len(body) > (1.0 - self.min_gain) * n):
            return raw
        return body

    def stores(self, raw: bytes | memoryview) -> bool:
        """True when a sample of ``raw`` shows that zstd would not save ``min_gain`` of its bytes, so it
        goes stored without compressing it all. Only large payloads are judged on a sample (``_SAMPLE_STRIPS``
        strips spread over it); False for small ones and when there is no minimum gain (then :meth:`pack`
        compresses and compares)."""
        view = memoryview(raw).cast("B")
        n = view.nbytes
        if self.min_gain <= 0 or n < _SAMPLE_MIN:
            return False
        step = n // _SAMPLE_STRIPS
        sample = b"".join(view[k * step : k * step + _SAMPLE_STRIP] for k in range(_SAMPLE_STRIPS))
        return len(self._c.compress(sample)) > (1.0 - self.min_gain) * len(sample)

    def decompress(self, body: BytesLike, expected: int) -> BytesLike:
        """Decompress exactly ``expected`` bytes; refuse before allocating if that is over the limit.

        A body of exactly ``expected`` bytes is a stored payload (see :meth:`compress`) and is returned as is.
        """
        if expected > self.limits.max_frame_bytes:
            raise LimitExceeded(
                f"frame declares {expected} raw bytes, more than the limit of {self.limits.max_frame_bytes}"
            )
        if len(body) == expected:
            return body
        try:
            params = zstandard.get_frame_parameters(body)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"frame body is not zstd data ({exc})") from exc
        if params.content_size not in (expected, zstandard.CONTENTSIZE_UNKNOWN):
            raise ProtocolError(
                f"zstd body declares {params.content_size} bytes but the header declares {expected}"
            )
        try:
            out = self._d.decompress(body, max_output_size=expected)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"frame body is corrupt zstd data ({exc})") from exc
        if len(out) != expected:
            raise ProtocolError(f"zstd body holds {len(out)} bytes but the header declares {expected}")
        return out

    def encode(self, x: np.ndarray, codec: Codec) -> bytes | memoryview:
        return self.pack(transform(x, codec))

    def decode(self, body: bytes, codec: Codec, n: int) -> np.ndarray:
        return untransform(self.decompress(body, raw_size(codec, n)), codec, n)


class Residual:
    """An error-feedback residual kept as bfloat16: 2 bytes a value where float32 takes 4 (a residual of the
    whole gradient is the size of the model, and a lossy codec keeps two: what a peer sends and what it
    answers with). A residual is at most half a quantisation step; bfloat16's 8 significant bits store it
    within 2⁻⁸ of itself, so what is lost is under a five-hundredth of a step. (With ``sparse`` the residual
    is every value not sent yet, for a small one many steps' worth, and each step rounds it within 2⁻⁸.)
    Slicing gives a view, so disjoint slices may be read and written from different threads."""

    __slots__ = ("bits",)

    def __init__(self, bits: np.ndarray) -> None:
        self.bits = bits

    @classmethod
    def zeros(cls, n: int) -> Residual:
        return cls(np.zeros(n, dtype=np.uint16))

    @property
    def size(self) -> int:
        return self.bits.size

    def __getitem__(self, where: slice) -> Residual:
        return Residual(self.bits[where])

    def values(self) -> np.ndarray:
        """The residual as float32 (a new array)."""
        out = self.bits.astype(np.uint32)
        out <<= 16
        return out.view(np.float32)

    def keep(self, values: np.ndarray) -> None:
        """Store ``values`` (float32, this slice's length), rounded to the nearest bfloat16."""
        self.bits[:] = _to_bf16(np.ascontiguousarray(values, dtype=np.float32))


class ErrorFeedback:
    """Error feedback for a lossy codec: what quantisation drops now (and with ``sparse``, every value not
    among its chunk's largest) is added to the next encode.

    With int8, an encode adds at most half a step of each value's block (INT8_BLOCK values from the
    frame's start; a step is the block's absmax ÷ 127) and keeps the rest for later ones: nothing is lost,
    and every copy stays within one step of the values it encodes. A residual is up to half a step of the
    block it was made in, which may be far larger than the values now in its place (a gradient that shrank
    from a spike, or early in training; values last sent rounds ago, while this peer owned their part):
    added whole, it outweighed them (copies ~1 to 10x their gradient's norm away from it), and a spot-check
    of an honest copy misfired (docs/security.md)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: np.ndarray | None = None

    def transform(self, x: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Return the transformed payload of ``x + residual`` (int8: of ``x`` + at most half a step of the
        residual, see the class) and the values the receiver will decode."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        if self.codec is Codec.NONE:
            return transform(x, self.codec), x
        with np.errstate(invalid="ignore", over="ignore"):
            if self.residual is None or self.residual.shape != x.shape:
                target = owed = x
                residual = np.empty_like(x)
            else:
                # what is owed: the residual is computed in it, in place (a new array)
                owed = residual = x + self.residual
                target = owed if self.codec is not Codec.INT8 else x + _within_half_step(self.residual, x)
            if self.codec is Codec.INT8:
                raw, sent = _int8_encode_sent(target)
            else:  # fp16, bf16, sparse: decoding is the one sure way to learn what the receiver gets
                raw = transform(target, self.codec)
                sent = untransform(raw, self.codec, target.size)
            np.subtract(owed, sent, out=residual)
            # a NaN or inf input is dropped, not carried forward; a finite sum (one pass, no temporary)
            # means every value is finite
            if not np.isfinite(residual.sum()):
                residual[~np.isfinite(residual)] = 0.0
        self.residual = residual
        return raw, sent
