"""The volunteer's settings: one frozen dataclass, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from crowdtrain.protocol.errors import ConfigError
from crowdtrain.volunteer.state.config import StateConfig


def split_advertise(advertise: str) -> tuple[str, int | None]:
    """``"HOST"`` -> (HOST, None); ``"HOST:PORT"`` or ``"[V6]:PORT"`` -> (HOST, PORT)."""
    host, sep, port = advertise.rpartition(":")
    if not sep or (host.count(":") and not host.endswith("]")):  # no port (a bare IPv6 address too)
        return advertise, None
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError("advertise", f"{advertise!r}: the port must be a number between 1 and 65535")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class VolunteerConfig:
    run_id: str
    tracker_url: str
    data_dir: Path
    token: str | None = field(default=None, repr=False)  # join token of a private run; not in repr
    device: str = "auto"  # auto, cpu or cuda
    host: str = "0.0.0.0"  # the interface the peer server and the BitTorrent session listen on (all)
    port: int = 0  # peer server port; 0 = any free port
    bt_port: int = 0  # BitTorrent port; 0 = any free port
    # "HOST" or "HOST:PORT" others reach the peer server at (port forwarding, a relay). Default: the
    # address the tracker sees this volunteer's requests come from, with ``port``.
    advertise: str | None = None
    client_mode: bool = False  # declare no address: own no all-reduce part, serve no state
    # ask the home router (UPnP-IGD, NAT-PMP) to forward the peer server's and BitTorrent's ports while it
    # runs; never from a loopback --host. `crowdtrain join` turns it on (--no-port-mapping: off)
    port_mapping: bool = False
    # a backbone peer: computes no gradients; owns parts of the average, serves the state and seeds the data set
    backbone: bool = False
    max_batch: int | None = None  # cap on the micro-batch size
    max_steps: int | None = None  # leave once the run's global step reaches this (demos, tests)
    seed: int | None = None  # sampler seed; default: derived from the peer id
    tracker_timeout_s: float = 10.0
    catch_up: bool = True  # fetch the state from peers when behind
    snapshot_every: int = 1  # snapshot at most every this many steps (more apart when writes are slow)
    state: StateConfig = field(default_factory=StateConfig)  # serving and fetching the run's state
    init_from: Path | None = None  # a `crowdtrain export` checkpoint to start from when no peer serves state

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ConfigError("run_id", "must not be empty")
        if not self.tracker_url.startswith(("http://", "https://")):
            raise ConfigError("tracker", f"{self.tracker_url!r} is not an http:// or https:// URL")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", f"{self.device!r} is not one of auto, cpu, cuda")
        for name in ("port", "bt_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(name, "must be between 0 and 65535")
        if self.advertise is not None:
            host, port = split_advertise(self.advertise)
            # (":PORT": the address the tracker sees, at another port: a router's forward)
            if host in ("0.0.0.0", "::", "[::]") or (host == "" and port is None):
                raise ConfigError("advertise", f"{self.advertise!r} names no host others could reach")
        if self.client_mode and self.advertise is not None:
            raise ConfigError("advertise", "a volunteer in client mode declares no address; drop one of them")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError("max_batch", "must be at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError("max_steps", "must be at least 1")
        if self.tracker_timeout_s <= 0:
            raise ConfigError("tracker_timeout_s", "must be positive")
        if self.snapshot_every < 1:
            raise ConfigError("snapshot_every", "must be at least 1")
