"""The volunteer's one peer server: a ping for the tracker's reachability check, plus the routes of the
all-reduce and of state serving, on one aiohttp app bound to a free port.

:meth:`PeerServer.bind` takes the port before the routes are known (the join declares it, and the
tracker's check may connect at once: it waits in the listen backlog until :meth:`PeerServer.start`)."""

from __future__ import annotations

import socket
from collections.abc import Iterable

from aiohttp import web

from crowdtrain.protocol.httplog import quiet_parser_errors
from crowdtrain.protocol.serving import bind_listener, start_serving, stop_serving

MAX_BODY = 256 << 20  # the all-reduce routes stream their bodies; this bounds anything read whole
BACKLOG = 128
IDLE_S = 30.0  # longer than a client's own keep-alive (aiohttp's 15 s), so it never closes one in use


class PeerServer:
    def __init__(self, host: str, port: int, idle_s: float = IDLE_S) -> None:
        self.host = host
        self.port = port
        self.idle_s = idle_s  # (IDLE_S; a test of the limit itself sets a shorter one)
        self.peer_id = ""
        self._app = web.Application(client_max_size=MAX_BODY)
        self._app.router.add_get("/v1/ping", self._ping)
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None

    def add_routes(self, routes: Iterable[web.RouteDef]) -> None:
        self._app.add_routes(list(routes))

    async def _ping(self, request: web.Request) -> web.Response:
        return web.json_response({"peer_id": self.peer_id})

    def bind(self) -> int:
        """Take the port (listening from now on, answering once started); returns it."""
        self._listener()
        return self.port

    def _listener(self) -> socket.socket:
        """The listening socket, bound on first use."""
        if self._sock is None:
            self._sock = bind_listener(self.host, self.port, BACKLOG)
            self.port = self._sock.getsockname()[1]
        return self._sock

    async def start(self) -> int:
        """Serve on the bound port (binding it first if needed); returns the port."""
        sock = self._listener()
        quiet_parser_errors()
        # a connection that completes no request for idle_s (a slowloris, or an idle keep-alive) is closed
        self._runner = web.AppRunner(
            self._app, access_log=None, handle_signals=False, keepalive_timeout=self.idle_s
        )
        await self._runner.setup()
        await start_serving(self._runner, [sock], BACKLOG)
        return self.port

    async def stop(self) -> None:
        if self._sock is not None:  # (the runner, if any, serves it: start binds first)
            await stop_serving(self._runner, [self._sock])
        self._runner = None
        self._sock = None
