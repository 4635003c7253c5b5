"""The tracker's HTTP service (aiohttp): the app and its routes, error translation, background upkeep,
``serve()``. The public and BitTorrent routes are here; the volunteers' are :mod:`crowdtrain.tracker.volunteers`,
the admin's :mod:`crowdtrain.tracker.admin`. Routes only read requests and write replies: they call the run's
record (:mod:`crowdtrain.tracker.runs`) and its :class:`~crowdtrain.tracker.collab.RunState`, never its fields.

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
    GET  /, /runs/{id}, /api/v1/runs/{id}/history     the live pages and their curves
    POST /api/v1/runs/{id}/close, DELETE /api/v1/runs/{id}   admin: close or delete a run

A body is decoded into its schema (:mod:`crowdtrain.protocol.messages`), which refuses a field out of its
range, length or pattern by name; the routes check only what needs more than one field or the run's state.
Errors are an :class:`ErrorBody` with a sentence and a 4xx status; anything unexpected is logged with its
traceback and answered with a generic 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from aiohttp import web

from crowdtrain.protocol.aio import wait_at_most
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import AuthError, LimitExceeded, ProtocolError
from crowdtrain.protocol.httplog import quiet_parser_errors
from crowdtrain.protocol.limits import Limits
from crowdtrain.protocol.messages import RunList
from crowdtrain.protocol.serving import bind_listeners, start_serving, stop_serving
from crowdtrain.tracker.admin import Admin
from crowdtrain.tracker.announce import AnnounceError, answer_announce, answer_scrape, failure, parse_announce
from crowdtrain.tracker.auth import AdminAuthError, PeerAuth, check_admin
from crowdtrain.tracker.collab import revoke_stragglers
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.metrics import Metrics
from crowdtrain.tracker.page import HISTORY_POINTS, index_html, run_html
from crowdtrain.tracker.policy import POLICY
from crowdtrain.tracker.reach import Checker
from crowdtrain.tracker.replies import JSON, ApiError, error_reply, html_reply, json_reply, query_number
from crowdtrain.tracker.runs import Run, Runs
from crowdtrain.tracker.store import RunStore, Store
from crowdtrain.tracker.swarm import Swarms
from crowdtrain.tracker.volunteers import Volunteers

log = logging.getLogger("crowdtrain.tracker")

RUN_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
SHUTDOWN_DRAIN_S = 5.0  # in-flight requests get this long to finish when the tracker stops
LISTEN_BACKLOG = 1024  # connections waiting to be accepted (a crowd announcing at once)


class TokenBucket:
    """Per-client-IP rate limit (joins). It remembers at most ``capacity`` clients, forgetting the one heard
    from longest ago first: a client asking now is never forgotten (forgetting everyone at once, as it did,
    let a flood from many addresses reset every limit)."""

    def __init__(self, rate: float, burst: int, capacity: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.capacity = capacity
        self.state: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, key: str) -> bool:
        if self.rate <= 0:
            return True
        now = time.monotonic()
        tokens, last = self.state.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        allowed = tokens >= 1
        self.state[key] = (tokens - allowed, now)  # (the newest at the end)
        while len(self.state) > self.capacity:
            self.state.popitem(last=False)
        return allowed


class Tracker:
    """A running tracker. Build it with :func:`serve`."""

    def __init__(self, config: TrackerConfig, tasks: asyncio.TaskGroup) -> None:
        self.config = config
        self._tasks = tasks
        self.store: RunStore = Store(config.db)
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
        self.runs = Runs(self.store, self.signer, on_formed=[self.metrics.step_formed])
        # Peers of a run in progress re-register with their next heartbeat: give them three intervals.
        self.runs.load(quiet_s=3 * config.heartbeat_interval_s)
        self.registered: set[bytes] = {bytes.fromhex(h) for h in self.store.datasets()}
        self.swarms = Swarms(config.max_swarm_peers)
        self.metrics.bind(self.runs, self.swarms)
        self._stop = asyncio.Event()
        self.checker = Checker(config.reachability_timeout_s, config.reachability_concurrency, tasks)
        self._runner: web.AppRunner | None = None
        self._sockets: list[socket.socket] = []
        self.url = ""
        self.announce_url = ""
        self.port = 0

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._middleware])
        r = app.router
        r.add_get("/announce", self.announce)
        r.add_get("/scrape", self.scrape)
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics_page)
        admin, volunteers = Admin(self), Volunteers(self)
        # A run's routes are tried in the order they were added (aiohttp matches the ones under /api/v1/runs
        # one by one): the step's requests, a few per volunteer per step, first.
        r.add_get("/api/v1/runs/{run_id}/step", volunteers.watch_step)
        r.add_post("/api/v1/runs/{run_id}/heartbeat", volunteers.heartbeat)
        r.add_post("/api/v1/runs/{run_id}/ready", volunteers.ready)
        r.add_post("/api/v1/runs/{run_id}/spotcheck", volunteers.spot_check)
        r.add_post("/api/v1/runs/{run_id}/cut", volunteers.cut)
        r.add_post("/api/v1/runs/{run_id}/complaint", volunteers.complaint)
        r.add_post("/api/v1/runs/{run_id}/verdicts", volunteers.verdicts)
        r.add_post("/api/v1/runs/{run_id}/pull", volunteers.pull)
        r.add_post("/api/v1/datasets", admin.register_dataset)
        r.add_post("/api/v1/runs", admin.create_run)
        r.add_get("/api/v1/runs", self.list_runs)
        r.add_get("/api/v1/runs/{run_id}", self.get_spec)
        r.add_get("/api/v1/runs/{run_id}/torrent", self.get_torrent)
        r.add_get("/api/v1/runs/{run_id}/tokenizer", self.get_tokenizer)
        r.add_get("/api/v1/runs/{run_id}/status", self.get_status)
        r.add_post("/api/v1/runs/{run_id}/join", volunteers.join)
        r.add_post("/api/v1/runs/{run_id}/leave", volunteers.leave)
        r.add_post("/api/v1/runs/{run_id}/state", volunteers.declare_state)
        r.add_get("/api/v1/runs/{run_id}/state/donors", volunteers.donors)
        r.add_get("/", self.index_page)
        r.add_get("/runs/{run_id}", self.run_page)
        r.add_get("/api/v1/runs/{run_id}/history", self.get_history)
        r.add_post("/api/v1/runs/{run_id}/close", admin.close_run)
        r.add_delete("/api/v1/runs/{run_id}", admin.delete_run)
        return app

    async def start(self) -> None:
        quiet_parser_errors()
        await self.checker.start()
        # a connection that completes no request for peer_ttl_s (a slowloris trickling header bytes, or an
        # idle keep-alive) is closed, as a volunteer silent that long is forgotten (aiohttp's default: 1 h)
        self._runner = web.AppRunner(
            self.app(),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=SHUTDOWN_DRAIN_S,
            keepalive_timeout=self.config.peer_ttl_s,
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
        for run in self.runs.live():  # long-polls answer "wait" now instead of holding the shutdown
            run.state.stop()
        await stop_serving(self._runner, self._sockets)
        await self.checker.close()
        self.store.close()

    async def _upkeep(self) -> None:
        """Close steps on their timeout, form groups after the gather window, expire silent peers."""
        last_expiry = last_straggle = 0.0
        silent_s = POLICY.silent_s(self.config.straggler_intervals, self.config.heartbeat_interval_s)
        while not self._stop.is_set():
            await wait_at_most(self._stop, 0.1)
            now = time.time()
            expire = time.monotonic() - last_expiry >= min(1.0, self.config.peer_ttl_s / 4)
            straggle = (
                self.config.straggler_intervals > 0
                and time.monotonic() - last_straggle >= POLICY.straggle_check_s
            )
            if straggle:
                last_straggle = time.monotonic()
            for run in self.runs.live():
                try:
                    if straggle:
                        revoke_stragglers(run.state, silent_s)
                    if expire:
                        run.state.expire(self.config.peer_ttl_s)
                    run.state.tick(now)
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
            response = error_reply(exc.status, str(exc))
        except LimitExceeded as exc:
            response = error_reply(413, str(exc))
        except ProtocolError as exc:
            response = error_reply(400, str(exc))
        except AdminAuthError as exc:
            response = error_reply(exc.status, str(exc))
        except AuthError as exc:
            response = error_reply(401, str(exc))
        except web.HTTPRequestEntityTooLarge:
            response = error_reply(
                413, f"request body is larger than the tracker's limit of {self.config.max_body_bytes} bytes"
            )
        except web.HTTPNotFound:
            response = error_reply(404, f"no such endpoint: {request.method} {request.path}")
        except web.HTTPMethodNotAllowed as exc:
            response = error_reply(
                405,
                f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(exc.allowed_methods))}",
            )
        except web.HTTPException:
            raise
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.path)
            response = error_reply(500, "internal error in the tracker; its log has the details")
        self.metrics.request(route, response.status)
        return response

    async def body(self, request: web.Request) -> bytes:
        """The request's body, at most ``max_body_bytes`` (413 beyond)."""
        length = request.content_length
        if length is not None and length > self.config.max_body_bytes:
            raise ApiError(
                413, f"request body is larger than the tracker's limit of {self.config.max_body_bytes} bytes"
            )
        return await request.read()

    def run_of(self, request: web.Request) -> Run:
        """The run the request's path names: 404 if there is none, 410 if its admin deleted it."""
        run_id = request.match_info["run_id"]
        run = self.runs.get(run_id) if RUN_ID.fullmatch(run_id) else None
        if run is not None and run.deleted:
            raise ApiError(410, f"run {run_id} was deleted by its admin; it takes no more steps")
        if run is None:
            raise ApiError(
                404, f"there is no run {run_id[:80]!r} on this tracker; list runs with GET /api/v1/runs"
            )
        return run

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

    # ------------------------------------------------------------ runs (public)

    async def list_runs(self, request: web.Request) -> web.Response:
        return json_reply(RunList(runs=self.runs.summaries(private=True)))

    async def get_spec(self, request: web.Request) -> web.Response:
        return json_reply(self.run_of(request).spec)

    async def get_history(self, request: web.Request) -> web.Response:
        """The newest closed steps (``?limit=``, at most HISTORY_POINTS), oldest first: the page's curves."""
        run = self.run_of(request)
        limit = query_number(request, "limit", int, 1, HISTORY_POINTS, default=100)
        return json_reply(run.history(limit))

    async def get_status(self, request: web.Request) -> web.Response:
        return json_reply(self.run_of(request).status(self.swarms))

    async def get_torrent(self, request: web.Request) -> web.Response:
        run = self.run_of(request)
        return web.Response(
            body=run.torrent,
            content_type="application/x-bittorrent",
            headers={"Content-Disposition": f'attachment; filename="{run.run_id}.torrent"'},
        )

    async def get_tokenizer(self, request: web.Request) -> web.Response:
        """The data set's tokenizer.json, as the publisher sent it (its sha256 is in the spec's manifest).
        Public like the torrent, a private run's too: it describes the data, which every seeder shares."""
        run = self.run_of(request)
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

    # ------------------------------------------------------------ web pages

    async def index_page(self, request: web.Request) -> web.Response:
        return html_reply(index_html(self.runs.summaries(private=False)))  # private runs are not listed

    async def run_page(self, request: web.Request) -> web.Response:
        """One run's live page. A private run's page needs its join token (``?token=``) or the admin token in
        the Authorization header, never in the URL (a URL lands in browser histories, proxies' logs and
        Referer headers); the page itself never shows either."""
        run = self.run_of(request)
        if run.private and not run.admits(request.query.get("token", "")):
            try:
                check_admin(request.headers, self.admin_token)
            except AdminAuthError:
                raise ApiError(
                    403, f"run {run.run_id} is private: open /runs/{run.run_id}?token=<its join token>"
                ) from None
        return html_reply(run_html(run.run_id, run.spec.name))


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
