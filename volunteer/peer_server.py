"""The volunteer's one peer server: a ping for the tracker's reachability check, plus the routes of the
all-reduce and of state serving, on one aiohttp app bound to a free port."""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web

MAX_BODY = 256 << 20  # the all-reduce routes stream their bodies; this bounds anything read whole


class PeerServer:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.peer_id = ""
        self._app = web.Application(client_max_size=MAX_BODY)
        self._app.router.add_get("/v1/ping", self._ping)
        self._runner: web.AppRunner | None = None

    def add_routes(self, routes: Iterable[web.RouteDef]) -> None:
        self._app.add_routes(list(routes))

    async def _ping(self, request: web.Request) -> web.Response:
        return web.json_response({"peer_id": self.peer_id})

    async def start(self) -> int:
        """Start listening; returns the bound port."""
        self._runner = web.AppRunner(self._app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
