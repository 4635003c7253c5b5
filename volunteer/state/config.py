"""Settings of state catch-up: one frozen dataclass shared by the server and the fetcher."""

from __future__ import annotations

from dataclasses import dataclass

from crowdtrain.protocol.errors import ConfigError
from crowdtrain.protocol.limits import KiB, MiB

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class StateConfig:
    """How a volunteer serves its snapshot and fetches someone else's.

    Fetching: ``ranges_per_donor`` requests run at once against each donor; a range that is still in
    flight when nothing else is left may be raced on an idle donor (at most ``max_racers`` attempts of
    one range at a time). A donor is dropped after ``max_donor_failures`` failures in a row (time-outs,
    refused connections, short bodies) or ``max_busy_answers`` "503 busy" answers; it is banned at once
    for a range whose sha256 is wrong. Every request has a time-out; nothing is retried forever.

    Serving: at most ``max_uploads`` range uploads at once (beyond: 503 with ``Retry-After``), paced to
    ``upload_rate`` bytes/s in total when it is set, and zstd (``zstd_level``; 0 = never) per range
    when the client accepts it and it makes the range smaller.
    """

    range_bytes: int = 4 * MiB
    ranges_per_donor: int = 2
    max_racers: int = 2
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 20.0  # longest silence while a body is being read
    range_timeout_s: float = 120.0  # one range request, from connect to the last byte
    manifest_timeout_s: float = 10.0
    manifest_grace_s: float = 1.0  # after the first valid manifest, how long to wait for the others' votes
    max_donor_failures: int = 3
    max_busy_answers: int = 30
    max_retry_after_s: float = 5.0  # a donor's Retry-After is capped to this
    progress_interval_s: float = 0.5
    accept_zstd: bool = True
    max_state_bytes: int = 16 * GiB
    max_uploads: int = 4
    upload_rate: float | None = None  # bytes/s over all uploads of this server; None = unlimited
    zstd_level: int = 1
    retry_after_s: int = 1  # what this server tells a client it turned away with 503
    keep_previous: bool = True  # keep serving the previous snapshot so fetches in progress can finish
    pin_s: float = 30.0  # an older snapshot requested within this many seconds is kept for its fetcher
    max_snapshots: int = 4  # snapshots served at most, pinned ones included
    # zstd frames of served ranges kept for the next request: a small state is compressed once; a large one
    # would need a budget near its size to gain much, and the frames count in a donor's peak memory
    compressed_cache_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        if not 64 * KiB <= self.range_bytes <= 64 * MiB:
            raise ConfigError("range_bytes", "must be between 64 KiB and 64 MiB")
        for name in (
            "ranges_per_donor",
            "max_racers",
            "max_donor_failures",
            "max_busy_answers",
            "max_uploads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 1024:
                raise ConfigError(name, "must be a whole number between 1 and 1024")
        for name in (
            "connect_timeout_s",
            "read_timeout_s",
            "range_timeout_s",
            "manifest_timeout_s",
            "manifest_grace_s",
            "max_retry_after_s",
            "progress_interval_s",
        ):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ConfigError(name, "must be a number of seconds above 0 and at most 3600")
        if not 0 <= self.pin_s <= 3600:
            raise ConfigError("pin_s", "must be between 0 and 3600 seconds")
        if not isinstance(self.max_snapshots, int) or not 1 <= self.max_snapshots <= 64:
            raise ConfigError("max_snapshots", "must be a whole number between 1 and 64")
        if self.read_timeout_s > self.range_timeout_s:
            raise ConfigError("read_timeout_s", "must not exceed range_timeout_s")
        if self.connect_timeout_s > self.range_timeout_s:
            raise ConfigError("connect_timeout_s", "must not exceed range_timeout_s")
        if not self.range_bytes <= self.max_state_bytes <= 1 << 40:
            raise ConfigError("max_state_bytes", "must be between range_bytes and 1 TiB")
        if self.upload_rate is not None and not self.upload_rate >= 64 * KiB:
            raise ConfigError("upload_rate", "must be None (unlimited) or at least 64 KiB/s")
        if not 0 <= self.compressed_cache_bytes <= 1 << 40:
            raise ConfigError("compressed_cache_bytes", "must be between 0 and 1 TiB")
        if not 0 <= self.zstd_level <= 22:
            raise ConfigError("zstd_level", "must be between 0 (never compress) and 22")
        if not 1 <= self.retry_after_s <= 60:
            raise ConfigError("retry_after_s", "must be between 1 and 60 seconds")
