"""Events the volunteer engine emits. Frozen dataclasses, no rich, no torch: the view and the log lines
are built from these alone.

Every event has ``t`` (unix seconds). :func:`to_dict` gives the JSON-lines form (``{"event": "StepDone",
...}``). Modules that emit events take an ``emit`` callable; :func:`no_emit` drops them.

:class:`BatchComputed` and :class:`ParamsAfterStep` are records, not events: the engine builds them only
for a ``record`` callable it was given (tests replay samples and compare parameters with them), and they
never reach ``emit``, the view or the JSON lines.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


def _now() -> float:
    return time.time()


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    t: float = field(default_factory=_now)


# ------------------------------------------------------------ run and collaboration


@dataclass(frozen=True, slots=True, kw_only=True)
class Joined(Event):
    run_id: str
    run_name: str
    tracker: str
    peer_id: str
    device: str
    address: str | None  # None: client mode
    global_step: int
    target_batch_size: int
    recipe: str
    codec: str
    inner_steps: int = 1  # > 1: local-steps mode, a global step is an outer round of this many inner steps
    inner_bounds: tuple[int, int] | None = None  # inner_steps = "auto": the tracker chooses H within these
    backbone: bool = False  # join --backbone: it computes no gradients
    total_steps: int = 0  # the steps the run's schedule spans (its way to the end; 0: unknown)


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress(Event):
    """The tracker's view of the collaboration, from a heartbeat reply."""

    global_step: int
    samples: int
    target: int
    peers_online: int
    samples_per_s: float
    eta_s: float | None
    reachable: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Reachability(Event):
    """Where the tracker reaches this volunteer, once its checks answered (and whenever that changes)."""

    address: str | None  # the peer server's address as the tracker has it; None: client mode
    reachable: bool | None  # the tracker's check of ``address`` answered; None: client mode
    bt_address: str | None  # where the tracker tried the BitTorrent port
    bt_reachable: bool | None  # None: not checked
    asked_client_mode: bool  # --client-mode was given


@dataclass(frozen=True, slots=True, kw_only=True)
class PortMapped(Event):
    """What the home router answered when asked to forward one of this volunteer's ports (``--port-mapping``)."""

    what: str  # "peer server" or "BitTorrent"
    port: int  # the local TCP port
    via: str  # "UPnP" or "NAT-PMP"
    external_port: int | None  # the port the router forwards to it; None: it refused (``error`` says why)
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunNotice(Event):
    """A run-wide problem the tracker reports (e.g. no reachable volunteer), or None once it is over."""

    message: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChanged(Event):
    phase: str  # "downloading", "catching-up", "waiting-for-state" (no peer serves the run's state), "training", "waiting-for-step" (its share of the step is computed), "waiting-for-group", "averaging", "stepping", "evaluating" (the held-out split, every eval.every steps), "leaving"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDone(Event):
    """The volunteer applied the optimizer step for ``step`` and moved to ``step + 1``."""

    step: int
    lr: float
    contributed_samples: int  # this peer's samples in that step
    group_samples: int  # the samples the averaged gradient stands for
    step_time_s: float
    loss: float | None = None  # this peer's mean training loss over its micro-batches of the step
    compute_s: float = 0.0  # seconds its device spent computing the gradients it contributed to the step
    # share of its wall time since its first micro-batch spent computing gradients that entered an average
    compute_share: float | None = None
    delayed: bool = False  # applied one step late (the run's ``averaging.delay`` is 1)
    # local-steps mode: the step is an outer round (``lr`` is the outer learning rate, ``step_time_s`` the
    # round's averaging and outer step), and ``wall_s`` the round's wall time, from the previous step applied
    local: bool = False
    wall_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluated(Event):
    """The state after ``step`` steps, evaluated on the run's held-out samples (its spec's ``eval``)."""

    step: int
    loss: float  # mean over the samples
    metrics: dict[str, float]  # the recipe's, e.g. {"accuracy": 0.93}
    samples: int
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMissed(Event):
    step: int
    now_step: int
    dropped_samples: int  # accumulated on the parameters of ``step``: dropped, never averaged later


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalTraining(Event):
    """A summary of recent micro-batches."""

    loss: float
    samples: int  # accumulated toward the current step
    samples_per_s: float
    micro_batches: int  # total so far
    # as in StepDone, counting the step under way too (its gradients enter the average if its round succeeds):
    # a local-steps round is long, and its first showed 0 % until it ended
    compute_share: float | None = None
    inner_steps: int | None = None  # local-steps mode: inner steps taken in this round so far
    inner_lr: float | None = None  # local-steps mode: the inner optimizer's learning rate now


