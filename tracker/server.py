"""The tracker's HTTP service (aiohttp): routes, error translation, background upkeep, ``serve()``.

Routes::

    GET  /announce, /scrape                       BitTorrent (bencoded; errors as ``failure reason``)
    GET  /healthz, /metrics
    POST /api/v1/datasets                         admin: register an info-hash for /announce
    POST /api/v1/runs                             admin: RunCreate -> RunCreated
    GET  /api/v1/runs, /api/v1/runs/{id}, /api/v1/runs/{id}/torrent, /api/v1/runs/{id}/status
    GET  /api/v1/runs/{id}/tokenizer              the data set's tokenizer.json (404 when it has none)
    GET  /api/v1/runs/{id}/step?step=N&wait_s=S   long-poll: StepWatch once step N closed or passed
    POST /api/v1/runs/{id}/join                   JoinRequest -> JoinResponse (join token if private)
    POST /api/v1/runs/{id}/heartbeat|ready|leave|state    signed by the volunteer (peerauth)
    GET  /api/v1/runs/{id}/state/donors

A body is decoded into its schema (:mod:`crowdtrain.protocol.messages`), which refuses a field out of its
range, length or pattern by name; the routes check only what needs more than one field or the run's state.
Errors are an :class:`ErrorBody` with a sentence and a 4xx status; anything unexpected is logged with its
traceback and answered with a generic 500.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import math
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from aiohttp import web

from crowdtrain import __version__
from crowdtrain.protocol import bencode
from crowdtrain.protocol.aio import BodyTooLong, read_body, wait_at_most
from crowdtrain.protocol.credentials import SigningKey, issue_credential
from crowdtrain.protocol.errors import AuthError, ConfigError, CrowdtrainError, LimitExceeded, ProtocolError
from crowdtrain.protocol.httplog import quiet_parser_errors
from crowdtrain.protocol.limits import MAX_TOKENIZER_BASE64, MAX_TORRENT_BYTES, Limits
from crowdtrain.protocol.messages import (
    MAX_INT,
    PEER_PROTOCOL,
    DatasetRegistration,
    ErrorBody,
    EvalReport,
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    JoinResponse,
    LeaveRequest,
    Message,
    ReadyRequest,
    RunCreate,
    RunCreated,
    RunList,
    RunSpec,
    RunStatus,
    RunSummary,
    StateDeclare,
    StepHistory,
    decode,
    encode,
)
from crowdtrain.protocol.runcheck import check_run, tokenizer_bytes
from crowdtrain.protocol.serving import bind_listeners, start_serving, stop_serving
from crowdtrain.tracker.announce import AnnounceError, answer_announce, answer_scrape, failure, parse_announce
from crowdtrain.tracker.auth import AdminAuthError, PeerAuth, check_admin
from crowdtrain.tracker.collab import Peer, RunState, StateRefused
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.metrics import Metrics
from crowdtrain.tracker.page import HISTORY_POINTS, index_html, run_html
from crowdtrain.tracker.reach import AddressError, Checker, resolve_address
from crowdtrain.tracker.store import Store
from crowdtrain.tracker.swarm import Swarms

log = logging.getLogger("crowdtrain.tracker")

RUN_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
JSON = "application/json"
SHUTDOWN_DRAIN_S = 5.0  # in-flight requests get this long to finish when the tracker stops
LISTEN_BACKLOG = 1024  # connections waiting to be accepted (a crowd announcing at once)


class ApiError(CrowdtrainError):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


def _json(msg: Message, status: int = 200) -> web.Response:
    return web.Response(body=encode(msg), status=status, content_type=JSON)


def _html(page: str) -> web.Response:
    return web.Response(
        text=page,
        content_type="text/html",
        headers={
            # inline style and script of its own, data from this origin only, no frames
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
            "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-store",
        },
    )


def _error(status: int, message: str) -> web.Response:
    return _json(ErrorBody(error=message), status)


def _slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]
    return slug or "run"


class TokenBucket:
    """Per-client-IP rate limit (joins)."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self.state: dict[str, tuple[float, float]] = {}

    def allow(self, key: str) -> bool:
        if self.rate <= 0:
            return True
        now = time.monotonic()
        tokens, last = self.state.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1:
            self.state[key] = (tokens, now)
            return False
        if len(self.state) > 100_000:
            self.state.clear()
        self.state[key] = (tokens - 1, now)
        return True


