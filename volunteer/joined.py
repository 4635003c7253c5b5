"""A joined run: everything a volunteer holds once the tracker took it in, in one object.

:func:`join_run` builds it (spec checked, model built and checked, peer server listening, torrent session
started, joined, averager and state server serving) and takes it down in order on the way out: stop
accepting peers, tell the tracker, close what talks to the network. The parts of the engine (tracker link,
step rounds, snapshots, catch-up) are given this object, so nothing they use is ``None`` until later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from crowdtrain import __version__
from crowdtrain.datasets.session import SessionConfig, TorrentSession, listen_address
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import CrowdtrainError, RecipeError, TrackerUnreachable
from crowdtrain.protocol.messages import (
    PEER_PROTOCOL,
    Credential,
    JoinRequest,
    JoinResponse,
    LeaveRequest,
    RunSpec,
    StateVersion,
)
from crowdtrain.protocol.runcheck import check_run
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.averaging.allreduce import Averager
from crowdtrain.volunteer.averaging.complaints import TrackerComplainer
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.cutting import tracker_referee
from crowdtrain.volunteer.cadence import Cadence, cadence_of
from crowdtrain.volunteer.config import VolunteerConfig, split_advertise
from crowdtrain.volunteer.folder import data_folder, folder_key
from crowdtrain.volunteer.local import make_trainer
from crowdtrain.volunteer.models import check_param_hash, get_recipe, preflight
from crowdtrain.volunteer.models.origin import check_origin
from crowdtrain.volunteer.models.recipe import Recipe
from crowdtrain.volunteer.peer_server import PeerServer
from crowdtrain.volunteer.state.serve import StateServer
from crowdtrain.volunteer.suspend import Sleeps
from crowdtrain.volunteer.trainer import Trainer, resolve_device

LEAVE_TIMEOUT_S = 3.0
# how long a join waits for the home router to forward the peer server's port (--port-mapping), so that the
# tracker's first check already goes through the forward; a router that answers nothing costs this once
PORT_MAP_WAIT_S = 3.0


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

    def joined(self, peer_id: str, step: int) -> None:
        self.peer_id, self.first_step = peer_id, step

    def sent(self, sent: int, raw: int) -> None:
        """An averaging round sent ``sent`` bytes on the wire, ``raw`` before compression."""
        self.bytes_sent += sent
        self.raw_bytes += raw

    def stepped(self, loss: float | None) -> None:
        self.steps_done += 1
        if loss is not None:
            self.losses.append(loss)

    def missed(self) -> None:
        self.steps_missed += 1

    def caught_up(self, step: int) -> None:
        self.caught_up_to = step

    def end(self, sentence: str) -> None:
        """The tracker closed or deleted the run under this volunteer, and said so."""
        self.ended = sentence

    def left(self, step: int, compute_share: float | None) -> None:
        self.last_step = step
        if compute_share is not None:
            self.compute_share = compute_share


@dataclass(slots=True)
class Position:
    """Where this peer stands in the run."""

    step: int  # the global step it accumulates for
    applied: int  # its parameters hold the averages of the steps below this one
    phase: str = ""  # what it is doing, as last told (PhaseChanged)

    def move(self, step: int, *, applied: int | None = None) -> None:
        """To ``step`` (and its parameters to ``applied``): only the training loop moves a peer
        (volunteer/loop.py; tests/test_shape.py holds it)."""
        self.step = step
        if applied is not None:
            self.applied = applied

    def say(self, phase: str) -> bool:
        """Whether ``phase`` is news (then it is the phase)."""
        news, self.phase = phase != self.phase, phase
        return news


@dataclass(slots=True)
class Volunteering:
    """Who the volunteer is and where it reports, before it joins: given by :class:`Volunteer`."""

    config: VolunteerConfig
    key: SigningKey
    summary: Summary
    stop: asyncio.Event
    emit: ev.Emit
    record: ev.Record | None
    kept: StateVersion | None = None  # the state it kept on leaving, told to the tracker with the leave
    sleeps: Sleeps = field(default_factory=Sleeps)  # when this process was last asleep (suspend.py)

    def use_key(self, key: SigningKey) -> None:
        """Its data folder's key (the same volunteer joining again: the same identity)."""
        self.key = key

    def kept_state(self, version: StateVersion) -> None:
        """The state it kept on leaving: told to the tracker with the leave."""
        self.kept = version

    def emit_averaging(self, event: ev.Event) -> None:
        """The averager's ``emit``: its rounds' bytes count in the summary, then the event goes out."""
        if isinstance(event, ev.RoundDone):
            self.summary.sent(event.bytes_sent, event.raw_bytes)
        self.emit(event)


