"""Tensor codecs: a value transform (none, fp16, bf16, int8 blockwise) followed by zstd.

All codecs take and return flat ``float32`` numpy arrays (a CPU torch tensor gives one for free with
``tensor.numpy()``). zstd releases the GIL; numpy's casts run in C.

What each codec does with non-finite values:

* ``none`` keeps NaN and ±inf bit for bit.
* ``fp16`` keeps NaN and ±inf; finite values beyond ±65504 become ±inf (the receiver's finiteness check
  then rejects the contribution, which is the point: such a gradient is broken anyway).
* ``bf16`` keeps NaN and ±inf; rounding is to nearest even.
* ``int8`` quantises per block of ``INT8_BLOCK`` values with an fp32 absmax scale; a block holding any
  NaN or inf gets a NaN scale, so the whole block decodes as NaN and is rejected by the receiver.

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


class Codec(enum.IntEnum):
    NONE = 0
    FP16 = 1
    BF16 = 2
    INT8 = 3

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


def raw_size(codec: Codec, n: int) -> int:
    """Bytes of the value-transformed (pre-zstd) payload for ``n`` float32 values."""
    if codec is Codec.NONE:
        return 4 * n
    if codec in (Codec.FP16, Codec.BF16):
        return 2 * n
    blocks = -(-n // INT8_BLOCK)
    return 4 * blocks + n


def _to_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32)
    # round to nearest even on the 16 dropped bits; NaN stays NaN by forcing a mantissa bit
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def _from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _int8_encode(x: np.ndarray) -> bytes:
    n = x.size
    blocks = -(-n // INT8_BLOCK)
    padded = np.zeros(blocks * INT8_BLOCK, dtype=np.float32)
    padded[:n] = x
    view = padded.reshape(blocks, INT8_BLOCK)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        scales = np.abs(view).max(axis=1) / np.float32(127.0)
        scales[~np.isfinite(scales)] = np.nan
        safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        q = np.rint(view / safe[:, None])
        np.clip(q, -127, 127, out=q)
        q = np.nan_to_num(q, nan=0.0).astype(np.int8)
    return scales.astype(np.float32).tobytes() + q.reshape(-1)[:n].tobytes()


def _int8_decode(raw: bytes, n: int) -> np.ndarray:
    blocks = -(-n // INT8_BLOCK)
    scales = np.frombuffer(raw, dtype=np.float32, count=blocks)
    q = np.zeros(blocks * INT8_BLOCK, dtype=np.float32)
    q[:n] = np.frombuffer(raw, dtype=np.int8, offset=4 * blocks, count=n)
    return (q.reshape(blocks, INT8_BLOCK) * scales[:, None]).reshape(-1)[:n]


def transform(x: np.ndarray, codec: Codec) -> bytes:
    """Apply the codec's value transform (no zstd)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if codec is Codec.NONE:
        return x.tobytes()
    if codec is Codec.FP16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).tobytes()
    if codec is Codec.BF16:
        return _to_bf16(x).tobytes()
    return _int8_encode(x)


def untransform(raw: bytes, codec: Codec, n: int) -> np.ndarray:
    """Invert :func:`transform`; ``raw`` must hold exactly ``raw_size(codec, n)`` bytes."""
    if len(raw) != raw_size(codec, n):
        raise ProtocolError(
            f"payload holds {len(raw)} bytes but {n} values in codec {codec.label} need {raw_size(codec, n)}"
        )
    if codec is Codec.NONE:
        return np.frombuffer(raw, dtype=np.float32).copy()
    if codec is Codec.FP16:
        return np.frombuffer(raw, dtype=np.float16).astype(np.float32)
    if codec is Codec.BF16:
        return _from_bf16(np.frombuffer(raw, dtype=np.uint16))
    return _int8_decode(raw, n)


class Compressor:
    """zstd around the value transforms. One instance per thread (zstd contexts are not thread-safe)."""

    def __init__(self, level: int = 1, limits: Limits = DEFAULT_LIMITS) -> None:
        if not -7 <= level <= 22:
            raise ConfigError("zstd_level", "must be between -7 and 22")
        self.level = level
        self.limits = limits
        self._c = zstandard.ZstdCompressor(level=level)
        self._d = zstandard.ZstdDecompressor()

    def compress(self, raw: bytes) -> bytes:
        return self._c.compress(raw)

    def decompress(self, body: bytes, expected: int) -> bytes:
        """Decompress exactly ``expected`` bytes; refuse before allocating if that is over the limit."""
        if expected > self.limits.max_frame_bytes:
            raise LimitExceeded(
                f"frame declares {expected} raw bytes, more than the limit of {self.limits.max_frame_bytes}"
            )
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

    def encode(self, x: np.ndarray, codec: Codec) -> bytes:
        return self.compress(transform(x, codec))

    def decode(self, body: bytes, codec: Codec, n: int) -> np.ndarray:
        return untransform(self.decompress(body, raw_size(codec, n)), codec, n)


class ErrorFeedback:
    """Error feedback for a lossy codec: what quantisation drops now is added to the next encode."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: np.ndarray | None = None

    def transform(self, x: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Return the transformed payload of ``x + residual`` and the values the receiver will decode."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        if self.codec is Codec.NONE:
            return transform(x, self.codec), x
        target = x if self.residual is None or self.residual.shape != x.shape else x + self.residual
        raw = transform(target, self.codec)
        sent = untransform(raw, self.codec, target.size)
        with np.errstate(invalid="ignore"):
            residual = target - sent
        self.residual = np.where(np.isfinite(residual), residual, np.float32(0.0)).astype(np.float32)
        return raw, sent

    def reset(self) -> None:
        self.residual = None
