"""What each panel of the view shows: one frozen record per panel, with the figures derived from it.

:class:`~crowdtrain.volunteer.view.state.ViewState` holds one of each; the fold there moves each record
by its own rules, and :mod:`~crowdtrain.volunteer.view.render` draws each into its panel. Figures only:
no rich, no clocks (the uptime takes ``now`` as an argument).
"""

from __future__ import annotations

from dataclasses import dataclass

from crowdtrain.volunteer import events as ev


@dataclass(frozen=True, slots=True)
class RecentStep:
    step: int
    contributed: int
    group: int
    step_time_s: float  # its averaging and step (in local-steps mode: of the outer round)
    wall_s: float | None = None  # from the previous step applied to this one


@dataclass(frozen=True, slots=True)
class LogEntry:
    t: float
    level: str
    message: str


@dataclass(frozen=True, slots=True)
class Header:
    """Who and where: the run, the tracker, this peer, its address and whether others reach it, its phase."""

    run_id: str = ""
    run_name: str = ""
    tracker: str = ""
    peer_id: str = ""
    device: str = ""
    address: str | None = None
    recipe: str = ""
    codec: str = ""
    joined_at: float | None = None
    phase: str = "starting"
    left_reason: str | None = None
    reachable: bool | None = None
    reach_text: str | None = None  # the Reachability sentence
    reach_level: str = "info"
    notice: str | None = None  # a run-wide problem reported by the tracker

    def uptime(self, now: float | None) -> float | None:
        if self.joined_at is None or now is None:
            return None
        return max(0.0, now - self.joined_at)


@dataclass(frozen=True, slots=True)
class Collab:
    """The collaboration as the tracker reports it: its step and the samples gathered toward the target."""

    global_step: int | None = None
    samples: int = 0
    target: int = 0
    peers_online: int = 0
    run_samples_per_s: float = 0.0
    eta_s: float | None = None
    total_steps: int = 0  # the run's schedule spans these steps (0: unknown)

    @property
    def target_fraction(self) -> float | None:
        return min(1.0, self.samples / self.target) if self.target else None


@dataclass(frozen=True, slots=True)
class Training:
    """This machine's training: its step, loss, speed, and its record over the steps it took part in."""

    local_step: int | None = None
    lr: float | None = None  # in local-steps mode the outer learning rate
    inner_lr: float | None = None  # local-steps mode: the inner optimizer's
    local: bool = False  # a local-steps run: a step is an outer round of inner steps
    loss: float | None = None
    loss_history: tuple[float, ...] = ()
    # the newest held-out evaluation (the run's eval split): (step, loss, metrics)
    held_out: tuple[int, float, dict[str, float]] | None = None
    local_samples: int = 0
    local_samples_per_s: float = 0.0
    micro_batches: int = 0
    inner_steps: int | None = None  # local-steps mode: inner steps taken in this round so far
    # share of wall time since the first micro-batch spent computing gradients that entered an average;
    # the newest known figure (an event that does not know it keeps the last one)
    compute_share: float | None = None
    recent_steps: tuple[RecentStep, ...] = ()
    steps_done: int = 0
    steps_missed: int = 0
    samples_dropped: int = 0  # accumulated on parameters of a missed step, never averaged

    @property
    def step_time_s(self) -> float | None:
        """Mean averaging time (the all-reduce and the step) of the recent steps."""
        if not self.recent_steps:
            return None
        return sum(s.step_time_s for s in self.recent_steps) / len(self.recent_steps)

    @property
    def wall_s(self) -> float | None:
        """Mean wall time of the recent steps (from one applied to the next)."""
        walls = [s.wall_s for s in self.recent_steps if s.wall_s is not None]
        return sum(walls) / len(walls) if walls else None

    @property
    def contribution_share(self) -> float | None:
        """My samples / the group's samples over the recent steps."""
        group = sum(s.group for s in self.recent_steps)
        if not group:
            return None
        return sum(s.contributed for s in self.recent_steps) / group


@dataclass(frozen=True, slots=True)
class DataSet:
    """The data set's torrent: chunks held, transfer rates, the swarm."""

    chunks_held: int = 0
    chunks_total: int = 0
    last_chunk: str | None = None
    download_rate: float = 0.0
    upload_rate: float = 0.0
    swarm_peers: int = 0
    swarm_seeds: int = 0
    downloaded: int = 0
    uploaded: int = 0

    @property
    def seeding_ratio(self) -> float | None:
        """Uploaded / downloaded payload bytes."""
        return self.uploaded / self.downloaded if self.downloaded else None

    @property
    def chunks_fraction(self) -> float | None:
        return self.chunks_held / self.chunks_total if self.chunks_total else None


@dataclass(frozen=True, slots=True)
class Averaging:
    """The group rounds: the newest one in full, counts and bytes over all of them."""

    last_round: ev.RoundDone | None = None
    rounds_done: int = 0
    rounds_failed: int = 0
    last_failure: str | None = None
    bytes_sent_total: int = 0
    raw_bytes_total: int = 0

    @property
    def overall_compression(self) -> float | None:
        return self.raw_bytes_total / self.bytes_sent_total if self.bytes_sent_total else None


@dataclass(frozen=True, slots=True)
class StateSync:
    """The state this machine holds, the download that catches it up, and the state it serves to others."""

    state_step: int | None = None
    state_hash: str | None = None
    syncing: bool = False
    sync_step: int | None = None
    sync_hash: str | None = None
    sync_done_bytes: int = 0
    sync_total_bytes: int = 0
    sync_rate: float = 0.0
    sync_eta_s: float | None = None
    sync_donors: tuple[str, ...] = ()
    donors_active: int = 0
    donors_banned: tuple[tuple[str, str], ...] = ()  # (donor, reason), newest last
    last_sync_s: float | None = None
    served_step: int | None = None
    served_size: int = 0
    served_hash: str | None = None

    @property
    def sync_fraction(self) -> float | None:
        return self.sync_done_bytes / self.sync_total_bytes if self.sync_total_bytes else None


__all__ = ["Averaging", "Collab", "DataSet", "Header", "LogEntry", "RecentStep", "StateSync", "Training"]