@dataclass(slots=True)
class JoinedRun:
    """One run as this volunteer joined it. ``pos`` moves; the rest is fixed for the run's life."""

    me: Volunteering
    spec: RunSpec
    recipe: Recipe
    model_args: dict[str, int | float | str | bool]  # the recipe's whole argument set (defaults filled in)
    trainer: Trainer
    device: str
    init_step: int | None  # the step of the --init-from checkpoint loaded, if any
    tracker: TrackerClient
    torrent: TorrentSession
    torrent_file: bytes
    join: JoinResponse
    declared: str | None  # what the join and heartbeats declare (see declared_address)
    address: str | None  # where others reach this peer (for the view)
    averager: Averager
    state_server: StateServer
    state_dir: Path  # snapshots, a fetched state, the replay
    pos: Position

    @property
    def config(self) -> VolunteerConfig:
        return self.me.config

    @property
    def key(self) -> SigningKey:
        return self.me.key

    @property
    def summary(self) -> Summary:
        return self.me.summary

    @property
    def peer_id(self) -> str:
        return self.join.peer_id

    @property
    def credential(self) -> Credential:
        return self.join.credential

    @property
    def heartbeat_interval(self) -> float:
        return self.join.heartbeat_interval_s

    @property
    def cadence(self) -> Cadence:
        """When a step's average is applied (the run's averaging.delay: volunteer/cadence.py)."""
        return cadence_of(self.spec.averaging)

    @property
    def sampler_seed(self) -> int:
        cfg = self.config
        return cfg.seed if cfg.seed is not None else int.from_bytes(bytes.fromhex(self.key.public_hex)[:4])

    @property
    def stopping(self) -> bool:
        return self.me.stop.is_set()

    def sample_cut(self) -> dict[str, int | None]:
        """Windows of seq_len + 1 tokens, ids below vocab: for the training and the held-out sampler."""
        return {
            "seq_len": preflight.window(self.recipe, self.model_args),
            "vocab": preflight.vocab_of(self.recipe, self.model_args),
        }

    def emit(self, event: ev.Event) -> None:
        self.me.emit(event)

    def note(self, level: int, message: str, *args: object) -> None:
        """A line for the user: the view shows it (log panel, plain or JSON line); no second copy in logging."""
        text = message % args if args else message
        self.emit(ev.LogLine(level=logging.getLevelName(level), message=text))

    def note_tracker_failure(self, message: str, exc: CrowdtrainError, *args: object) -> None:
        """A request to the tracker failed: a warning, unless it timed out because this process had just been
        asleep (a laptop's lid, SIGSTOP): then a note that says so, since the tracker is not to blame."""
        slept = (
            self.me.sleeps.recent(self.tracker.timeout_s + 1.0)
            if isinstance(exc, TrackerUnreachable)
            else None
        )
        if slept is None:
            self.note(logging.WARNING, message, *args)
        else:
            self.note(logging.INFO, message + "; this volunteer had been asleep for %.0f s", *args, slept)

    def announce(self) -> None:
        """Tell the view this volunteer joined the run."""
        spec = self.spec
        self.emit(
            ev.Joined(
                run_id=self.config.run_id,
                run_name=spec.name,
                tracker=self.config.tracker_url,
                peer_id=self.peer_id,
                device=self.device,
                address=self.address,
                global_step=self.join.global_step,
                target_batch_size=spec.target_batch_size,
                recipe=spec.model.recipe,
                codec=spec.averaging.codec,
                inner_steps=spec.averaging.first_inner_steps,
                inner_bounds=(
                    (spec.averaging.inner_steps_min, spec.averaging.inner_steps_max)
                    if spec.averaging.auto_inner_steps
                    else None
                ),
                backbone=self.config.backbone,
                total_steps=spec.schedule.total_steps,
            )
        )

    def phase(self, phase: str) -> None:
        """Say what this volunteer does now, once: a phase it is already in is not said again (the plain lines
        printed "phase: waiting-for-state" 27 times in a row)."""
        if self.pos.say(phase):
            self.emit(ev.PhaseChanged(phase=phase))

    async def record_params(self) -> None:
        """Hand ``record`` (if given) a copy of the parameters, which hold the steps below ``pos.applied``:
        taken now, before training changes them."""
        if self.me.record is not None:
            params = await asyncio.to_thread(self.trainer.flat_params)
            self.me.record(ev.ParamsAfterStep(step=self.pos.applied, params=params))


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


