"""The volunteer engine: join a run, train on the chunks it has, average with its group, step, repeat.

The engine emits :mod:`crowdtrain.volunteer.events` and never imports rich. One :class:`Volunteer` lives in
one ``asyncio.run``; its long-lived tasks (torrent, heartbeats, statistics, training) share a TaskGroup.

A global step, as this peer sees it (DeDLOC):

1. accumulate micro-batches from verified chunks (gradients weighted by samples) while heartbeats report
   the count to the tracker;
2. when the tracker says the step's target is reached, stop accumulating and long-poll ``ready`` with the
   accumulated sample count as weight;
3. the tracker answers with a signed group (and this peer's allotment of the next step); the group
   all-reduces the mean gradient; every member applies the same averaged gradient with the same optimizer
   and moves to the next step; every ``average_state_every`` steps the group also averages parameters.
   With the run's ``averaging.delay = 1`` the all-reduce runs in the background while the next step's
   gradients are computed on the same parameters, and its average is applied when that next step closes;
4. a step that closed without this peer (``missed``) drops its accumulation (no gradient outlives its
   parameters) and the peer fetches the current state from peers, taking part with weight 0 meanwhile.

After each optimizer step a state snapshot is written in the background, straight from the tensors to a
file (:func:`~crowdtrain.volunteer.state.snapshot.save_snapshot`), and served once complete; the previous
one is served meanwhile. Training never waits for it, except that the next optimizer step waits for a
write still in progress (it reads the live tensors). Snapshots are written every K steps (a power of two,
see SNAPSHOT_SPACING), so that writing them takes at most a fifth of the wall time and peers' snapshots
fall on the same steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from crowdtrain import __version__
from crowdtrain.datasets.sampler import Batch, Sampler
from crowdtrain.datasets.session import SessionConfig, TorrentSession, listen_address
from crowdtrain.protocol.aio import wait_at_most
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import SigningKey, verify_assignment
from crowdtrain.protocol.errors import (
    AveragingError,
    CrowdtrainError,
    DatasetError,
    ProtocolError,
    RecipeError,
    StateSyncError,
    TrackerError,
)
from crowdtrain.protocol.messages import (
    PEER_PROTOCOL,
    DonorList,
    EvalReport,
    GroupAssignment,
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    LeaveRequest,
    ReadyReply,
    ReadyRequest,
    RunSpec,
    StateDeclare,
)
from crowdtrain.protocol.runcheck import check_run
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.averaging.allreduce import Averager, part_bounds
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.config import VolunteerConfig, split_advertise
from crowdtrain.volunteer.models import check_param_hash, get_recipe, preflight
from crowdtrain.volunteer.models.origin import check_origin
from crowdtrain.volunteer.peer_server import PeerServer
from crowdtrain.volunteer.state.fetch import fetch_state
from crowdtrain.volunteer.state.serve import StateServer
from crowdtrain.volunteer.state.snapshot import (
    SnapshotHeader,
    load_snapshot,
    read_snapshot_header,
    save_snapshot,
)
from crowdtrain.volunteer.trainer import Trainer, all_finite, resolve_device

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 3.0
STATS_INTERVAL_S = 1.0
LOCAL_REPORT_S = 1.0
WATCH_S = 20.0  # long-poll for a step's close (the tracker may cap it)
IDLE_POLL_S = 0.2  # at its share of the step: how often to ask whether the step closed or needs more
# The compute rate a peer reports (the tracker shares each step out by it) is samples ÷ seconds over its
# last RATE_WINDOW micro-batches, not a smoothing that weighs the last few most: where peers share cores,
# the last to finish a step computes alone and fast for a moment, and a rate taken there would allot it more
# of the next step, which it then finishes last again while the others wait.
RATE_WINDOW = 16
# Writing snapshots takes at most 1/SNAPSHOT_SPACING of the time: every K steps, K the smallest power of
# two (times ``snapshot_every``) with K × step time ≥ SNAPSHOT_SPACING × write time. Powers of two keep the
# peers' snapshots on the same steps (those of a slower writer are a subset), so a newcomer finds several
# donors of one version.
SNAPSHOT_SPACING = 4.0
# A peer waiting for a newer state asks the tracker's donor list at least this often (seconds).
STATE_POLL_S = 5.0
WAIT_STATE_S = 2.0  # no peer serves the run's state: ask again this often


class _Replay:
    """The averages a catching-up peer receives, kept in files until the fetched state is loaded: a fetch
    may take several steps, and each held in memory would cost a vector of the model's size."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._steps: dict[int, bool] = {}  # step -> whether averaged parameters came with it

    def __contains__(self, step: int) -> bool:
        return step in self._steps

    @property
    def first(self) -> int | None:
        """The earliest step held (None when empty)."""
        return min(self._steps, default=None)

    def _path(self, step: int, what: str) -> Path:
        return self.folder / f"replay-{step}-{what}.f32"

    def put(self, step: int, mean: np.ndarray, params: np.ndarray | None) -> None:
        """Blocking (writes files): call it in a thread."""
        mean.tofile(self._path(step, "grad"))
        if params is not None:
            params.tofile(self._path(step, "params"))
        self._steps[step] = params is not None

    def take(self, step: int, into: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The average (read into ``into`` when given: no vector of the model's size is allocated for it)
        and the parameters kept for ``step``. Blocking (reads files): call it in a thread."""
        has_params = self._steps.pop(step)
        mean = self._read(self._path(step, "grad"), into)
        params = self._read(self._path(step, "params"), None) if has_params else None
        return mean, params

    @staticmethod
    def _read(path: Path, into: np.ndarray | None) -> np.ndarray:
        with open(path, "rb") as f:
            if into is None:
                values = np.fromfile(f, dtype=np.float32)
            elif f.readinto(memoryview(into).cast("B")) == into.nbytes and not f.read(1):
                values = into
            else:
                raise StateSyncError(f"replay file {path.name} does not hold {into.size} values")
        path.unlink()
        return values

    def clear(self) -> None:
        for step, has_params in self._steps.items():
            self._path(step, "grad").unlink(missing_ok=True)
            if has_params:
                self._path(step, "params").unlink(missing_ok=True)
        self._steps.clear()


@dataclass(slots=True)
class _Taken:
    """A step's gradient, taken out of the accumulation at its boundary (or, with delay 1, as soon as this
    peer's share of the step was computed)."""

    step: int
    weight: int  # this peer's samples in it
    compute_s: float
    loss: float | None
    grad: np.ndarray


@dataclass(slots=True)
class _Round:
    """One step's averaging as this peer takes part in it."""

    step: int
    phases: list[GroupAssignment]
    weight: int  # this peer's samples in it
    catching_up: bool  # started while catching up: weight 0, its average is kept for the replay
    compute_s: float  # seconds of compute behind the gradient it contributes
    loss: float | None
    started: float  # monotonic
    mean: np.ndarray | None = None  # the averaged gradient (None: the round failed)
    params: np.ndarray | None = None  # averaged parameters, when the round averages them
    error: str | None = None  # why it failed as a whole

    @property
    def group_samples(self) -> int:
        if not self.phases:  # a round replayed after a catch-up
            return 0
        return self.phases[0].step_samples or sum(m.weight for m in self.phases[0].members)

    @property
    def average_params(self) -> bool:
        return bool(self.phases) and self.phases[0].average_params


@dataclass(slots=True)
class Summary:
    """What one volunteer did, for the CLI's last line and the demo's summary."""

    peer_id: str = ""
    first_step: int = 0
    last_step: int = 0
    steps_done: int = 0
    steps_missed: int = 0
    losses: list[float] = field(default_factory=list)  # its mean training loss of each step it took
    bytes_sent: int = 0
    raw_bytes: int = 0
    caught_up_to: int | None = None
    # share of its wall time since its first micro-batch spent computing gradients that entered an average
    compute_share: float | None = None
    ended: str | None = None  # the tracker's sentence when the run was closed or deleted under it


def load_checkpoint(model: torch.nn.Module, path, spec: RunSpec) -> int:
    """Load the weights `crowdtrain export` wrote for this run's recipe and args; returns its step."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("crowdtrain", "{}"))
        tensors = load_file(str(path))
    except (OSError, SafetensorError, ValueError) as exc:
        raise RecipeError(
            f"cannot read the checkpoint {path} ({exc}); give a file `crowdtrain export` wrote"
        ) from None
    if meta.get("recipe") != spec.model.recipe or meta.get("args") != dict(spec.model.args):
        raise RecipeError(
            f"checkpoint {path} holds {meta.get('recipe')!r} with args {meta.get('args')}, but run "
            f"{spec.run_id} trains {spec.model.recipe!r} with args {dict(spec.model.args)}"
        )
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise RecipeError(f"checkpoint {path} does not fit the run's model: {exc}") from None
    return int(meta.get("step", 0))


class Volunteer:
    """One volunteer. ``emit`` receives its events (for the view, the JSON lines); :meth:`emit` only passes
    them on.

    ``record`` is for tests: a callable that receives :class:`~crowdtrain.volunteer.events.BatchComputed`
    (each micro-batch's provenance, by the step its gradient was accumulated toward) and
    :class:`~crowdtrain.volunteer.events.ParamsAfterStep` (a copy of the flat parameters after each applied
    step, and after a catch-up). It is given at construction, never changed, and kept apart from ``emit``:
    a copy of the model's size is taken only when a ``record`` was given, right after the step is applied
    and before training goes on (so the copy holds that step's parameters, whenever the recorder reads
    it). Without one (the CLI), no record is built and no copy made.
    """

    def __init__(
        self, config: VolunteerConfig, emit: ev.Emit = ev.no_emit, record: ev.Record | None = None
    ) -> None:
        self.config = config
        self._emit_outer = emit
        self._record = record
        self.summary = Summary()
        self.key = SigningKey()
        self.spec: RunSpec | None = None
        self.peer_id = ""
        self.step = 0  # the global step this peer accumulates for
        self.trainer: Trainer | None = None
        self.sampler: Sampler | None = None
        # the recipe's whole argument set (the spec's, defaults filled in)
        self.model_args: dict[str, int | float | str | bool] = {}
        self._data_error: DatasetError | None = None  # a verified chunk the sampler refused
        # the run's held-out split (spec.eval): its chunks feed the evaluation sampler, never training
        self._holdout: frozenset[int] = frozenset()
        self._eval_sampler: Sampler | None = None
        self._eval_batch: Batch | None = None  # drawn once every held-out chunk is held: the same everywhere
        self._eval_report: EvalReport | None = None  # the newest, sent with every heartbeat
        self._reply: HeartbeatReply | None = None
        self._reply_changed = asyncio.Event()
        self._heartbeat_now = asyncio.Event()  # set: send the next heartbeat now
        self._quota: tuple[int, int] | None = None  # (step, samples to accumulate for it: the allotment)
        self._quota_since = time.monotonic()  # when the last allotment arrived
        self._step_loss = (0.0, 0)  # Σ loss × samples and samples of the micro-batches toward this step
        self._at_quota = False  # stopped at its share of the step, waiting for the close
        self._stop = asyncio.Event()
        self._loss_ema: float | None = None
        self._rate_window: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)  # (samples, seconds)
        self._address: str | None = None  # where others reach this peer (for the view)
        self._declared: str | None = None  # what the join and heartbeats declare (see _declared_address)
        self._notice: str | None = None
        self._reachability: tuple | None = None
        self._chunks_held = 0
        self._pending_state: asyncio.Task | None = None
        # While catching up: each step's averaged gradient (and parameters), replayed on load.
        self._replay = _Replay(config.data_dir / "crowdtrain-state")
        # the mean gradient lands in these, phase by phase, reused every step
        self._mean_bufs: list[np.ndarray | None] = [None, None]
        self.delay = 0  # the run's averaging.delay, set on joining
        self._round_task: asyncio.Future[_Round] | None = None  # delay 1: the step averaged in the background
        self._grad_buf: np.ndarray | None = None  # delay 1 (or a GPU): the gradient handed to the all-reduce
        # delay 1: this step's gradient, taken once its share was computed; meanwhile the next step's
        # micro-batches are computed ahead, up to ``_next_cap``: its share of a step by rate, as the tracker
        # last said (``_ahead_share``, it moves with the rates), or half its allotment if it does not say
        self._early: _Taken | None = None
        self._ahead_share: int | None = None
        # its ready call, made as soon as a heartbeat says the step closed: (step, task)
        self._ready_task: tuple[int, asyncio.Task[ReadyReply | None]] | None = None
        self._asking: int | None = None  # the step the training loop asks a group for, if it does
        self._applied = 0  # the parameters hold the averages of the steps below this one
        # compute share: seconds computing gradients that entered an average, since the first micro-batch
        self._compute_t0: float | None = None
        self._step_compute_s = 0.0  # behind the gradient accumulated for the current step
        self._useful_compute_s = 0.0
        # snapshots, written in the background
        self._snapshot_task: asyncio.Task | None = None
        self._snapshot_writing: asyncio.Future | None = None  # the write itself (it reads live tensors)
        self._snapshot_every = config.snapshot_every  # K (see SNAPSHOT_SPACING), adapted after each write
        self._last_applied_at: float | None = None
        self._step_s = 0.0  # smoothed time between two applied steps
        self._state_dir = config.data_dir / "crowdtrain-state"  # snapshots, a fetched state, the replay
        # the state this peer held when it last left the run: outlives the run's volunteers (see _keep_state)
        self._kept = config.data_dir / "crowdtrain-kept" / f"{config.run_id}.safetensors"
        self._init_step: int | None = None  # the step of the --init-from checkpoint loaded, if any
        self._waiting: str | None = None  # why it waits for the run's state (no peer serves it), said once
        self._stepping = False  # an optimizer step is being applied (a thread changes the tensors)
        self.state_server: StateServer | None = None
        # set while joining (run): the tracker's client, the BitTorrent session and its download, the
        # averager, this peer's credential and the run's heartbeat interval
        self.tracker: TrackerClient | None = None
        self.torrent: TorrentSession | None = None
        self.download = None
        self.averager: Averager | None = None
        self.credential = None
        self.heartbeat_interval = 1.0
        self.sampler_seed = 0

    # ------------------------------------------------------------------ plumbing

    def emit(self, event: ev.Event) -> None:
        self._emit_outer(event)

    def _emit_averaging(self, event: ev.Event) -> None:
        """The averager's ``emit``: its rounds' bytes count in the summary, then the event goes out."""
        if isinstance(event, ev.RoundDone):
            self.summary.bytes_sent += event.bytes_sent
            self.summary.raw_bytes += event.raw_bytes
        self.emit(event)

    async def _record_params(self) -> None:
        """Hand ``record`` (if given) a copy of the parameters, which hold the steps below ``_applied``:
        taken now, before training changes them."""
        if self._record is not None:
            params = await asyncio.to_thread(self.trainer.flat_params)
            self._record(ev.ParamsAfterStep(step=self._applied, params=params))

    def stop(self) -> None:
        """Ask the engine to leave after the current micro-batch or round."""
        self._stop.set()

    def _note(self, level: int, message: str, *args: object) -> None:
        """A line for the user: the view shows it (log panel, plain or JSON line); no second copy in logging."""
        text = message % args if args else message
        self.emit(ev.LogLine(level=logging.getLevelName(level), message=text))

    def _phase(self, phase: str) -> None:
        self.emit(ev.PhaseChanged(phase=phase))

    # ------------------------------------------------------------------ the whole life of a volunteer

    async def run(self) -> Summary:
        cfg = self.config
        async with TrackerClient(cfg.tracker_url, timeout_s=cfg.tracker_timeout_s) as tracker:
            self.tracker = tracker
            spec = await tracker.get_spec(cfg.run_id)
            check_run(spec)  # a run no volunteer can run is refused here with the field's name
            self.spec = spec
            recipe = get_recipe(spec.model.recipe)
            check_origin(spec.model.recipe, recipe, spec.model.package, spec.model.code_hash)
            self.model_args = preflight.resolved_args(recipe, spec.model.args)
            model = await asyncio.to_thread(preflight.build, recipe, self.model_args)
            check_param_hash(model, spec.model.param_hash)
            await asyncio.to_thread(preflight.check_initial_hash, recipe, model, spec.model.init_hash)
            if cfg.init_from is not None:
                self._init_step = await asyncio.to_thread(load_checkpoint, model, cfg.init_from, spec)
            device = str(resolve_device(cfg.device))  # "cpu", "cuda", "cuda:1"
            self.trainer = Trainer(recipe, model, spec.optimizer, spec.schedule, device=device)
            torrent = await tracker.get_torrent(cfg.run_id)

            # Listen before joining, so the address the join declares answers the tracker's check at once.
            server = PeerServer(cfg.host, cfg.port)
            try:
                port = server.bind()
            except OSError as exc:
                raise CrowdtrainError(
                    f"cannot listen on {listen_address(cfg.host, cfg.port)} for peers ({exc.strerror}); "
                    "choose another --port or --host"
                ) from None
            try:
                self.torrent = TorrentSession(SessionConfig(listen=listen_address(cfg.host, cfg.bt_port)))
                await self.torrent.start()
                self._declared = self._declared_address(port)
                join = await tracker.join(
                    cfg.run_id,
                    JoinRequest(
                        public_key=self.key.public_hex,
                        address=self._declared,
                        token=cfg.token,
                        device=device,
                        client_version=__version__,
                        peer_protocol=PEER_PROTOCOL,
                    ),
                )
            except BaseException:
                await server.stop()
                if self.torrent is not None:
                    await self.torrent.close()
                raise
            self.peer_id = join.peer_id
            self.credential = join.credential
            self.heartbeat_interval = join.heartbeat_interval_s
            self.step = join.global_step
            self._applied = join.global_step
            self.delay = spec.averaging.delay
            self.summary.peer_id = join.peer_id
            self.summary.first_step = join.global_step
            server.peer_id = join.peer_id
            if self._declared is not None:
                host = self._declared.rpartition(":")[0] or join.observed_host or "?"
                if ":" in host and not host.startswith("["):
                    host = f"[{host}]"
                self._address = f"{host}:{self._declared.rpartition(':')[2]}"

            reason = "finished"
            try:
                self.averager = Averager(
                    run_id=cfg.run_id,
                    tracker_public_key=spec.tracker_public_key,
                    peer_id=join.peer_id,
                    key=self.key,
                    credential=join.credential,
                    config=AveragingConfig.from_spec(spec.averaging),
                    emit=self._emit_averaging,
                )
                # snapshots live in files of their own; leftovers of an earlier run of this peer go
                await asyncio.to_thread(shutil.rmtree, self._state_dir, True)
                self._state_dir.mkdir(parents=True, exist_ok=True)
                self.state_server = StateServer(
                    run_id=cfg.run_id,
                    tracker_public_key=spec.tracker_public_key,
                    config=cfg.state,
                    emit=self.emit,
                )
                server.add_routes(self.averager.routes())
                server.add_routes(self.state_server.routes())
                await server.start()

                manifest = spec.dataset.manifest
                self.sampler_seed = (
                    cfg.seed
                    if cfg.seed is not None
                    else int.from_bytes(bytes.fromhex(self.key.public_hex)[:4])
                )
                # windows of seq_len + 1 tokens, ids below vocab: for the training and the held-out sampler
                cut = {
                    "seq_len": preflight.window(recipe, self.model_args),
                    "vocab": preflight.vocab_of(recipe, self.model_args),
                }
                self.sampler = Sampler(manifest, cfg.data_dir, seed=self.sampler_seed, **cut)
                if spec.eval.every:
                    n = len(manifest.chunks)
                    self._holdout = frozenset(range(n - spec.eval.holdout_chunks, n))
                    # the run's seed: every volunteer draws the same held-out samples
                    self._eval_sampler = Sampler(manifest, cfg.data_dir, seed=spec.seed, **cut)
                self.emit(
                    ev.Joined(
                        run_id=cfg.run_id,
                        run_name=spec.name,
                        tracker=cfg.tracker_url,
                        peer_id=join.peer_id,
                        device=device,
                        address=self._address,
                        global_step=join.global_step,
                        target_batch_size=spec.target_batch_size,
                        recipe=spec.model.recipe,
                        codec=spec.averaging.codec,
                    )
                )
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._stream(torrent))
                    tg.create_task(self._heartbeats())
                    watch = tg.create_task(self._watch_steps())
                    tg.create_task(self._torrent_stats())
                    train = tg.create_task(self._train())
                    await train
                    self._stop.set()
                    watch.cancel()  # its long-poll would hold the exit for up to WATCH_S
            except asyncio.CancelledError:
                reason = "interrupted"
                raise
            finally:
                self._stop.set()
                self._phase("leaving")
                if self._pending_state is not None:
                    self._pending_state.cancel()
                ready = self._ready_task[1] if self._ready_task is not None else None
                for task in (self._round_task, self._snapshot_task, ready):
                    if task is not None and not task.done():
                        task.cancel()
                await self._snapshot_written()  # a thread: let it finish its file
                await self._keep_state()
                # In order: stop accepting peers, tell the tracker, then close what talks to the network.
                await server.stop()
                with contextlib.suppress(CrowdtrainError, TimeoutError, OSError):
                    async with asyncio.timeout(LEAVE_TIMEOUT_S):
                        await tracker.leave(
                            cfg.run_id, LeaveRequest(peer_id=self.peer_id), self.key, self.credential
                        )
                if self.averager is not None:
                    await self.averager.close()
                if self.torrent is not None:
                    await self.torrent.close()
                if self.state_server is not None:
                    self.state_server.close()
                self.summary.last_step = self.step
                self.summary.compute_share = self._compute_share()
                self.emit(ev.Left(reason="run closed" if self.summary.ended else reason))
        return self.summary

    def _declared_address(self, port: int) -> str | None:
        """What the join and heartbeats declare: None in client mode, ``--advertise``, or ``":PORT"``
        (the tracker fills in the address it sees this volunteer's requests come from)."""
        cfg = self.config
        if cfg.client_mode:
            return None
        if cfg.advertise is not None:
            host, advertised_port = split_advertise(cfg.advertise)
            return f"{host}:{advertised_port or port}"
        return f":{port}"

    def _told_reachability(self, reply: HeartbeatReply) -> None:
        """Tell the user where others reach this machine, once the tracker's checks answered, and again
        whenever that changes; and any run-wide problem the tracker reports."""
        if reply.notice != self._notice:
            self._notice = reply.notice
            self.emit(ev.RunNotice(message=reply.notice))
        settled = self._declared is None or reply.checked
        bt_settled = reply.bt_reachable is not None or reply.bt_address is None
        if not settled or not bt_settled:
            return
        seen = ev.Reachability(
            address=reply.address,
            reachable=reply.reachable if self._declared is not None else None,
            bt_address=reply.bt_address,
            bt_reachable=reply.bt_reachable,
            asked_client_mode=self.config.client_mode,
        )
        key = (seen.address, seen.reachable, seen.bt_address, seen.bt_reachable)
        if key != self._reachability:
            self._reachability = key
            self.emit(seen)

    # ------------------------------------------------------------------ data

    async def _stream(self, torrent: bytes) -> None:
        manifest = self.spec.dataset.manifest

        def on_chunk(chunk) -> None:
            try:
                if chunk.index in self._holdout:
                    self._eval_sampler.add_chunk(chunk.index)
                    if self._eval_sampler.held == self._holdout and self._eval_sampler.ready:
                        self._eval_batch = self._eval_sampler.batch(self.spec.eval.samples)
                else:
                    self.sampler.add_chunk(chunk.index)
            except DatasetError as exc:  # (called by the torrent session's alert loop: not raised there)
                self._data_error = self._data_error or exc  # a chunk the run's model cannot take: the train
                return  # loop ends the volunteer with this sentence
            self._chunks_held += 1
            self.emit(
                ev.ChunkVerified(
                    index=chunk.index,
                    name=chunk.name,
                    samples=chunk.samples,
                    held=self._chunks_held,
                    total=len(manifest.chunks),
                )
            )

        self.download = await self.torrent.stream(
            torrent, self.config.data_dir, manifest, seed=self.sampler_seed, on_chunk=on_chunk
        )

    async def _torrent_stats(self) -> None:
        while not self._stop.is_set():
            if self.download is None:
                await asyncio.sleep(0.1)
                continue
            # libtorrent answers a status query from its network thread: a busy one must not stall the event
            # loop (heartbeats, rounds, Ctrl-C)
            s = await asyncio.to_thread(self.download.stats)
            self.emit(
                ev.TorrentStats(
                    chunks_held=s.chunks_held,
                    chunks_total=s.chunks_total,
                    download_rate=s.download_rate,
                    upload_rate=s.upload_rate,
                    peers=s.peers,
                    seeds=s.seeds,
                    downloaded=s.downloaded,
                    uploaded=s.uploaded,
                    progress=s.progress,
                )
            )
            await wait_at_most(self._stop, STATS_INTERVAL_S)

    # ------------------------------------------------------------------ tracker

    async def _heartbeat_once(self) -> None:
        step = self.step
        # while catching up its gradients are computed on parameters that are not the run's: none count
        early = self._early
        samples = 0 if self._pending_state is not None else early.weight if early else self.trainer.samples
        reply = await self.tracker.heartbeat(
            self.config.run_id,
            Heartbeat(
                peer_id=self.peer_id,
                step=step,
                samples=samples,
                # what it computes counts: not catching up, holding a chunk
                # (with its share taken early, it computes for the next step: done with this one)
                computing=self._pending_state is None and self.sampler.ready and early is None,
                samples_per_s=self._samples_per_s,
                address=self._declared,
                chunks_held=self._chunks_held,
                # (computed while catching up, on parameters that are not the run's: not the run's loss)
                loss=self._loss_ema if self._pending_state is None else None,
                bt_port=self._bt_port(),
                compute_share=self._compute_share(),
                eval=self._eval_report,
            ),
            self.key,
            self.credential,
        )
        self._set_quota(reply, step)
        self._ahead_share = reply.ahead_share
        self._reply = reply
        self._reply_changed.set()
        early = self._early
        if (
            early is not None
            and reply.step_closed
            and reply.global_step == early.step
            and self._ready_task is None
            and self._asking != early.step
        ):
            # computing ahead: say "ready" now, not after the micro-batch in flight
            task = asyncio.get_running_loop().create_task(
                self._ask_group(early.step, early.weight, ahead=True)
            )
            self._ready_task = (early.step, task)
        self._told_reachability(reply)
        self.emit(
            ev.Progress(
                global_step=reply.global_step,
                samples=reply.samples,
                target=reply.target,
                peers_online=reply.peers_online,
                samples_per_s=reply.samples_per_s,
                eta_s=reply.eta_s,
                reachable=reply.reachable,
            )
        )

    def _set_quota(self, reply: HeartbeatReply, step: int) -> None:
        """Keep the tracker's allotment for this step: this peer's share of the target, by rate. Every peer
        stops at its allotment and reports at once, and the allotments never sum above the target, so the
        step closes on exactly its target."""
        if reply.global_step == step == self.step and reply.allotment is not None:
            self._quota = (step, reply.allotment)
            self._quota_since = time.monotonic()

    def _quota_now(self) -> int | None:
        """How many samples to accumulate for the current step; None: as many as it can (no allotment,
        because the tracker has not answered for this step for two heartbeat intervals, or it catches up)."""
        if self._pending_state is not None:
            return None
        if self._early is not None:
            return self._next_cap(self._early.weight)
        if self._quota is not None and self._quota[0] == self.step:
            return self._quota[1]
        # a new step: wait (a round trip) for the allotment, unless the tracker is silent
        silent = time.monotonic() - self._quota_since > 2 * self.heartbeat_interval
        return None if silent else self.trainer.samples

    def _bt_port(self) -> int | None:
        if self.torrent is None:
            return None
        with contextlib.suppress(CrowdtrainError, RuntimeError):
            return self.torrent.listen_port or None
        return None

    async def _heartbeats(self) -> None:
        """Report progress every interval; a tracker that is down only pauses averaging."""
        failures = 0
        while not self._stop.is_set():
            try:
                await self._heartbeat_once()
                if failures:
                    self._note(logging.INFO, "tracker answers again after %d failed heartbeats", failures)
                failures = 0
            except TrackerError as exc:
                if exc.status == 410:  # the run was closed or deleted by its admin: nothing more to do
                    self.summary.ended = str(exc)
                    self._note(logging.WARNING, "%s; leaving", exc)
                    self._stop.set()
                    return
                failures += 1
                if failures in (1, 10) or failures % 60 == 0:
                    self._note(
                        logging.WARNING,
                        "heartbeat failed (%s); training goes on and will report when it is back",
                        exc,
                    )
            await self._sleep_until(self._next_heartbeat_s(), self._heartbeat_now)
            self._heartbeat_now.clear()

    def _next_heartbeat_s(self) -> float:
        """The heartbeat interval, shorter near the end of a step (half its ETA, at least 0.1 s) and while
        the run's rate is unknown, so shares and the close follow the run closely where it matters."""
        reply = self._reply
        if reply is None or reply.step_closed or reply.notice:
            return self.heartbeat_interval
        if reply.eta_s is None:
            return min(self.heartbeat_interval, 0.25)
        return min(self.heartbeat_interval, max(0.1, reply.eta_s / 2))

    async def _sleep_until(self, seconds: float, event: asyncio.Event) -> None:
        """Sleep ``seconds``, or less if ``event`` or the stop is set."""
        waits = {asyncio.ensure_future(self._stop.wait()), asyncio.ensure_future(event.wait())}
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _watch_steps(self) -> None:
        """Hear of a step's close within a round trip (a long-poll), not at the next heartbeat: on a close,
        heartbeat at once; its reply tells the training loop to average."""
        while not self._stop.is_set():
            step = self.step
            try:
                watch = await self.tracker.watch_step(self.config.run_id, step, WATCH_S)
            except TrackerError:
                await self._sleep_until(self.heartbeat_interval, self._stop)
                continue
            if watch.global_step > step or watch.step_closed:
                self._heartbeat_now.set()
                # until this peer moved on from that step (or a heartbeat interval passed): the same answer
                # again would only repeat the heartbeat
                deadline = time.monotonic() + self.heartbeat_interval
                while self.step == step and time.monotonic() < deadline and not self._stop.is_set():
                    await self._sleep_until(0.05, self._stop)

    # ------------------------------------------------------------------ training

    async def _train(self) -> None:
        spec = self.spec
        cfg = self.config
        if self.step > 0 and cfg.catch_up:
            self._start_catch_up()
        micro = min(spec.micro_batch_size, cfg.max_batch or spec.micro_batch_size)
        micro_batches = 0
        last_report = 0.0
        phase = ""
        while not self._stop.is_set():
            if self._data_error is not None:
                raise self._data_error
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                break
            if self._pending_state is not None and self._pending_state.done() and self._round_settled():
                await self._switch_to_fetched_state()
            if self._waiting is not None and self._pending_state is not None:
                # no peer serves the run's state: nothing computed here would count (or be the run's)
                if phase != "waiting-for-state":
                    phase = "waiting-for-state"
                    self._phase(phase)
                await wait_at_most(self._stop, 0.5)
                continue
            if self._pending_state:
                want = "catching-up"
            elif not self.sampler.ready:
                want = "downloading"
            else:
                want = "waiting-for-step" if self._at_quota else "training"
            if want != phase:
                phase = want
                self._phase(phase)
            quota = self._quota_now()
            if self.sampler.ready and quota is not None and self.trainer.samples >= quota:
                if self._may_take_early(quota):
                    # delay 1: its share is computed; take it, apply the previous step's average and compute
                    # the next step's micro-batches on those parameters while the others finish this step
                    self._early = await self._hand_over(catching_up=False)
                    if self._pending_state is not None:  # the previous round failed: catching up now
                        self._early = None
                    self._heartbeat_now.set()  # tell the tracker it is done with this step
                    phase = ""  # (the step's hand-over showed "stepping")
                    continue
                # this peer's share of the step is computed: report it now and wait for the close (or a
                # larger share, if the others fell short), asking again every IDLE_POLL_S
                if not self._at_quota:
                    self._at_quota = True
                    self._heartbeat_now.set()
                # (slowly while the tracker says the run cannot step: asking often would not help)
                poll_s = self.heartbeat_interval if self._notice else IDLE_POLL_S
                await wait_at_most(self._reply_changed, poll_s)
                if not self._reply_changed.is_set():
                    self._heartbeat_now.set()
                self._reply_changed.clear()
            elif self.sampler.ready:
                self._at_quota = False
                n = micro if quota is None else min(micro, quota - self.trainer.samples)
                batch = self.sampler.batch(n)
                started = time.monotonic()
                if self._compute_t0 is None:
                    self._compute_t0 = started
                loss, n = await asyncio.to_thread(self.trainer.accumulate, batch.x, batch.y)
                now = time.monotonic()
                self._step_compute_s += now - started
                if self._record is not None and self._pending_state is None:
                    toward = self.step + (self._early is not None)  # computed ahead: for the next step
                    self._record(ev.BatchComputed(step=toward, provenance=tuple(batch.provenance)))
                micro_batches += 1
                self._loss_ema = loss if self._loss_ema is None else 0.9 * self._loss_ema + 0.1 * loss
                self._step_loss = (self._step_loss[0] + loss * n, self._step_loss[1] + n)
                self._rate_window.append((n, now - started))
                if now - last_report >= LOCAL_REPORT_S:
                    last_report = now
                    self.emit(
                        ev.LocalTraining(
                            loss=loss,
                            samples=self.trainer.samples,
                            samples_per_s=self._samples_per_s,
                            micro_batches=micro_batches,
                            compute_share=self._compute_share(),
                        )
                    )
            else:
                # No verified chunk yet: nothing to compute, but this peer still takes part in its
                # group's rounds with weight 0, so its parameters stay those of the run.
                await wait_at_most(self._reply_changed, 0.1)
                self._reply_changed.clear()
            reply = self._reply
            if reply is None:
                continue
            # its ready call for this step went out already (computing ahead): the round may have formed,
            # so a reply with a later global step is no sign of a missed step
            asked = self._ready_task is not None and self._ready_task[0] == self.step
            if reply.global_step > self.step and not asked:
                self._fell_behind(reply.global_step)
            elif asked or (reply.global_step == self.step and reply.step_closed):
                await self._average_and_step()
                self._reply = None  # wait for a fresh view of the new step
                self._at_quota = False
                self._heartbeat_now.set()  # tell the tracker at once that this peer is in the new step
                phase = ""
        # delay 1: the last step's average is still under way; its group counts on this peer's part
        if self._round_task is not None:
            await self._conclude(await self._await_round())

    @property
    def _samples_per_s(self) -> float:
        """Compute throughput (not counting waits) over the last RATE_WINDOW micro-batches (0 before the
        first): what this peer's share of a step is made of."""
        if not self._rate_window:
            return 0.0
        return sum(n for n, _ in self._rate_window) / max(sum(s for _, s in self._rate_window), 1e-6)

    def _compute_share(self) -> float | None:
        """Share of the wall time since the first micro-batch spent computing gradients that entered an
        average (a step applied with this peer's samples in it)."""
        if self._compute_t0 is None:
            return None
        elapsed = time.monotonic() - self._compute_t0
        return min(1.0, self._useful_compute_s / elapsed) if elapsed > 0 else None

    def _drop_accumulation(self) -> int:
        early, self._early = self._early, None
        if self._ready_task is not None:
            self._ready_task[1].cancel()
            self._ready_task = None
        dropped = self.trainer.samples + (early.weight if early else 0)
        self.trainer.reset_accumulation()
        self._step_loss = (0.0, 0)
        self._step_compute_s = 0.0
        return dropped

    def _fell_behind(self, global_step: int) -> None:
        """The run moved on without this peer. Its accumulated gradients were computed on parameters the
        others have left behind: they are dropped (no gradient outlives its parameters), and the peer
        fetches the current state, taking part with weight 0 meanwhile."""
        if self._pending_state is None:
            dropped = self._drop_accumulation()
            self.emit(ev.StepMissed(step=self.step, now_step=global_step, dropped_samples=dropped))
            self.summary.steps_missed += 1
            if self.config.catch_up:
                self._start_catch_up()
        self.step = global_step

    async def _average_and_step(self) -> None:
        """One collaborative step: get this step's group, average the gradient, apply it (delay 0), or apply
        the previous step's average and leave this one averaging in the background (delay 1). While
        catching up, take part with weight 0 and keep the averages for the replay once the fetched state is
        loaded, so the newcomer ends exactly where the others are."""
        step = self.step
        catching_up = self._pending_state is not None
        taken = self._early
        weight = taken.weight if taken else 0 if catching_up else self.trainer.samples
        prepared, self._ready_task = self._ready_task, None
        asked = prepared[1] if prepared is not None and prepared[0] == step else None
        if prepared is not None and asked is None:
            prepared[1].cancel()
        if taken is not None and asked is None:
            # with the samples it computed for the next step so far (its allotment of it is never below them)
            asked = asyncio.get_running_loop().create_task(self._ask_group(step, weight, ahead=True))
        self._phase("waiting-for-group")
        self._asking = step
        try:
            phases = await self._await_group(step, weight, asked=asked)
        finally:
            self._asking = None
        if not phases:
            self._phase("catching-up" if catching_up else "training")
            return
        if taken is None:
            taken = await self._hand_over(catching_up)
        self._early = None
        rnd = _Round(
            step=step,
            phases=phases,
            weight=taken.weight,
            catching_up=catching_up,
            compute_s=taken.compute_s,
            loss=taken.loss,
            started=time.monotonic(),
        )
        if self.delay:
            self.step = step + 1
            self._round_task = asyncio.get_running_loop().create_task(self._run_round(rnd, taken.grad))
            self._phase("catching-up" if self._pending_state is not None else "training")
            return
        self._phase("averaging")
        await self._conclude(await self._run_round(rnd, taken.grad))
        self.step = step + 1
        self._phase("catching-up" if self._pending_state is not None else "training")

    def _may_take_early(self, quota: int) -> bool:
        """Delay 1, its share of the step computed, the previous round done: the step's gradient can be
        taken now and the next step's computed ahead (the parameters it needs are known)."""
        return (
            bool(self.delay)
            and self._early is None
            and self._pending_state is None
            and self.trainer.samples > 0
            and self._next_cap(quota) > 0
            and self._round_settled()
            and not self._notice
            # the run's last step for this peer: nothing comes after it to compute ahead for
            and (self.config.max_steps is None or self.step + 1 < self.config.max_steps)
        )

    def _next_cap(self, quota: int) -> int:
        """How many samples to compute ahead for the next step once this one's ``quota`` is computed: this
        peer's share of a step by rate, as the tracker last said (it leaves room for the others, newcomers
        too), or half the allotment from a tracker that does not say."""
        return self._ahead_share if self._ahead_share is not None else quota // 2

    async def _hand_over(self, catching_up: bool) -> _Taken:
        """Take the step's gradient out of the accumulation. With delay 1 the previous step's average is
        applied right after (its round is awaited first: it reads the buffer this gradient goes to)."""
        loss_sum, loss_n = self._step_loss
        self._step_loss = (0.0, 0)
        weight = 0 if catching_up else self.trainer.samples
        compute_s = 0.0 if catching_up else self._step_compute_s
        self._step_compute_s = 0.0
        previous = await self._await_round() if self.delay else None
        if (self.delay or self.trainer.device.type != "cpu") and self._grad_buf is None:
            self._grad_buf = self._host_buffer()
        # delay 1: the gradient goes to a buffer of its own (the next step accumulates meanwhile); on the
        # CPU without delay, the accumulation buffer itself is handed to the all-reduce (no copy)
        grad = await asyncio.to_thread(self.trainer.take_grad, self._grad_buf)
        if previous is not None:
            await self._conclude(previous)
        loss = loss_sum / loss_n if loss_n and not catching_up else None
        return _Taken(step=self.step, weight=weight, compute_s=compute_s, loss=loss, grad=grad)

    def _host_buffer(self) -> np.ndarray:
        """A reused float32 host buffer of the model's size (pinned on a GPU: device copies run async)."""
        pinned = self.trainer.device.type == "cuda"
        return torch.empty(self.trainer.numel, dtype=torch.float32, pin_memory=pinned).numpy()

    def _round_settled(self) -> bool:
        return self._round_task is None or self._round_task.done()

    async def _await_round(self) -> _Round | None:
        task, self._round_task = self._round_task, None
        return None if task is None else await task

    async def _run_round(self, rnd: _Round, grad: np.ndarray) -> _Round:
        """All-reduce the step's gradient over its phases (and, with delay 1 on an averaging step, the
        parameters the gradient was computed on)."""
        try:
            # The mean lands in buffers reused every step (the trainer copies it into .grad), except while
            # catching up: those averages are kept for the replay.
            mean, failed = await self._allreduce_phases(rnd.phases, grad, "grad", reuse=not rnd.catching_up)
        except AveragingError as exc:
            rnd.error = str(exc)
            return rnd
        if failed:
            self._note(
                logging.WARNING,
                "step %d: parts of the gradient were not averaged (their owner failed): %s; skipping them",
                rnd.step,
                "; ".join(failed),
            )
        rnd.mean = mean
        if self.delay and rnd.average_params:
            rnd.params = await self._average_params(rnd.phases)
        return rnd

    async def _conclude(self, rnd: _Round) -> None:
        """Apply a finished round's average (or keep it for the replay while catching up)."""
        if rnd.mean is None:
            self._note(
                logging.WARNING,
                "averaging round of step %d failed (%s); this peer will fetch the state",
                rnd.step,
                rnd.error,
            )
            self._replay.clear()
            if self.config.catch_up:
                self._start_catch_up()
            return
        if self._pending_state is not None:
            # delay 0: the parameters are averaged after the step, here; a catching-up peer only receives
            params = rnd.params
            if not self.delay and rnd.average_params:
                params = await self._average_params(rnd.phases)
            await asyncio.to_thread(self._replay.put, rnd.step, rnd.mean, params)
            return
        self._phase("stepping")
        await self._snapshot_written()  # the write reads the tensors this step changes
        self._stepping = True
        if rnd.params is not None:  # delay 1: the averaged parameters this gradient was computed on
            await asyncio.to_thread(self.trainer.set_flat_params, rnd.params)
        lr = await asyncio.to_thread(self.trainer.apply, rnd.mean, rnd.step)
        self._stepping = False
        if not self.delay and rnd.average_params:
            params = await self._average_params(rnd.phases)
            if params is not None:
                self._stepping = True
                await asyncio.to_thread(self.trainer.set_flat_params, params)
                self._stepping = False
        self._applied = rnd.step + 1
        self.summary.steps_done += 1
        if rnd.weight > 0:
            self._useful_compute_s += rnd.compute_s
        if rnd.loss is not None:
            self.summary.losses.append(rnd.loss)
        await self._record_params()
        self.emit(
            ev.StepDone(
                step=rnd.step,
                lr=lr,
                contributed_samples=rnd.weight,
                group_samples=rnd.group_samples,
                step_time_s=time.monotonic() - rnd.started,
                loss=rnd.loss,
                compute_s=rnd.compute_s,
                compute_share=self._compute_share(),
                delayed=bool(self.delay),
            )
        )
        self._schedule_snapshot()
        every = self.spec.eval.every
        if every and self._applied % every == 0 and self._eval_batch is not None:
            await self._evaluate(self._applied)

    async def _evaluate(self, step: int) -> None:
        """Evaluate the state after ``step`` steps on the held-out samples; the next heartbeats report it."""
        self._phase("evaluating")
        started = time.monotonic()
        batch = self._eval_batch
        loss, metrics = await asyncio.to_thread(
            self.trainer.evaluate_with_metrics, batch.x, batch.y, self.spec.micro_batch_size
        )
        if not math.isfinite(loss):
            self._note(logging.WARNING, "the held-out loss of step %d is %s; not reported", step, loss)
            return
        self._eval_report = EvalReport(step=step, loss=loss, metrics=metrics, samples=len(batch))
        self.emit(
            ev.Evaluated(
                step=step,
                loss=loss,
                metrics=metrics,
                samples=len(batch),
                duration_s=time.monotonic() - started,
            )
        )
        self._heartbeat_now.set()

    async def _allreduce_phases(
        self, phases: list[GroupAssignment], vector: np.ndarray, tag: str, *, reuse: bool
    ) -> tuple[np.ndarray, list[str]]:
        """Run the step's phases in order, each phase's mean the next one's input, with this peer's weight
        in each; after the last, every peer of the step holds the same weighted mean. Without delay, each
        mean of the gradient overwrites the vector it is made of (nothing reads the gradient again, and no
        buffer of the model's size is needed; a catching-up peer writes it to its replay file before it
        accumulates again); with delay 1 and ``reuse`` the means land in two buffers kept between steps (the
        gradient's buffer receives the next step's gradient before this mean is applied).

        A part whose owner failed keeps its local values, which are this peer's alone: they are zeroed, as
        every member that lost the same owner does, so the group stays equal (the failures are returned,
        one phrase each)."""
        values, failed = vector, []
        for i, a in enumerate(phases):
            [me] = [m for m in a.members if m.peer_id == self.peer_id]
            out = None
            if not self.delay and tag == "grad":
                out = values
            elif reuse:
                if self._mean_bufs[i % 2] is None or self._mean_bufs[i % 2].size != vector.size:
                    self._mean_bufs[i % 2] = np.empty_like(vector)
                out = self._mean_bufs[i % 2]
            # a tag per phase: a lossy codec's error feedback stays within what each phase sends
            phase_tag = tag if a.phase == 0 else f"{tag}-p{a.phase}"
            result = await self.averager.allreduce(a, values, float(me.weight), tag=phase_tag, out=out)
            if result.failed_parts:
                bounds = part_bounds(result.values.size, a.parts)
                for part in result.failed_parts:
                    result.values[bounds[part][0] : bounds[part][1]] = 0.0
                failed.append(f"phase {a.phase + 1} of {a.phases}, parts {list(result.failed_parts)}")
            values = result.values
        return values, failed

    async def _ask_group(self, step: int, weight: int, *, ahead: bool = False) -> ReadyReply | None:
        """Long-poll ``ready`` until the tracker answers with a group, ``missed`` or ``open``; None if it
        cannot be asked. ``ahead``: each call says how many samples it computed for the next step by then
        (computed, not promised: a promise would count toward that step before it is kept). Changes nothing
        here (it may run beside the training loop)."""
        while not self._stop.is_set():
            computed = self.trainer.samples if ahead and self._early is not None else 0
            try:
                reply = await self.tracker.ready(
                    self.config.run_id,
                    ReadyRequest(peer_id=self.peer_id, step=step, weight=weight, ahead=computed),
                    self.key,
                    self.credential,
                )
            except TrackerError as exc:
                if exc.status == 410:  # closed under it: the heartbeats say so and stop the engine
                    self.summary.ended = str(exc)
                    self._stop.set()
                    return None
                self._note(logging.WARNING, "could not ask the tracker for a group (%s); training on", exc)
                return None
            if reply.status in ("group", "missed", "open"):
                return reply
            await asyncio.sleep(reply.retry_after_s)
        return None

    async def _await_group(
        self, step: int, weight: int, *, asked: asyncio.Task[ReadyReply | None] | None = None
    ) -> list[GroupAssignment]:
        """This peer's group of this step in each phase, in order (from ``asked``, a ready call already
        made, or a new one); empty if this peer missed the step or no group was formed. The reply's
        allotment of the next step is kept."""
        reply = await (asked if asked is not None else self._ask_group(step, weight))
        if reply is None:
            return []
        if reply.status == "group" and reply.assignment is not None:
            phases = [reply.assignment, *reply.later_phases]
            for a in phases:
                verify_assignment(a, self.spec.tracker_public_key)
                if a.step != step or self.peer_id not in (m.peer_id for m in a.members):
                    raise AveragingError(f"the tracker's group for step {step} does not hold this peer")
            if reply.next_allotment is not None and reply.global_step == step + 1:
                self._quota = (step + 1, reply.next_allotment)
                self._quota_since = time.monotonic()
            return phases
        if reply.status == "missed":
            self._fell_behind(reply.global_step)
            return []
        # open: no reachable peer was ready: nothing was averaged; keep the accumulation and train on
        self._reply = None
        return []

    async def _average_params(self, phases: list[GroupAssignment]) -> np.ndarray | None:
        """Average parameters over the step's peers, in the same phases and with the same weights as the
        gradient (a peer with weight 0, e.g. catching up, only receives): heals any drift. None if nothing
        usable came back."""
        params = await asyncio.to_thread(self.trainer.flat_params)
        try:
            values, failed = await self._allreduce_phases(phases, params, "params", reuse=False)
        except AveragingError as exc:
            self._note(logging.WARNING, "parameter averaging failed (%s); keeping local parameters", exc)
            return None
        if failed or not all_finite(values):
            self._note(logging.WARNING, "parameter averaging was partial; keeping local parameters")
            return None
        return values

    # ------------------------------------------------------------------ state

    def _schedule_snapshot(self) -> None:
        """Start writing a snapshot of the state just stepped to, in the background, when one is due (every
        ``_snapshot_every`` steps, see SNAPSHOT_SPACING; one at a time). The previous snapshot is served
        until the new one is complete."""
        now = time.monotonic()
        if self._last_applied_at is not None:
            took = now - self._last_applied_at
            self._step_s = took if not self._step_s else 0.8 * self._step_s + 0.2 * took
        self._last_applied_at = now
        if self.config.client_mode or self._applied % self._snapshot_every:
            return
        if self._snapshot_task is not None and not self._snapshot_task.done():
            return
        self._snapshot_task = asyncio.get_running_loop().create_task(
            self._snapshot(self._applied, self.trainer.live_state())
        )

    async def _snapshot_written(self) -> None:
        """Wait until a snapshot write in progress has read the tensors (before they change)."""
        if self._snapshot_writing is not None:
            await asyncio.wait({self._snapshot_writing})

    def _write_state(self, path: Path, step: int, model_state: dict):
        """Write this peer's state (``model_state`` and the optimizer's) as the snapshot of ``step`` to
        ``path`` (blocking: call it in a thread)."""
        spec = self.spec
        return save_snapshot(
            path,
            run_id=spec.run_id,
            step=step,
            recipe=spec.model.recipe,
            args=dict(spec.model.args),
            model_state=model_state,
            optimizer_state=self.trainer.optimizer.state_dict(),
            scheduler_state=None,
            range_bytes=self.config.state.range_bytes,
        )

    async def _load_state(self, path: Path):
        """Load a snapshot file into the model and optimizer: the model's tensors are read in place, the
        optimizer's into fresh ones it keeps (no copy)."""
        loaded = await asyncio.to_thread(load_snapshot, path, into=self.trainer.model.state_dict())
        await asyncio.to_thread(
            self.trainer.load_state, loaded.model_state, loaded.optimizer_state, owned=True
        )
        return loaded

    async def _snapshot(self, step: int, model_state: dict) -> None:
        """Write, serve and declare the snapshot of ``step``; ``model_state`` is :meth:`Trainer.live_state`,
        taken right after the step was applied (live parameters: no copy; the buffers copied)."""
        started = time.monotonic()
        write = asyncio.ensure_future(
            asyncio.to_thread(
                self._write_state, self._state_dir / f"state-{step}.safetensors", step, model_state
            )
        )
        self._snapshot_writing = write
        try:
            snapshot = await asyncio.shield(write)
        except OSError as exc:
            self._note(logging.WARNING, "could not write the state snapshot of step %d (%s)", step, exc)
            return
        finally:
            self._snapshot_writing = None
            k, cost = self.config.snapshot_every, time.monotonic() - started
            while self._step_s > 0 and k * self._step_s < SNAPSHOT_SPACING * cost and k < 1 << 20:
                k *= 2
            self._snapshot_every = k
        self.state_server.publish(snapshot)
        try:
            # the older snapshots still served are declared too: a peer a little behind in writing the same
            # step's snapshot still backs one version with this one (see the tracker's donor rule)
            older = [v for v in self.state_server.versions if v != snapshot.version]
            await self.tracker.declare_state(
                self.config.run_id,
                StateDeclare(peer_id=self.peer_id, state=snapshot.version, older=older),
                self.key,
                self.credential,
            )
        except TrackerError as exc:
            self._note(logging.WARNING, "could not declare state version %d to the tracker (%s)", step, exc)

    def _start_catch_up(self, after_s: float = 0.0) -> None:
        if self._pending_state is None or self._pending_state.done():
            self._phase("waiting-for-state" if self._waiting is not None else "catching-up")
            # averages are kept for the replay from the round of this step on (or from the earliest kept)
            replay_from = self.step if self._replay.first is None else self._replay.first
            self._pending_state = asyncio.get_running_loop().create_task(
                self._fetch_state(replay_from, after_s)
            )

    async def _newest_donors(self, replay_from: int) -> DonorList:
        """The tracker's donor list, once it lists a state this peer can replay from (of step ≥
        ``replay_from``). An older one would be fetched for nothing: the averages between its step and
        ``replay_from`` passed before this peer kept them. Donors write snapshots every few steps (the
        larger the state, the fewer), so a newcomer usually waits for the next one."""
        said = False
        while True:
            donors = await self.tracker.donors(self.config.run_id)
            if donors.state is None or donors.state.step >= replay_from:
                return donors
            if not said:
                self._note(
                    logging.INFO,
                    "the newest state served is of step %d; waiting for one of step %d or later to fetch",
                    donors.state.step,
                    replay_from,
                )
                said = True
            await asyncio.sleep(min(STATE_POLL_S, max(0.2, self._step_s / 2)) if self._step_s else 1.0)

    async def _fetch_state(self, replay_from: int, after_s: float = 0.0):
        if after_s:
            await asyncio.sleep(after_s)
        donors = await self._newest_donors(replay_from)
        if donors.state is None and donors.serving:
            raise StateSyncError(donors.reason or "the peers serving state agree on none yet")
        if donors.state is None or not donors.donors:
            return None
        if donors.serving >= 2 and len({d.peer_id for d in donors.donors}) < 2:
            # never load a state only one peer vouches for when two could
            raise StateSyncError(
                f"the tracker lists one donor of state step {donors.state.step} while {donors.serving} peers "
                "serve state"
            )
        incoming = self._state_dir / "incoming.safetensors"
        try:
            path = await fetch_state(
                donors=donors.donors,
                version=donors.state,
                run_id=self.config.run_id,
                key=self.key,
                credential=self.credential,
                config=self.config.state,
                emit=self.emit,
                into=incoming,  # written as it is verified: never held in memory whole
            )
        except BaseException:
            incoming.unlink(missing_ok=True)
            raise
        # read when the peer switches to it, straight into the model (a copy of the state read now would be
        # held beside the model meanwhile)
        return path

    async def _no_donor(self) -> None:
        """No peer serves the run's state. A peer that took steps of this run keeps its parameters. Otherwise
        the state is this peer's own kept state of the run's step (:meth:`_keep_state`), else the publisher's
        checkpoint (``--init-from``, the step gap told), else the initial parameters while the run has taken
        no step. Failing all, the peer waits, computing nothing, and says why: a run that has taken steps never
        restarts from the initial parameters."""
        target = max(0, self.step - self.delay)
        kept = self._kept_header()  # (its JSON header only: small)
        if self.summary.steps_done:
            self._applied = target
            self._note(logging.WARNING, "no peer serves the run's state; keeping this volunteer's parameters")
        elif kept is not None and target <= kept.step <= self.step:
            await self._load_kept(kept.step)
        elif self._init_step is not None:
            self._applied = target
            gap = target - self._init_step
            self._note(
                logging.WARNING if gap else logging.INFO,
                "no peer serves the run's state; resuming from the checkpoint %s of step %d%s",
                self.config.init_from,
                self._init_step,
                f": the run is at step {target}, so the {gap} steps since are lost (and the optimizer's moments "
                "start afresh)"
                if gap > 0
                else f", beyond the run's step {target}: its weights are taken as the run's state"
                if gap < 0
                else "",
            )
            self._serve_now()
        elif target == 0:
            self._applied = 0
            self._note(logging.INFO, "the run has taken no step yet; training from the initial parameters")
        else:
            if self._waiting is None:
                behind = (
                    f"; this volunteer's own kept state is of step {kept.step}, {target - kept.step} steps behind"
                    if kept is not None and kept.step < target
                    else ""
                )
                self._waiting = (
                    f"run {self.config.run_id} is at step {target} but no peer serves its state{behind}: waiting, "
                    "computing nothing, until a volunteer that kept it returns or the publisher restores a "
                    f"checkpoint (crowdtrain join {self.config.run_id} --init-from FILE)"
                )
                self._note(logging.WARNING, "%s", self._waiting)
            self._start_catch_up(after_s=WAIT_STATE_S)
            return
        self._waiting = None
        await self._record_params()

    def _kept_header(self) -> SnapshotHeader | None:
        """The header of the state this peer kept when it last left this run, if it is one of this run's
        recipe and arguments (else it is set aside: not this run's state)."""
        if not self._kept.is_file():
            return None
        spec = self.spec
        try:
            header = read_snapshot_header(self._kept)
        except (ProtocolError, OSError, ValueError) as exc:
            self._note(
                logging.WARNING, "the kept state %s cannot be read (%s); not using it", self._kept, exc
            )
            return None
        if header.run_id != spec.run_id or (header.recipe, header.args) != (
            spec.model.recipe,
            dict(spec.model.args),
        ):
            self._note(
                logging.WARNING, "the kept state %s is not of this run's model; not using it", self._kept
            )
            return None
        return header

    async def _load_kept(self, step: int) -> None:
        """Resume from this peer's own kept state (of the run's step): load it and serve it to others."""
        await self._snapshot_written()
        await self._load_state(self._kept)
        self._drop_accumulation()
        self._applied = step
        self.summary.caught_up_to = self.step
        self._note(
            logging.INFO,
            "no peer serves the run's state; resumed from this volunteer's own state of step %d (kept in %s)",
            step,
            self._kept,
        )
        self._serve_now()

    def _serve_now(self) -> None:
        """Write, serve and declare a snapshot of the state now held (the run's, which no other peer serves)."""
        if not self.config.client_mode and (self._snapshot_task is None or self._snapshot_task.done()):
            self._snapshot_task = asyncio.get_running_loop().create_task(
                self._snapshot(self._applied, self.trainer.live_state())
            )

    async def _keep_state(self) -> None:
        """On leaving: keep the state this peer holds (the run's, at the step it applied last) in its data
        folder, so the run's state outlives its volunteers. A later join of this run resumes from it when no
        peer serves the run's state. Not while catching up or waiting (it does not hold the run's state) or
        mid-step (a thread is changing the tensors)."""
        if (
            self.trainer is None
            or self._pending_state is not None
            or self._waiting is not None
            or self._stepping
            or self._applied == 0
        ):
            return
        try:
            self._kept.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(
                self._write_state, self._kept, self._applied, self.trainer.model.state_dict()
            )
        except OSError as exc:
            self._note(logging.WARNING, "could not keep the state of step %d (%s)", self._applied, exc)
            return
        self._note(
            logging.INFO,
            "kept the run's state of step %d in %s: joining again resumes from it if no peer serves a newer one",
            self._applied,
            self._kept,
        )

    async def _switch_to_fetched_state(self) -> None:
        """Load the fetched state, then replay the averaged steps received meanwhile (between two steps;
        with delay 1, once no round is under way), so this peer holds what the others hold."""
        if self.delay and self._round_task is not None:
            await self._conclude(await self._await_round())  # kept for the replay: still catching up
        task, self._pending_state = self._pending_state, None
        replay = self._replay
        fetched: Path | None = None
        try:
            fetched = task.result()
            header = None if fetched is None else await asyncio.to_thread(read_snapshot_header, fetched)
        except (StateSyncError, TrackerError, ProtocolError) as exc:
            if fetched is not None:
                fetched.unlink(missing_ok=True)
            replay.clear()
            # Its parameters are not the run's: keep taking part with weight 0 and try again.
            self._note(logging.WARNING, "state catch-up failed (%s); trying again", exc)
            await asyncio.sleep(1.0)
            self._start_catch_up()
            return
        if fetched is None or header is None:
            replay.clear()
            await self._no_donor()
            return
        # The parameters should hold the averages of the steps below ``target``; with delay 1 the average
        # of step ``target`` is applied when the current step closes, as every peer does.
        target = max(0, self.step - self.delay)
        pending_step = target if self.delay and self.step > 0 else None
        needed = range(header.step, self.step if pending_step is not None else target)
        missing = [s for s in needed if s not in replay]
        if missing:
            fetched.unlink(missing_ok=True)
            replay.clear()
            self._note(
                logging.INFO,
                "state of step %d arrived but steps %s passed unseen; fetching a newer one",
                header.step,
                missing,
            )
            self._start_catch_up()
            return
        await self._snapshot_written()
        try:
            loaded = await self._load_state(fetched)
        finally:
            fetched.unlink(missing_ok=True)
        self._drop_accumulation()  # (each step replayed would zero it anyway)
        for s in range(loaded.step, target):
            # read into the trainer's own gradient buffer (on a CPU): the replay holds no vector of its own
            grad, params = await asyncio.to_thread(lambda s=s: replay.take(s, self.trainer.mean_buffer()))
            if self.delay and params is not None:
                await asyncio.to_thread(self.trainer.set_flat_params, params)
            await asyncio.to_thread(self.trainer.apply, grad, s)
            if not self.delay and params is not None:
                await asyncio.to_thread(self.trainer.set_flat_params, params)
        if loaded.step > target:  # a state newer than this peer's step: move to the step it belongs to
            self.step = loaded.step + self.delay
            self._applied = loaded.step
        else:
            self._applied = target
            if pending_step is not None and pending_step >= loaded.step:
                grad, params = await asyncio.to_thread(replay.take, pending_step)
                done = asyncio.get_running_loop().create_future()
                done.set_result(
                    _Round(
                        step=pending_step,
                        phases=[],
                        weight=0,
                        catching_up=False,
                        compute_s=0.0,
                        loss=None,
                        started=time.monotonic(),
                        mean=grad,
                        params=params,
                    )
                )
                self._round_task = done  # applied when the current step closes
        replay.clear()
        self._waiting = None
        self.summary.caught_up_to = self.step
        await self._record_params()
        self._note(
            logging.INFO,
            "loaded the state of step %d and replayed %d steps",
            loaded.step,
            max(0, target - loaded.step),
        )
        self._phase("training")
