"""Settings of the group all-reduce, one frozen dataclass checked at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from crowdtrain.protocol.codecs import Codec, block, raw_size
from crowdtrain.protocol.errors import ConfigError
from crowdtrain.protocol.limits import DEFAULT_LIMITS, Limits
from crowdtrain.protocol.messages import AveragingSpec


@dataclass(frozen=True, slots=True)
class AveragingConfig:
    """How this peer averages with its group.

    Deadlines come from each signed :class:`~crowdtrain.protocol.messages.GroupAssignment`; the values
    here bound everything else: connecting to a part owner, waiting for an assignment a peer has not
    received yet, and how long after the deadline a request may still finish answering.
    """

    codec: Codec = Codec.NONE
    zstd_level: int = 1
    # Codec none only: zstd runs on a sub-frame only when it saves at least this fraction of its bytes
    # (judged on a sample); otherwise the sub-frame goes stored. Dense fp32 gains ~7 % for about half the
    # CPU of a round, so it goes stored; fp32 with many exact zeros gains far more and is compressed. The
    # lossy codecs are chosen to save bandwidth and always use zstd (when it shrinks the payload at all).
    # 0: compress whenever zstd shrinks the payload. The receiver needs no setting.
    zstd_min_gain: float = 0.1
    clip_multiple: float = 1.0  # 0 disables clipping
    local: bool = (
        False  # the run's mode is local steps (a pull is judged by its threshold: protocol/receipts.py)
    )
    subframe_elements: int = 1 << 20
    limits: Limits = field(default_factory=lambda: DEFAULT_LIMITS)
    connect_timeout_s: float = 5.0
    grace_s: float = 2.0  # after the deadline, time for the reduced parts to travel back
    assignment_wait_s: float = 5.0  # a request that arrives before our own allreduce() call waits this long
    max_members: int = 256
    max_vector_elements: int = 1 << 32
    max_error_bytes: int = 4096  # the sentence in a 4xx answer we read back
    remember_rounds: int = 64  # finished round keys kept to answer late requests with 410

    def __post_init__(self) -> None:
        if not isinstance(self.codec, Codec):
            raise ConfigError("codec", f"must be a Codec, got {self.codec!r}; use Codec.parse(name)")
        if not -7 <= self.zstd_level <= 22:
            raise ConfigError("zstd_level", "must be between -7 and 22")
        if not (isinstance(self.zstd_min_gain, int | float) and 0.0 <= self.zstd_min_gain < 1.0):
            raise ConfigError("zstd_min_gain", "must be a fraction of the bytes, at least 0 and below 1")
        if not math.isfinite(self.clip_multiple) or not (self.clip_multiple == 0 or self.clip_multiple >= 1):
            raise ConfigError("clip_multiple", "must be 0 (no clipping) or a finite number ≥ 1")
        if self.subframe_elements < 1:
            raise ConfigError("subframe_elements", "must be at least 1")
        if self.subframe_elements > self.limits.max_elements:
            raise ConfigError(
                "subframe_elements",
                f"{self.subframe_elements} is above limits.max_elements ({self.limits.max_elements})",
            )
        if 4 * self.subframe_elements + 4096 > self.limits.max_frame_bytes:
            raise ConfigError(
                "subframe_elements",
                f"a sub-frame of {self.subframe_elements} values may exceed limits.max_frame_bytes "
                f"({self.limits.max_frame_bytes}); lower it",
            )
        for name in ("connect_timeout_s", "grace_s", "assignment_wait_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(name, "must be a positive number of seconds")
        if self.max_members < 1:
            raise ConfigError("max_members", "must be at least 1")
        if self.max_vector_elements < 1:
            raise ConfigError("max_vector_elements", "must be at least 1")
        if self.max_error_bytes < 64:
            raise ConfigError("max_error_bytes", "must be at least 64")
        if self.remember_rounds < 1:
            raise ConfigError("remember_rounds", "must be at least 1")

    @classmethod
    def from_spec(cls, spec: AveragingSpec, **overrides) -> AveragingConfig:
        """The run spec's averaging settings, with local overrides (timeouts, limits)."""
        values: dict[str, Any] = {
            "codec": Codec.parse(spec.codec),
            "zstd_level": spec.zstd_level,
            "clip_multiple": spec.clip_multiple,
            "local": spec.local,
            "subframe_elements": spec.subframe_elements,
        }
        values.update(overrides)
        return cls(**values)

    @property
    def align(self) -> int:
        """Where parts may be cut: at multiples of the codec's block (see :func:`part_bounds`)."""
        return block(self.codec)

    @property
    def frame_elements(self) -> int:
        """Values per sub-frame as parts are streamed: ``subframe_elements`` rounded up to whole blocks of the
        codec (down where the limits would not take that), so that a frame of a part cut at block bounds
        quantises whole blocks only."""
        unit = self.align
        up = -(-self.subframe_elements // unit) * unit
        if up <= self.limits.max_elements and raw_size(self.codec, up) + 4096 <= self.limits.max_frame_bytes:
            return up
        return max(unit, self.subframe_elements // unit * unit)

    def max_body_bytes(self, n: int) -> int:
        """Largest encoded body accepted for a sub-frame of ``n`` values (zstd's worst case bound)."""
        raw = raw_size(self.codec, n)
        return min(self.limits.max_frame_bytes, raw + raw // 128 + 1024)