def declared_address(config: VolunteerConfig, port: int) -> str | None:
    """What the join and heartbeats declare: None in client mode, ``--advertise``, or ``":PORT"``
    (the tracker fills in the address it sees this volunteer's requests come from)."""
    if config.client_mode:
        return None
    if config.advertise is not None:
        host, advertised_port = split_advertise(config.advertise)
        return f"{host}:{advertised_port or port}"
    return f":{port}"


def shown_address(declared: str | None, observed_host: str | None) -> str | None:
    """Where others reach this peer, as the view shows it (the tracker fills in the host of ``":PORT"``)."""
    if declared is None:
        return None
    host = declared.rpartition(":")[0] or observed_host or "?"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{declared.rpartition(':')[2]}"


@dataclass(slots=True)
class _Built:
    """What joining builds before it talks to peers: the checked spec, the model, the trainer."""

    spec: RunSpec
    recipe: Recipe
    model_args: dict[str, int | float | str | bool]
    trainer: Trainer
    device: str
    init_step: int | None


async def _build(cfg: VolunteerConfig, tracker: TrackerClient) -> _Built:
    """Fetch the run's spec and build its model, checked against every hash the spec pins."""
    spec = await tracker.get_spec(cfg.run_id)
    check_run(spec)  # a run no volunteer can run is refused here with the field's name
    recipe = get_recipe(spec.model.recipe)
    check_origin(spec.model.recipe, recipe, spec.model.package, spec.model.code_hash)
    model_args = preflight.resolved_args(recipe, spec.model.args)
    model = await asyncio.to_thread(preflight.build, recipe, model_args)
    check_param_hash(model, spec.model.param_hash)
    await asyncio.to_thread(preflight.check_initial_hash, recipe, model, spec.model.init_hash)
    init_step = None
    if cfg.init_from is not None:
        init_step = await asyncio.to_thread(load_checkpoint, model, cfg.init_from, spec)
    device = str(resolve_device(cfg.device))  # "cpu", "cuda", "cuda:1"
    trainer = make_trainer(recipe, model, spec, device, step=init_step or 0)
    return _Built(spec, recipe, model_args, trainer, device, init_step)


def _bind(cfg: VolunteerConfig) -> tuple[PeerServer, int]:
    """Listen before joining, so the address the join declares answers the tracker's check at once."""
    server = PeerServer(cfg.host, cfg.port)
    try:
        return server, server.bind()
    except OSError as exc:
        raise CrowdtrainError(
            f"cannot listen on {listen_address(cfg.host, cfg.port)} for peers ({exc.strerror}); "
            "choose another --port or --host"
        ) from None


async def _forwarded(cfg: VolunteerConfig, torrent: TorrentSession, port: int) -> int:
    """The port others reach the peer server at: the one the home router forwards to it, when it granted one
    within PORT_MAP_WAIT_S (port mapping on, not in client mode, no --advertise), else ``port``."""
    if cfg.client_mode or cfg.advertise is not None or not torrent.port_mapping:
        return port
    torrent.map_port("peer server", port)
    deadline = asyncio.get_running_loop().time() + PORT_MAP_WAIT_S
    while asyncio.get_running_loop().time() < deadline:
        answers = [m for (what, _), m in torrent.port_maps.items() if what == "peer server"]
        if granted := [m.external_port for m in answers if m.external_port]:
            return granted[0]
        if len(answers) >= 2:  # both UPnP and NAT-PMP refused
            break
        await asyncio.sleep(0.1)
    return port


@contextlib.asynccontextmanager
async def join_run(me: Volunteering) -> AsyncIterator[JoinedRun]:
    """Join the run ``me.config`` names, holding its data folder (one volunteer per folder); on the way out
    stop accepting peers, tell the tracker, then close what talks to the network."""
    with data_folder(me.config.data_dir):
        me.use_key(folder_key(me.config.data_dir))  # (the same volunteer joining again: the same identity)
        async with _join(me) as run:
            yield run


