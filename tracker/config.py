"""The tracker's settings: one frozen dataclass, checked when it is built."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from crowdtrain.protocol.errors import ConfigError
from crowdtrain.protocol.limits import MiB


def default_db_path() -> Path:
    """``$XDG_DATA_HOME/crowdtrain/tracker.sqlite3`` (``~/.local/share/...`` when unset)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "crowdtrain" / "tracker.sqlite3"


@dataclass(frozen=True, slots=True)
class TrackerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound one is in ``Tracker.url``
    db: str = ":memory:"  # a SQLite path (WAL) or ":memory:"
    public_url: str | None = (
        None  # how others reach this tracker (announce URL in torrents); default: bound URL
    )
    open: bool = False  # serve announces for info-hashes nobody registered
    # None: read from the database, or generated and stored there. Kept out of repr (logs, tracebacks).
    admin_token: str | None = field(default=None, repr=False)
    peer_ttl_s: float = 30.0  # a volunteer silent this long is dropped
    heartbeat_interval_s: float = 2.0  # what volunteers are told to use
    # check a volunteer at a host other than the one its requests come from (join --advertise HOST: relays, a
    # forward on another address); off, nobody can point the tracker's checks at another host (reach.py)
    allow_other_hosts: bool = False
    # a peer at the open step that owes samples and was silent this many heartbeat intervals (at least 2 s)
    # loses what it owes to the others (tracker/collab.py: stragglers, and late peers); 0: neither rule, it is
    # waited for until it expires
    straggler_intervals: float = 1.5
    announce_interval_s: int = 30  # BitTorrent ``interval``
    min_announce_interval_s: int = 5  # BitTorrent ``min interval``
    long_poll_s: float = 20.0  # longest a ``ready`` call is held
    reachability_timeout_s: float = 2.0  # for GET /v1/ping on a declared address
    max_body_bytes: int = 4 * MiB  # largest request body (a run's spec with its torrent)
    max_numwant: int = 200  # peers in one announce answer at most
    max_peers_per_run: int = 100_000
    # live identities of one run from one address (an IPv4 address, an IPv6 /64); from one network (an IPv4
    # /24, an IPv6 /48) 8 times as many; this machine's own (127.0.0.1, ::1) are not counted (tracker/origins.py)
    max_peers_per_address: int = 8
    max_swarm_peers: int = 100_000  # BitTorrent peers per info-hash
    join_rate_per_s: float = 20.0  # joins per second per client IP (token bucket); 0 = unlimited
    join_burst: int = 200
    # BitTorrent announces and scrapes per client IP (token bucket); 0 = unlimited. A client announces
    # every ``announce_interval_s``; the burst leaves room for many clients behind one NAT address.
    announce_rate_per_s: float = 50.0
    announce_burst: int = 500
    reachability_concurrency: int = 64
    credential_ttl_s: float = 24 * 3600.0  # a volunteer joins again after this long

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("host", "must be a host name or address to listen on")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"{self.port} is not a TCP port (0-65535)")
        if not self.db:
            raise ConfigError("db", "must be a file path or ':memory:'")
        if self.public_url is not None and not self.public_url.startswith(("http://", "https://")):
            raise ConfigError("public_url", f"{self.public_url!r} must start with http:// or https://")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError("admin_token", "must be at least 16 characters long")
        for name in (
            "peer_ttl_s",
            "heartbeat_interval_s",
            "long_poll_s",
            "reachability_timeout_s",
            "credential_ttl_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(name, "must be a positive number of seconds")
        self._check_silences()
        if self.long_poll_s > 120:
            raise ConfigError("long_poll_s", "must be at most 120 seconds")
        if self.min_announce_interval_s < 1 or self.announce_interval_s < self.min_announce_interval_s:
            raise ConfigError(
                "announce_interval_s", "must be at least min_announce_interval_s, which must be at least 1"
            )
        for name in (
            "max_body_bytes",
            "max_numwant",
            "max_peers_per_run",
            "max_peers_per_address",
            "max_swarm_peers",
            "join_burst",
            "announce_burst",
            "reachability_concurrency",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        if self.join_rate_per_s < 0:
            raise ConfigError("join_rate_per_s", "must be 0 (unlimited) or a positive rate")
        if not (math.isfinite(self.announce_rate_per_s) and self.announce_rate_per_s >= 0):
            raise ConfigError("announce_rate_per_s", "must be 0 (unlimited) or a positive rate")

    def _check_silences(self) -> None:
        """How long a peer may be silent: as a straggler (it loses what it owes), then at all (it expires)."""
        if not (self.straggler_intervals == 0 or 1 <= self.straggler_intervals < math.inf):
            raise ConfigError("straggler_intervals", "must be 0 (never) or a finite number of intervals ≥ 1")
        if self.heartbeat_interval_s * 2 > self.peer_ttl_s:
            raise ConfigError(
                "peer_ttl_s", "must be at least twice heartbeat_interval_s, or live peers would expire"
            )

    @property
    def swarm_ttl_s(self) -> float:
        """A BitTorrent peer that has not announced for two intervals (plus slack) is dropped."""
        return 2.0 * self.announce_interval_s + 10.0