@dataclass(frozen=True, slots=True, kw_only=True)
class LogLine(Event):
    level: str
    message: str


# ------------------------------------------------------------ data set


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkVerified(Event):
    index: int
    name: str
    samples: int
    held: int
    total: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TorrentStats(Event):
    chunks_held: int
    chunks_total: int
    download_rate: float  # bytes/s
    upload_rate: float
    peers: int
    seeds: int
    downloaded: int  # payload bytes total
    uploaded: int
    progress: float  # 0..1


# ------------------------------------------------------------ averaging


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundDone(Event):
    round_id: str
    kind: str  # "grad" or "params"
    step: int
    members: tuple[str, ...]
    my_part: int  # -1 = client mode
    bytes_sent: int
    bytes_received: int
    raw_bytes: int  # what fp32 without compression would have moved
    duration_s: float
    phases: dict[str, float]  # seconds per phase, e.g. {"encode": .., "exchange": .., "decode": ..}
    dropped: tuple[str, ...]  # members whose contribution did not arrive in time
    rejected: tuple[str, ...]  # members whose contribution failed a check (and why, in LogLine)
    clipped: tuple[str, ...]  # members whose contribution was clipped to the norm bound
    failed_parts: tuple[int, ...]  # parts whose owner failed; local values kept
    duplicates: tuple[str, ...] = ()  # members that sent my part twice (the first copy counted; 409)

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.bytes_sent if self.bytes_sent else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundFailed(Event):
    round_id: str
    step: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AnswerRefused(Event):
    """A part owner's answer was not applied: its receipt did not hold (protocol/receipts.py)."""

    round_id: str
    step: int
    owner: str
    part: int
    reason: str
    proven: bool  # the receipt alone shows it (the tracker bars the owner on it)
    tracker: str  # what the tracker made of the complaint: barred, already barred, accused; "" unknown


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberPulling(Event):
    """A member's copy pointed against the other members' terms (a cosine below ``PULL_COS``, from the part
    owners' receipts); reported to the tracker (tracker/pulls.py)."""

    round_id: str
    step: int
    member: str
    alignment: float  # the cosine between its copy and the others' terms
    tracker: str  # what the tracker made of the report: barred, already barred, counted; "" unknown


# ------------------------------------------------------------ state sync


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSyncStarted(Event):
    step: int
    content_hash: str
    total_bytes: int
    donors: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSyncProgress(Event):
    done_bytes: int
    total_bytes: int
    rate: float  # bytes/s
    donors_active: int
    eta_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DonorBanned(Event):
    donor: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StateLoaded(Event):
    step: int
    content_hash: str
    duration_s: float
    donors_used: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class StateServed(Event):
    """This peer published a snapshot of its state for others to fetch."""

    step: int
    content_hash: str
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Left(Event):
    reason: str


Emit = Callable[[Event], None]


# ------------------------------------------------------------ records (tests), not events


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchComputed:
    """A micro-batch whose gradient was accumulated toward ``step`` (none are recorded while catching up:
    those gradients count for nothing)."""

    step: int
    provenance: tuple[tuple[int, int], ...]  # (chunk index, offset) of each sample, in order


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamsAfterStep:
    """The flat parameters once the averages of the steps below ``step`` are applied: a copy of the model's
    size, taken before training goes on, that the recorder keeps."""

    step: int
    params: np.ndarray


Record = Callable[[BatchComputed | ParamsAfterStep], None]


def no_emit(event: Event) -> None:
    """An ``emit`` that drops events."""


def to_dict(event: Event) -> dict[str, Any]:
    data: dict[str, Any] = {"event": type(event).__name__}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        data[f.name] = list(value) if isinstance(value, tuple) else value
    return data
