"""The volunteer engine: join a run, train on the chunks it has, average with its group, step, repeat.

The engine emits :mod:`crowdtrain.volunteer.events` and never imports rich. One :class:`Volunteer` lives in
one ``asyncio.run``; its long-lived tasks (torrent, heartbeats, statistics, training) share a TaskGroup.

A global step, as this peer sees it (DeDLOC):

1. accumulate micro-batches from verified chunks (gradients weighted by samples) while heartbeats report
   the count to the tracker;
2. when the tracker says the step's target is reached, stop accumulating and long-poll ``ready`` with the
   accumulated sample count as weight;
3. the tracker answers with a signed group; the group all-reduces the mean gradient; every member applies
   the same averaged gradient with the same optimizer and moves to the next step; every
   ``average_state_every`` steps the group also averages parameters;
4. a step that closed without this peer (``missed``) keeps the accumulation for the next step; a peer
   further behind than the run's tolerance fetches the current state from peers, training meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from crowdtrain.datasets.sampler import Sampler
from crowdtrain.datasets.session import SessionConfig, TorrentSession, listen_address
from crowdtrain.protocol.credentials import SigningKey, verify_assignment
from crowdtrain.protocol.errors import (
    AveragingError,
    CrowdtrainError,
    RecipeError,
    StateSyncError,
    TrackerError,
)
from crowdtrain.protocol.messages import (
    PEER_PROTOCOL,
    GroupAssignment,
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    LeaveRequest,
    ReadyRequest,
    RunSpec,
    StateDeclare,
)
from crowdtrain.tracker.client import TrackerClient
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.averaging.allreduce import Averager, part_bounds
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.config import VolunteerConfig, split_advertise
from crowdtrain.volunteer.models import check_param_hash, get_recipe
from crowdtrain.volunteer.peer_server import PeerServer
from crowdtrain.volunteer.state.fetch import fetch_state
from crowdtrain.volunteer.state.serve import StateServer
from crowdtrain.volunteer.state.snapshot import load_snapshot, make_snapshot
from crowdtrain.volunteer.trainer import Trainer

from crowdtrain import __version__

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 3.0
STATS_INTERVAL_S = 1.0
LOCAL_REPORT_S = 1.0
WATCH_S = 20.0  # long-poll for a step's close (the tracker may cap it)


@dataclass(slots=True)
class Summary:
    """What one volunteer did, for the CLI's last line and the demo's summary."""

    peer_id: str = ""
    first_step: int = 0
    last_step: int = 0
    steps_done: int = 0
    steps_missed: int = 0
    losses: list[float] = field(default_factory=list)
    bytes_sent: int = 0
    raw_bytes: int = 0
    caught_up_to: int | None = None


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise CrowdtrainError(
            "--device cuda was asked for, but torch sees no CUDA device; use --device cpu or auto."
        )
    return requested


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
    def __init__(self, config: VolunteerConfig, emit: ev.Emit = ev.no_emit) -> None:
        self.config = config
        self._emit_outer = emit
        self.summary = Summary()
        self.key = SigningKey()
        self.spec: RunSpec | None = None
        self.peer_id = ""
        self.step = 0  # the global step this peer accumulates for
        self.trainer: Trainer | None = None
        self.sampler: Sampler | None = None
        # Tests turn ``record`` on to replay the exact samples: step -> each micro-batch's provenance, and
        # the flat parameters after each step.
        self.record = False
        self.recorded: dict[int, list[list[tuple[int, int]]]] = {}
        self.param_history: dict[int, np.ndarray] = {}
        self._reply: HeartbeatReply | None = None
        self._reply_changed = asyncio.Event()
        self._heartbeat_now = asyncio.Event()  # set: send the next heartbeat now
        self._stop = asyncio.Event()
        self._loss_ema: float | None = None
        self._samples_per_s = 0.0
        self._address: str | None = None  # where others reach this peer (for the view)
        self._declared: str | None = None  # what the join and heartbeats declare (see _declared_address)
        self._notice: str | None = None
        self._reachability: tuple | None = None
        self._chunks_held = 0
        self._pending_state: asyncio.Task | None = None
        # While catching up: step -> (averaged gradient, averaged parameters or None), replayed on load.
        self._replay: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self._mean_grad: np.ndarray | None = None  # the group's mean gradient, written every step

    # ------------------------------------------------------------------ plumbing

    def emit(self, event: ev.Event) -> None:
        if isinstance(event, ev.RoundDone):
            self.summary.bytes_sent += event.bytes_sent
            self.summary.raw_bytes += event.raw_bytes
        self._emit_outer(event)

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
            self.spec = spec
            recipe = get_recipe(spec.model.recipe)
            model = await asyncio.to_thread(recipe.build, dict(spec.model.args))
            check_param_hash(model, spec.model.param_hash)
            if cfg.init_from is not None:
                await asyncio.to_thread(load_checkpoint, model, cfg.init_from, spec)
            device = resolve_device(cfg.device)
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
            self.torrent = None
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
            self.summary.peer_id = join.peer_id
            self.summary.first_step = join.global_step
            server.peer_id = join.peer_id
            if self._declared is not None:
                host = self._declared.rpartition(":")[0] or join.observed_host or "?"
                if ":" in host and not host.startswith("["):
                    host = f"[{host}]"
                self._address = f"{host}:{self._declared.rpartition(':')[2]}"

            self.averager = None
            reason = "finished"
            try:
                self.averager = Averager(
                    run_id=cfg.run_id,
                    tracker_public_key=spec.tracker_public_key,
                    peer_id=join.peer_id,
                    key=self.key,
                    credential=join.credential,
                    config=AveragingConfig.from_spec(spec.averaging),
                    emit=self.emit,
                )
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
                self.sampler = Sampler(
                    manifest,
                    cfg.data_dir,
                    seed=self.sampler_seed,
                    seq_len=spec.model.args.get("seq_len"),  # type: ignore[arg-type]
                )
                self.download = None
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
                    tg.create_task(self._watch_steps())
                    tg.create_task(self._torrent_stats())
                    train = tg.create_task(self._train())
                    await train
                    self._stop.set()
            except asyncio.CancelledError:
                reason = "interrupted"
                raise
            finally:
                self._stop.set()
                self._phase("leaving")
                if self._pending_state is not None:
                    self._pending_state.cancel()
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
                self.summary.last_step = self.step
                self.emit(ev.Left(reason=reason))
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
            self.sampler.add_chunk(chunk.index)
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
            s = self.download.stats()
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), STATS_INTERVAL_S)

    # ------------------------------------------------------------------ tracker

    async def _heartbeat_once(self) -> None:
        reply = await self.tracker.heartbeat(
            self.config.run_id,
            Heartbeat(
                peer_id=self.peer_id,
                step=self.step,
                samples=self.trainer.samples,
                samples_per_s=self._samples_per_s,
                address=self._declared,
                chunks_held=self._chunks_held,
                loss=self._loss_ema,
                bt_port=self._bt_port(),
            ),
            self.key,
            self.credential,
        )
        self._reply = reply
        self._reply_changed.set()
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
                failures += 1
                if failures in (1, 10) or failures % 60 == 0:
                    self._note(
                        logging.WARNING,
                        "heartbeat failed (%s); training goes on and will report when it is back",
                        exc,
                    )
            await self._sleep_until(self.heartbeat_interval, self._heartbeat_now)
            self._heartbeat_now.clear()

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
        window_start, window_samples, micro_batches = time.monotonic(), 0, 0
        last_report = 0.0
        phase = ""
        while not self._stop.is_set():
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                return
            if self._pending_state is not None and self._pending_state.done():
                await self._switch_to_fetched_state()
            want = (
                "catching-up" if self._pending_state else "training" if self.sampler.ready else "downloading"
            )
            if want != phase:
                phase = want
                self._phase(phase)
            if self.sampler.ready:
                batch = self.sampler.batch(micro)
                loss, n = await asyncio.to_thread(self.trainer.accumulate, batch.x, batch.y)
                if self.record and self._pending_state is None:
                    self.recorded.setdefault(self.step, []).append(list(batch.provenance))
                micro_batches += 1
                window_samples += n
                self._loss_ema = loss if self._loss_ema is None else 0.9 * self._loss_ema + 0.1 * loss
                now = time.monotonic()
                if now - window_start >= 2.0:
                    self._samples_per_s = window_samples / (now - window_start)
                    window_start, window_samples = now, 0
                if now - last_report >= LOCAL_REPORT_S:
                    last_report = now
                    self.summary.losses.append(loss)
                    self.emit(
                        ev.LocalTraining(
                            loss=loss,
                            samples=self.trainer.samples,
                            samples_per_s=self._samples_per_s,
                            micro_batches=micro_batches,
                        )
                    )
            else:
                # No verified chunk yet: nothing to compute, but this peer still takes part in its
                # group's rounds with weight 0, so its parameters stay those of the run.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._reply_changed.wait(), 0.1)
                self._reply_changed.clear()
            reply = self._reply
            if reply is None:
                continue
            if reply.global_step > self.step:
                self._fell_behind(reply.global_step)
            elif reply.global_step == self.step and reply.step_closed:
                await self._average_and_step()
                self._reply = None  # wait for a fresh view of the new step
                phase = ""

    def _fell_behind(self, global_step: int) -> None:
        """The run moved on without this peer: fetch the state if too far behind, else carry on."""
        tolerance = self.spec.averaging.state_lag_tolerance
        lag = global_step - self.step
        if self._pending_state is None:
            if lag > tolerance and self.config.catch_up:
                self._note(
                    logging.INFO,
                    "%d steps behind the run (tolerance %d); fetching the current state",
                    lag,
                    tolerance,
                )
                self._start_catch_up()
            else:
                self.emit(
                    ev.StepMissed(step=self.step, now_step=global_step, kept_samples=self.trainer.samples)
                )
                self.summary.steps_missed += 1
        self.step = global_step

    async def _average_and_step(self) -> None:
        """One collaborative step. While catching up, take part with weight 0 and keep the averages for
        replay once the fetched state is loaded, so the newcomer ends exactly where the others are."""
        step = self.step
        catching_up = self._pending_state is not None
        weight = 0 if catching_up else self.trainer.samples
        self._phase("waiting-for-group")
        assignment = await self._await_group(step, weight)
        if assignment is None:
            self._phase("catching-up" if catching_up else "training")
            return
        started = time.monotonic()
        self._phase("averaging")
        grad = await asyncio.to_thread(self.trainer.flat_grad)
        # The mean lands in one buffer reused every step (the trainer copies it into .grad), except while
        # catching up: those averages are kept for the replay.
        out = None
        if not catching_up:
            if self._mean_grad is None or self._mean_grad.size != grad.size:
                self._mean_grad = np.empty_like(grad)
            out = self._mean_grad
        try:
            result = await self.averager.allreduce(assignment, grad, float(weight), tag="grad", out=out)
        except AveragingError as exc:
            self._note(
                logging.WARNING,
                "averaging round of step %d failed (%s); this peer will fetch the state",
                step,
                exc,
            )
            self.step = step + 1
            self._replay.clear()
            if self.config.catch_up:
                self._start_catch_up()
            return
        if result.failed_parts:
            # The owner of these parts died or refused us: our local values there are ours alone, and
            # applying them would set this peer apart from the rest of its group. Every member that lost
            # the same owner skips the same slices, so the group stays equal.
            bounds = part_bounds(result.values.size, assignment.parts)
            for part in result.failed_parts:
                result.values[bounds[part][0] : bounds[part][1]] = 0.0
            self._note(
                logging.WARNING,
                "step %d: parts %s of the gradient were not averaged (their owner failed); skipping them",
                step,
                list(result.failed_parts),
            )
        group_samples = sum(m.weight for m in assignment.members)
        if catching_up:
            params = await self._average_params(assignment, weight=0.0) if assignment.average_params else None
            self._replay[step] = (result.values, params)
            self.step = step + 1
            self._phase("catching-up")
            return
        self._phase("stepping")
        lr = await asyncio.to_thread(self.trainer.apply, result.values, step)
        if assignment.average_params:
            params = await self._average_params(assignment, weight=1.0 if weight > 0 else 0.0)
            if params is not None:
                await asyncio.to_thread(self.trainer.set_flat_params, params)
        self.step = step + 1
        self.summary.steps_done += 1
        if self.record:
            self.param_history[self.step] = await asyncio.to_thread(self.trainer.flat_params)
        self.emit(
            ev.StepDone(
                step=step,
                lr=lr,
                contributed_samples=weight,
                group_samples=group_samples,
                step_time_s=time.monotonic() - started,
            )
        )
        if not self.config.client_mode and self.step % self.config.snapshot_every == 0:
            await self._publish_state()
        self._phase("training")

    async def _await_group(self, step: int, weight: int) -> GroupAssignment | None:
        """Long-poll the tracker until it forms this step's groups; None if this peer missed the step."""
        while not self._stop.is_set():
            try:
                reply = await self.tracker.ready(
                    self.config.run_id,
                    ReadyRequest(peer_id=self.peer_id, step=step, weight=weight),
                    self.key,
                    self.credential,
                )
            except TrackerError as exc:
                self._note(logging.WARNING, "could not ask the tracker for a group (%s); training on", exc)
                return None
            if reply.status == "group" and reply.assignment is not None:
                verify_assignment(reply.assignment, self.spec.tracker_public_key)
                return reply.assignment
            if reply.status == "missed":
                self._fell_behind(reply.global_step)
                return None
            if reply.status == "open":
                # no reachable peer was ready: nothing was averaged; keep the accumulation and train on
                self._reply = None
                return None
            await asyncio.sleep(reply.retry_after_s)
        return None

    async def _average_params(self, assignment: GroupAssignment, weight: float) -> np.ndarray | None:
        """Average parameters in the same group (heals drift between groups); None if nothing to use."""
        if not any(m.weight > 0 for m in assignment.members):
            return None
        params = await asyncio.to_thread(self.trainer.flat_params)
        try:
            result = await self.averager.allreduce(assignment, params, weight, tag="params")
        except AveragingError as exc:
            self._note(logging.WARNING, "parameter averaging failed (%s); keeping local parameters", exc)
            return None
        if result.failed_parts or not np.isfinite(result.values).all():
            self._note(logging.WARNING, "parameter averaging was partial; keeping local parameters")
            return None
        return result.values

    # ------------------------------------------------------------------ state

    async def _publish_state(self) -> None:
        spec = self.spec
        model_state, optimizer_state = await asyncio.to_thread(self.trainer.state_dicts)
        snapshot = await asyncio.to_thread(
            make_snapshot,
            run_id=self.config.run_id,
            step=self.step,
            recipe=spec.model.recipe,
            args=dict(spec.model.args),
            model_state=model_state,
            optimizer_state=optimizer_state,
            scheduler_state=None,
            range_bytes=self.config.state.range_bytes,
        )
        self.state_server.publish(snapshot)
        try:
            await self.tracker.declare_state(
                self.config.run_id,
                StateDeclare(peer_id=self.peer_id, state=snapshot.version),
                self.key,
                self.credential,
            )
        except TrackerError as exc:
            self._note(
                logging.WARNING, "could not declare state version %d to the tracker (%s)", self.step, exc
            )

    def _start_catch_up(self) -> None:
        if self._pending_state is None or self._pending_state.done():
            self._phase("catching-up")
            self._pending_state = asyncio.get_running_loop().create_task(self._fetch_state())

    async def _fetch_state(self):
        donors = await self.tracker.donors(self.config.run_id)
        if donors.state is None or not donors.donors:
            return None
        data = await fetch_state(
            donors=donors.donors,
            version=donors.state,
            run_id=self.config.run_id,
            key=self.key,
            credential=self.credential,
            config=self.config.state,
            emit=self.emit,
        )
        return await asyncio.to_thread(load_snapshot, data)

    async def _switch_to_fetched_state(self) -> None:
        """Load the fetched state, then replay the averaged steps received meanwhile (at a step boundary)."""
        task, self._pending_state = self._pending_state, None
        replay, self._replay = self._replay, {}
        try:
            loaded = task.result()
        except (StateSyncError, TrackerError) as exc:
            # Its parameters are not the run's: keep taking part with weight 0 and try again.
            self._note(logging.WARNING, "state catch-up failed (%s); trying again", exc)
            await asyncio.sleep(1.0)
            self._start_catch_up()
            return
        if loaded is None:
            if self.record:
                self.param_history[self.step] = await asyncio.to_thread(self.trainer.flat_params)
            if self.config.init_from is not None:
                self._note(
                    logging.INFO, "no peer serves the run's state; resuming from %s", self.config.init_from
                )
            elif self.summary.steps_done or self.trainer.samples:
                self._note(
                    logging.WARNING, "no peer serves the run's state; keeping this volunteer's parameters"
                )
            else:
                self._note(
                    logging.WARNING, "no peer serves the run's state; training from the initial parameters"
                )
            return
        missing = [s for s in range(loaded.step, self.step) if s not in replay]
        if missing:
            self._note(
                logging.INFO,
                "state of step %d arrived but steps %s passed unseen; fetching a newer one",
                loaded.step,
                missing,
            )
            self._start_catch_up()
            return
        await asyncio.to_thread(self.trainer.load_state, loaded.model_state, loaded.optimizer_state)
        for s in range(loaded.step, self.step):
            grad, params = replay[s]
            await asyncio.to_thread(self.trainer.apply, grad, s)
            if params is not None:
                await asyncio.to_thread(self.trainer.set_flat_params, params)
        self.trainer.reset_accumulation()
        if self.step < loaded.step:
            self.step = loaded.step
        self.summary.caught_up_to = self.step
        if self.record:
            self.param_history[self.step] = await asyncio.to_thread(self.trainer.flat_params)
        self._note(
            logging.INFO,
            "loaded the state of step %d and replayed %d steps",
            loaded.step,
            self.step - loaded.step,
        )
        self._phase("training")