@contextlib.asynccontextmanager
async def _join(me: Volunteering) -> AsyncIterator[JoinedRun]:
    cfg = me.config
    async with TrackerClient(cfg.tracker_url, timeout_s=cfg.tracker_timeout_s) as tracker:
        built = await _build(cfg, tracker)
        torrent_file = await tracker.get_torrent(cfg.run_id)
        server, port = _bind(cfg)
        torrent: TorrentSession | None = None
        try:
            torrent = TorrentSession(
                SessionConfig(listen=listen_address(cfg.host, cfg.bt_port), port_mapping=cfg.port_mapping)
            )
            torrent.on_port_map = lambda m: me.emit(
                ev.PortMapped(
                    what=m.what, port=m.port, via=m.via, external_port=m.external_port, error=m.error
                )
            )
            await torrent.start()
            declared = declared_address(cfg, await _forwarded(cfg, torrent, port))
            join = await tracker.join(
                cfg.run_id,
                JoinRequest(
                    public_key=me.key.public_hex,
                    address=declared,
                    token=cfg.token,
                    device=built.device,
                    client_version=__version__,
                    peer_protocol=PEER_PROTOCOL,
                ),
            )
        except BaseException:
            await server.stop()
            if torrent is not None:
                await torrent.close()
            raise
        me.summary.joined(join.peer_id, join.global_step)
        server.peer_id = join.peer_id
        async with _serving(me, built, tracker, torrent, server, join) as averager_and_state:
            averager, state_server, state_dir = averager_and_state
            yield JoinedRun(
                me=me,
                spec=built.spec,
                recipe=built.recipe,
                model_args=built.model_args,
                trainer=built.trainer,
                device=built.device,
                init_step=built.init_step,
                tracker=tracker,
                torrent=torrent,
                torrent_file=torrent_file,
                join=join,
                declared=declared,
                address=shown_address(declared, join.observed_host),
                averager=averager,
                state_server=state_server,
                state_dir=state_dir,
                pos=Position(step=join.global_step, applied=join.global_step),
            )


@contextlib.asynccontextmanager
async def _serving(
    me: Volunteering,
    built: _Built,
    tracker: TrackerClient,
    torrent: TorrentSession,
    server: PeerServer,
    join: JoinResponse,
) -> AsyncIterator[tuple[Averager, StateServer, Path]]:
    """The averager and the state server on the peer server, from joining to leaving."""
    cfg, spec = me.config, built.spec
    averager: Averager | None = None
    state_server: StateServer | None = None
    try:
        averager = Averager(
            run_id=cfg.run_id,
            tracker_public_key=spec.tracker_public_key,
            peer_id=join.peer_id,
            key=me.key,
            credential=join.credential,
            config=AveragingConfig.from_spec(spec.averaging),
            emit=me.emit_averaging,
            referee=tracker_referee(tracker, cfg.run_id, join.peer_id, me.key, join.credential),
            complainer=TrackerComplainer(tracker, cfg.run_id, join.peer_id, me.key, join.credential),
        )
        # snapshots live in files of their own; leftovers of an earlier run of this peer go
        state_dir = cfg.data_dir / "crowdtrain-state"
        await asyncio.to_thread(shutil.rmtree, state_dir, True)
        state_dir.mkdir(parents=True, exist_ok=True)
        state_server = StateServer(
            run_id=cfg.run_id, tracker_public_key=spec.tracker_public_key, config=cfg.state, emit=me.emit
        )
        server.add_routes(averager.routes())
        server.add_routes(state_server.routes())
        await server.start()
        yield averager, state_server, state_dir
    finally:
        # In order: stop accepting peers, tell the tracker, then close what talks to the network.
        await server.stop()
        with contextlib.suppress(CrowdtrainError, TimeoutError, OSError):
            async with asyncio.timeout(LEAVE_TIMEOUT_S):
                await tracker.leave(
                    cfg.run_id, LeaveRequest(peer_id=join.peer_id, kept=me.kept), me.key, join.credential
                )
        if averager is not None:
            await averager.close()
        await torrent.close()
        if state_server is not None:
            state_server.close()