class Tracker:
    """A running tracker. Build it with :func:`serve`."""

    def __init__(self, config: TrackerConfig, tasks: asyncio.TaskGroup) -> None:
        self.config = config
        self._tasks = tasks
        self.store = Store(config.db)
        self.signer = SigningKey.from_bytes(
            self.store.get_or_set_meta("tracker_key", SigningKey().private_bytes())
        )
        self.public_key = self.signer.public_hex
        if config.admin_token is not None:
            self.store.set_meta("admin_token", config.admin_token.encode())
            self.admin_token = config.admin_token
        else:
            self.admin_token = self.store.get_or_set_meta(
                "admin_token", secrets.token_urlsafe(24).encode()
            ).decode()
        self.limits = Limits(max_json_bytes=config.max_body_bytes)
        self.metrics = Metrics()
        self.auth = PeerAuth(
            self.public_key, self.store.get_or_set_meta("session_secret", secrets.token_bytes(32))
        )
        self.join_limit = TokenBucket(config.join_rate_per_s, config.join_burst)
        self.announce_limit = TokenBucket(config.announce_rate_per_s, config.announce_burst)
        self.runs: dict[str, RunState] = {}
        self.torrents: dict[str, bytes] = {}
        self.join_tokens: dict[str, str | None] = {}
        self.deleted: set[str] = set()  # runs deleted since this tracker started (answered 410, not 404)
        self.registered: set[bytes] = {bytes.fromhex(h) for h in self.store.datasets()}
        self.swarms = Swarms(config.max_swarm_peers)
        for stored in self.store.runs():
            # Peers of a run in progress re-register with their next heartbeat: give them three intervals.
            run = self._add_run_state(
                stored.spec, stored.global_step, quiet_s=3 * config.heartbeat_interval_s
            )
            if stored.closed_at is not None:
                run.close(stored.closed_at)
            self.torrents[stored.spec.run_id] = stored.torrent
            self.join_tokens[stored.spec.run_id] = stored.join_token_hash
        self.metrics.bind(self)
        self._stop = asyncio.Event()
        self.checker = Checker(config.reachability_timeout_s, config.reachability_concurrency, tasks)
        self._runner: web.AppRunner | None = None
        self._sockets: list[socket.socket] = []
        self.url = ""
        self.announce_url = ""
        self.port = 0

    def _add_run_state(self, spec: RunSpec, global_step: int, quiet_s: float = 0.0) -> RunState:
        run = RunState(spec, global_step, self.store, self.signer, quiet_s=quiet_s)
        run.on_formed.append(self.metrics.step_formed)
        self.runs[spec.run_id] = run
        return run

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._middleware])
        r = app.router
        r.add_get("/announce", self.announce)
        r.add_get("/scrape", self.scrape)
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics_page)
        r.add_post("/api/v1/datasets", self.register_dataset)
        r.add_post("/api/v1/runs", self.create_run)
        r.add_get("/api/v1/runs", self.list_runs)
        r.add_get("/api/v1/runs/{run_id}", self.get_spec)
        r.add_get("/api/v1/runs/{run_id}/torrent", self.get_torrent)
        r.add_get("/api/v1/runs/{run_id}/tokenizer", self.get_tokenizer)
        r.add_get("/api/v1/runs/{run_id}/status", self.get_status)
        r.add_get("/api/v1/runs/{run_id}/step", self.watch_step)
        r.add_post("/api/v1/runs/{run_id}/join", self.join)
        r.add_post("/api/v1/runs/{run_id}/heartbeat", self.heartbeat)
        r.add_post("/api/v1/runs/{run_id}/ready", self.ready)
        r.add_post("/api/v1/runs/{run_id}/leave", self.leave)
        r.add_post("/api/v1/runs/{run_id}/state", self.declare_state)
        r.add_get("/api/v1/runs/{run_id}/state/donors", self.donors)
        r.add_get("/", self.index_page)
        r.add_get("/runs/{run_id}", self.run_page)
        r.add_get("/api/v1/runs/{run_id}/history", self.get_history)
        r.add_post("/api/v1/runs/{run_id}/close", self.close_run)
        r.add_delete("/api/v1/runs/{run_id}", self.delete_run)
        return app

    async def start(self) -> None:
        quiet_parser_errors()
        await self.checker.start()
        self._runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_DRAIN_S
        )
        await self._runner.setup()
        # Our own sockets (bound as TCPSite would), so that close() can stop accepting before the cleanup.
        self._sockets = bind_listeners(self.config.host, self.config.port, LISTEN_BACKLOG)
        await start_serving(self._runner, self._sockets, LISTEN_BACKLOG)
        self.port = self._runner.addresses[0][1]
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        self.url = f"http://{host}:{self.port}"
        base = (self.config.public_url or self.url).rstrip("/")
        self.announce_url = base + "/announce"
        self._tasks.create_task(self._upkeep())
        effective = {k: v for k, v in asdict(self.config).items() if k != "admin_token"}
        log.info("tracker listening on %s (runs: %d) config: %s", self.url, len(self.runs), effective)

    async def close(self) -> None:
        self._stop.set()
        for run in self.runs.values():  # long-polls answer "wait" now instead of holding the shutdown
            run.stop()
        await stop_serving(self._runner, self._sockets)
        await self.checker.close()
        self.store.close()

    async def _upkeep(self) -> None:
        """Close steps on their timeout, form groups after the gather window, expire silent peers."""
        last_expiry = 0.0
        while not self._stop.is_set():
            await wait_at_most(self._stop, 0.1)
            now = time.time()
            expire = time.monotonic() - last_expiry >= min(1.0, self.config.peer_ttl_s / 4)
            for run in list(self.runs.values()):
                try:
                    if expire:
                        run.expire(self.config.peer_ttl_s)
                    run.tick(now)
                except Exception:
                    log.exception("upkeep of run %s failed", run.run_id)
            if expire:
                last_expiry = time.monotonic()
                self.swarms.expire(self.config.swarm_ttl_s)

    # ------------------------------------------------------------ plumbing

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        try:
            response = await handler(request)
        except ApiError as exc:
            response = _error(exc.status, str(exc))
        except LimitExceeded as exc:
            response = _error(413, str(exc))
        except ProtocolError as exc:
            response = _error(400, str(exc))
        except AdminAuthError as exc:
            response = _error(exc.status, str(exc))
        except AuthError as exc:
            response = _error(401, str(exc))
        except web.HTTPRequestEntityTooLarge:
            response = _error(
                413, f"request body is larger than the tracker's limit of {self.config.max_body_bytes} bytes"
            )
        except web.HTTPNotFound:
            response = _error(404, f"no such endpoint: {request.method} {request.path}")
        except web.HTTPMethodNotAllowed as exc:
            response = _error(
                405,
                f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(exc.allowed_methods))}",
            )
        except web.HTTPException:
            raise
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.path)
            response = _error(500, "internal error in the tracker; its log has the details")
        self.metrics.request(route, response.status)
        return response

    async def _body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > self.config.max_body_bytes:
            raise ApiError(
                413, f"request body is larger than the tracker's limit of {self.config.max_body_bytes} bytes"
            )
        return await request.read()

    def _run(self, request: web.Request) -> RunState:
        run_id = request.match_info["run_id"]
        run = self.runs.get(run_id) if RUN_ID.match(run_id) else None
        if run is None and run_id in self.deleted:
            raise ApiError(410, f"run {run_id} was deleted by its admin; it takes no more steps")
        if run is None:
            raise ApiError(
                404, f"there is no run {run_id[:80]!r} on this tracker; list runs with GET /api/v1/runs"
            )
        return run

    async def _signed(self, request: web.Request, kind: type[Any]) -> tuple[RunState, Any, str]:
        """A volunteer's request: run, decoded body, the credential's peer id (checked against the body)."""
        run = self._run(request)
        if run.closed is not None and kind is not LeaveRequest:  # (leaving a closed run is fine)
            raise ApiError(410, run.closed)
        body = await self._body(request)
        credential = self.auth.check(
            request.headers, run.run_id, request.path, hashlib.sha256(body).hexdigest()
        )
        msg = decode(body, kind, self.limits)
        if msg.peer_id != credential.peer_id:
            raise AuthError(f"credential is for peer {credential.peer_id}, not {msg.peer_id}")
        return run, msg, credential.public_key

    def _known(self, run: RunState, peer_id: str) -> Peer:
        peer = run.peers.get(peer_id)
        if peer is None:
            raise ApiError(
                404, f"peer {peer_id} is not registered in run {run.run_id}; send a heartbeat or join again"
            )
        return peer

    # ------------------------------------------------------------ BitTorrent

    async def announce(self, request: web.Request) -> web.Response:
        self.metrics.announces.inc()
        if not self.announce_limit.allow(request.remote or ""):
            self.metrics.announce_errors.inc()
            return web.Response(
                body=failure("too many announces from your address; wait a minute and announce again"),
                content_type="text/plain",
            )
        try:
            req = parse_announce(request.rel_url.raw_query_string, self.config.max_numwant)
            if not self.config.open and req.info_hash not in self.registered:
                raise AnnounceError(f"info_hash {req.info_hash.hex()} is not registered with this tracker")
            body = answer_announce(
                req,
                request.remote or "",
                self.swarms,
                self.config.announce_interval_s,
                self.config.min_announce_interval_s,
                self.config.max_swarm_peers,
            )
        except ProtocolError as exc:
            self.metrics.announce_errors.inc()
            body = failure(str(exc))
        return web.Response(body=body, content_type="text/plain")

    async def scrape(self, request: web.Request) -> web.Response:
        if not self.announce_limit.allow(request.remote or ""):
            return web.Response(
                body=failure("too many scrapes from your address; wait a minute and scrape again"),
                content_type="text/plain",
            )
        try:
            body = answer_scrape(
                request.rel_url.raw_query_string, self.swarms, None if self.config.open else self.registered
            )
        except ProtocolError as exc:
            body = failure(str(exc))
        return web.Response(body=body, content_type="text/plain")

    # ------------------------------------------------------------ service

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "runs": len(self.runs)})

    async def metrics_page(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    # ------------------------------------------------------------ admin

    async def register_dataset(self, request: web.Request) -> web.Response:
        check_admin(request.headers, self.admin_token)
        msg = decode(await self._body(request), DatasetRegistration, self.limits)
        self.store.add_dataset(msg.infohash, msg.name)
        self.registered.add(bytes.fromhex(msg.infohash))
        return _json(msg, 201)

    async def create_run(self, request: web.Request) -> web.Response:
        check_admin(request.headers, self.admin_token)
        # a RunCreate may carry the data set's tokenizer on top of what max_body_bytes allows (admin only)
        limit = self.config.max_body_bytes + MAX_TOKENIZER_BASE64
        try:
            body = await read_body(request.content, limit, request.content_length)
        except BodyTooLong:
            raise ApiError(413, f"request body is larger than the tracker's limit of {limit} bytes") from None
        msg = decode(body, RunCreate, Limits(max_json_bytes=limit))
        torrent = self._validate_create(msg)
        try:
            tokenizer = tokenizer_bytes(msg)  # (its sha256 against the manifest's)
        except ConfigError as exc:
            raise ApiError(400, f"RunCreate: {exc.field} {exc.problem}") from None
        run_id = f"{_slug(msg.name)}-{secrets.token_hex(3)}"
        spec = RunSpec(
            run_id=run_id,
            name=msg.name,
            model=msg.model,
            dataset=msg.dataset,
            optimizer=msg.optimizer,
            schedule=msg.schedule,
            target_batch_size=msg.target_batch_size,
            micro_batch_size=msg.micro_batch_size,
            averaging=msg.averaging,
            eval=msg.eval,
            join_policy=msg.join_policy,
            tracker_public_key=self.public_key,
            seed=msg.seed,
            created_at=time.time(),
        )
        token_hash = (
            hashlib.sha256(msg.join_token.encode()).hexdigest()
            if msg.join_policy == "token" and msg.join_token
            else None
        )
        self.store.add_run(spec, torrent, token_hash, tokenizer)
        self.registered.add(bytes.fromhex(spec.dataset.infohash))
        self._add_run_state(spec, 0)
        self.torrents[run_id] = torrent
        self.join_tokens[run_id] = token_hash
        log.info("run %s (%s) created", run_id, spec.name)
        return _json(RunCreated(run_id=run_id, spec=spec), 201)

    def _validate_create(self, msg: RunCreate) -> bytes:
        def bad(field: str, problem: str) -> ApiError:
            return ApiError(400, f"RunCreate: {field} {problem}")

        try:
            check_run(msg)  # the same check `run create` and every volunteer make
        except ConfigError as exc:
            raise bad(exc.field, exc.problem) from None
        if not msg.model.param_hash:  # (its form is the schema's)
            raise bad(
                "model.param_hash",
                "must be the 64-hex-character parameter hash of the recipe with these args",
            )
        if msg.join_policy == "token" and not msg.join_token:
            raise bad("join_token", "is required when join_policy is 'token'")
        try:
            torrent = base64.b64decode(msg.torrent, validate=True)
        except (binascii.Error, ValueError):
            raise bad("torrent", "is not valid base64") from None
        if len(torrent) > MAX_TORRENT_BYTES:
            raise bad(
                "torrent",
                f"is {len(torrent)} bytes, more than the {MAX_TORRENT_BYTES} bytes a data set torrent may have",
            )
        try:
            infohash = bencode.infohash_v1(torrent)
        except ProtocolError as exc:
            raise bad("torrent", f"is not a .torrent file ({exc})") from None
        if infohash != msg.dataset.infohash:
            raise bad(
                "dataset.infohash",
                f"is {msg.dataset.infohash} but the torrent's info-hash is {infohash}",
            )
        return torrent

    # ------------------------------------------------------------ runs (public)

    def _summaries(self, *, private: bool) -> list[RunSummary]:
        return [
            RunSummary(
                run_id=r.run_id,
                name=r.spec.name,
                global_step=r.global_step,
                peers_online=len(r.peers),
                created_at=r.spec.created_at,
                closed_at=r.closed_at_time,
            )
            for r in self.runs.values()
            if private or r.spec.join_policy != "token"
        ]

    async def list_runs(self, request: web.Request) -> web.Response:
        return _json(RunList(runs=self._summaries(private=True)))

    async def get_spec(self, request: web.Request) -> web.Response:
        return _json(self._run(request).spec)

    async def get_history(self, request: web.Request) -> web.Response:
        """The newest closed steps (``?limit=``, at most HISTORY_POINTS), oldest first: the page's curves."""
        run = self._run(request)
        limit = _query_number(request, "limit", int, 1, HISTORY_POINTS, default=100)
        steps = self.store.history(run.run_id, limit)[::-1]
        evals = self.store.evals(run.run_id, limit)[::-1]
        return _json(StepHistory(steps=steps, evals=evals))

    # ------------------------------------------------------------ web pages

    async def index_page(self, request: web.Request) -> web.Response:
        return _html(index_html(self._summaries(private=False)))  # private runs are not listed

    async def run_page(self, request: web.Request) -> web.Response:
        """One run's live page. A private run's page needs its join token (``?token=``) or the admin token
        (``?admin_token=`` or the Authorization header); the page itself never shows either."""
        run = self._run(request)
        if run.spec.join_policy == "token":
            token = request.query.get("token", "")
            token_hash = self.join_tokens.get(run.run_id)
            admin = request.query.get("admin_token", "")
            by_token = (
                bool(token)
                and token_hash is not None
                and hmac.compare_digest(hashlib.sha256(token.encode()).hexdigest(), token_hash)
            )
            by_admin = bool(admin) and hmac.compare_digest(admin.encode(), self.admin_token.encode())
            if not (by_token or by_admin):
                try:
                    check_admin(request.headers, self.admin_token)
                except AdminAuthError:
                    raise ApiError(
                        403,
                        f"run {run.run_id} is private: open /runs/{run.run_id}?token=<its join token>",
                    ) from None
        return _html(run_html(run.run_id, run.spec.name))

    async def get_torrent(self, request: web.Request) -> web.Response:
        run = self._run(request)
        return web.Response(
            body=self.torrents[run.run_id],
            content_type="application/x-bittorrent",
            headers={"Content-Disposition": f'attachment; filename="{run.run_id}.torrent"'},
        )

    async def get_tokenizer(self, request: web.Request) -> web.Response:
        """The data set's tokenizer.json, as the publisher sent it (its sha256 is in the spec's manifest).
        Public like the torrent, a private run's too: it describes the data, which every seeder shares."""
        run = self._run(request)
        data = self.store.tokenizer(run.run_id)
        if data is None:  # ("has no tokenizer" tells TrackerClient.get_tokenizer it is not a missing run)
            raise ApiError(
                404,
                f"run {run.run_id} has no tokenizer: its data set was made without --tokenizer or --train-bpe",
            )
        return web.Response(
            body=data,
            content_type=JSON,
            headers={"Content-Disposition": f'attachment; filename="{run.run_id}-tokenizer.json"'},
        )

    async def watch_step(self, request: web.Request) -> web.Response:
        """A long-poll: answers once step ``step`` closed or the run passed it (or after ``wait_s``)."""
        run = self._run(request)
        step = _query_number(request, "step", int, 0, MAX_INT)
        wait_s = min(
            self.config.long_poll_s, _query_number(request, "wait_s", float, 0.0, 3600.0, default=0.0)
        )
        return _json(await run.wait_close(step, wait_s))

    async def get_status(self, request: web.Request) -> web.Response:
        run = self._run(request)
        swarm = self.swarms.by_hash.get(bytes.fromhex(run.spec.dataset.infohash))
        return _json(
            RunStatus(
                run_id=run.run_id,
                name=run.spec.name,
                global_step=run.global_step,
                samples=run.step_samples,
                target=run.target,
                eta_s=run.eta_s(),
                peers_online=len(run.peers),
                samples_per_s=run.rate_sum,
                peers=run.peer_statuses(),
                recent_steps=self.store.history(run.run_id),
                notice=run.closed or run.notice or run.state_notice(),
                closed_at=run.closed_at_time,
                swarm_seeds=swarm.seeders if swarm else 0,
                swarm_peers=len(swarm.peers) if swarm else 0,
                evals=self.store.evals(run.run_id),
            )
        )

    # ------------------------------------------------------------ volunteers

    @staticmethod
    def _address(declared: str | None, request: web.Request) -> str | None:
        if declared is None:
            return None
        try:
            return resolve_address(declared, request.remote)
        except AddressError as exc:
            raise ApiError(400, str(exc)) from None

    async def join(self, request: web.Request) -> web.Response:
        run = self._run(request)
        if run.closed is not None:
            raise ApiError(410, run.closed)
        if not self.join_limit.allow(request.remote or ""):
            raise ApiError(429, "too many joins from your address; wait a few seconds and try again")
        msg = decode(await self._body(request), JoinRequest, self.limits)
        token_hash = self.join_tokens.get(run.run_id)
        if run.spec.join_policy == "token":
            if not msg.token:
                raise ApiError(401, f"run {run.run_id} is private; pass its join token (--token)")
            if token_hash is None or not hmac.compare_digest(
                hashlib.sha256(msg.token.encode()).hexdigest(), token_hash
            ):
                raise ApiError(403, f"the join token for run {run.run_id} is wrong")
        if msg.peer_protocol != PEER_PROTOCOL:
            theirs = f" ({msg.client_version})" if msg.client_version else ""
            raise ApiError(
                409,
                f"this volunteer's crowdtrain{theirs} speaks peer protocol {msg.peer_protocol} but the peers of "
                f"this tracker speak {PEER_PROTOCOL}; install crowdtrain {__version__}, the tracker's version",
            )
        if len(run.peers) >= self.config.max_peers_per_run:
            raise ApiError(503, f"run {run.run_id} has {len(run.peers)} peers, its limit; try again later")
        address = self._address(msg.address, request)
        peer_id = secrets.token_hex(8)
        credential = issue_credential(
            self.signer, run.run_id, peer_id, msg.public_key, self.config.credential_ttl_s
        )
        self.auth.remember(credential)
        peer = Peer(peer_id=peer_id, public_key=msg.public_key, address=None)
        run.add(peer)
        self.checker.update(run, peer, address, None, request.remote or "")
        return _json(
            JoinResponse(
                peer_id=peer_id,
                credential=credential,
                global_step=run.global_step,
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                peer_ttl_s=self.config.peer_ttl_s,
                session_key=self.auth.session_key_for(credential),
                observed_host=request.remote,
            )
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        run, hb, public_key = await self._signed(request, Heartbeat)
        address = self._address(hb.address, request)
        peer = run.peers.get(hb.peer_id)
        if peer is None:  # after a tracker restart or an expiry: the signed credential re-registers it
            if len(run.peers) >= self.config.max_peers_per_run:
                raise ApiError(
                    503, f"run {run.run_id} has {len(run.peers)} peers, its limit; try again later"
                )
            peer = Peer(peer_id=hb.peer_id, public_key=public_key, address=None)
            run.add(peer)
            log.info("peer %s re-registered in run %s by its heartbeat", peer.peer_id, run.run_id)
        if hb.eval is not None:
            self._check_eval(run, hb.eval)  # (before anything of the heartbeat is taken)
        self.checker.update(run, peer, address, hb.bt_port, request.remote or "")
        run.heartbeat(peer, hb)
        if hb.eval is not None and hb.eval.step > peer.evaluated:  # (a retried heartbeat: counted once)
            peer.evaluated = hb.eval.step
            self.store.add_eval(run.run_id, hb.eval)
        return _json(
            HeartbeatReply(
                global_step=run.global_step,
                samples=run.step_samples,
                target=run.target,
                peers_online=len(run.peers),
                samples_per_s=run.rate_sum,
                eta_s=run.eta_s(),
                step_closed=run.closed_at is not None,
                reachable=peer.reachable,
                address=peer.address,
                checked=peer.checked,
                bt_address=peer.bt_address,
                bt_reachable=peer.bt_reachable,
                notice=run.notice,
                allotment=peer.allotted if peer.step == run.global_step and run.closed_at is None else None,
                ahead_share=peer.ahead_share,
            )
        )

    @staticmethod
    def _check_eval(run: RunState, report: EvalReport) -> None:
        """A report of a step the run has taken and its spec evaluates, with finite numbers."""
        every = run.spec.eval.every
        if not every or report.step % every or not 0 < report.step <= run.global_step:
            raise ApiError(
                400,
                f"an evaluation of step {report.step} is not one this run asks for (every {every} steps, "
                f"up to step {run.global_step})",
            )
        values = [report.loss, *report.metrics.values()]
        if not all(math.isfinite(v) for v in values):
            raise ApiError(400, "an evaluation's loss and metrics must be finite numbers")

    async def ready(self, request: web.Request) -> web.Response:
        run, msg, _ = await self._signed(request, ReadyRequest)
        peer = self._known(run, msg.peer_id)
        peer.last_seen = time.monotonic()
        wait_s = self.config.long_poll_s
        raw_wait = request.query.get("wait_s")
        if raw_wait is not None:
            try:
                wait_s = min(wait_s, max(0.0, float(raw_wait)))
            except ValueError:
                raise ApiError(400, "wait_s must be a number of seconds") from None
            if not math.isfinite(wait_s):
                raise ApiError(400, "wait_s must be a number of seconds")
        reply = await run.wait_ready(msg.peer_id, msg.step, msg.weight, wait_s, msg.ahead)
        if run.peers.get(msg.peer_id) is peer:
            peer.last_seen = time.monotonic()
        return _json(reply)

    async def leave(self, request: web.Request) -> web.Response:
        run, msg, _ = await self._signed(request, LeaveRequest)
        if not run.remove(msg.peer_id):
            raise ApiError(404, f"peer {msg.peer_id} is not registered in run {run.run_id}")
        run.maybe_form(time.time())
        return web.Response(status=204)

    async def declare_state(self, request: web.Request) -> web.Response:
        run, msg, _ = await self._signed(request, StateDeclare)
        versions = [msg.state, *msg.older]
        peer = self._known(run, msg.peer_id)
        if peer.address is None:
            raise ApiError(
                400, "only a peer with a reachable address can serve state; declare an address in heartbeats"
            )
        try:
            run.declare_state(peer, versions)
        except StateRefused as exc:
            raise ApiError(403 if peer.donor_dropped else 400, f"state declaration refused: {exc}") from None
        peer.last_seen = time.monotonic()
        return web.Response(status=204)

    async def close_run(self, request: web.Request) -> web.Response:
        """Admin: the run takes no more steps; its volunteers are answered 410 and leave. Idempotent."""
        check_admin(request.headers, self.admin_token)
        run = self._run(request)
        if run.closed is None:
            now = time.time()
            self.store.close_run(run.run_id, now)
            run.close(now)
            log.info("run %s closed by the admin", run.run_id)
        return web.Response(status=204)

    async def delete_run(self, request: web.Request) -> web.Response:
        """Admin: the run and its history are deleted; its volunteers are answered 410 (while this tracker
        runs) and leave."""
        check_admin(request.headers, self.admin_token)
        run = self._run(request)
        run.close(time.time())
        self.store.delete_run(run.run_id)
        del self.runs[run.run_id]
        self.torrents.pop(run.run_id, None)
        self.join_tokens.pop(run.run_id, None)
        self.deleted.add(run.run_id)
        log.info("run %s deleted by the admin", run.run_id)
        return web.Response(status=204)

    async def donors(self, request: web.Request) -> web.Response:
        return _json(self._run(request).donors())


def _query_number(request: web.Request, name: str, kind: type, low: float, high: float, default=None):
    raw = request.query.get(name)
    if raw is None:
        if default is None:
            raise ApiError(400, f"the query needs {name}= (a number from {low:g} to {high:g})")
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ApiError(
            400, f"{name} must be a {'whole ' if kind is int else ''}number, not {raw[:40]!r}"
        ) from None
    if not (math.isfinite(value) and low <= value <= high):
        raise ApiError(400, f"{name} must be a number from {low:g} to {high:g}")
    return value


@contextlib.asynccontextmanager
async def serve(config: TrackerConfig) -> AsyncIterator[Tracker]:
    """Run a tracker until the block exits; yields it with ``url``, ``announce_url``, ``admin_token``."""
    async with asyncio.TaskGroup() as tasks:
        tracker = Tracker(config, tasks)
        try:
            await tracker.start()
            yield tracker
        finally:
            await tracker.close()
