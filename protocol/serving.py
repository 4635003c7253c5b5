"""Listening sockets for our aiohttp servers (the tracker, a volunteer's peer server), and their shutdown.

Each server binds its own sockets (:func:`bind_listener`, :func:`bind_listeners`), serves them with
:func:`start_serving` and stops with :func:`stop_serving`, never with ``runner.cleanup()`` alone: that one
can leak a connection accepted just before it. asyncio accepts a connection in one loop iteration and makes
its transport in a task one iteration later; if the server is closed inside that gap, making the transport
fails an assertion (``Server._attach``) that asyncio swallows (CPython gh-109564, open; we run 3.11).
aiohttp then never sees the connection, so the cleanup never closes it, and its socket is reported unclosed
(a ResourceWarning) once collected. :func:`stop_serving` stops accepting first, lets every connection already
accepted get its transport and reach aiohttp, and only then cleans up.

At most MAX_CONNECTIONS_PER_ADDRESS connections are open at once from one address (many slow
connections from one host, each held until its idle limit, would take every file descriptor): the next one is
answered 503 with a sentence and closed. An address is counted as the tracker counts identities
(:func:`~crowdtrain.protocol.addresses.origin_of`: an IPv4 address or an IPv6 /64; this machine's own,
127.0.0.1 and ::1, not at all).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from typing import cast

from aiohttp import web

from crowdtrain.protocol.addresses import origin_of

# asyncio's create_server sets SO_REUSEADDR by default on these platforms only (elsewhere it means another
# process may bind the same port).
_REUSE_ADDRESS = os.name == "posix" and sys.platform != "cygwin"


# Connections open at once from one address (NAT'd volunteers share one: each holds ~3 to a tracker, and a
# run takes at most 8 identities from one address).
MAX_CONNECTIONS_PER_ADDRESS = 64
_TOO_MANY = json.dumps(
    {
        "error": f"more than {MAX_CONNECTIONS_PER_ADDRESS} connections are open from your address; close some first"
    }
).encode()
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    + f"Content-Length: {len(_TOO_MANY)}\r\n\r\n".encode()
    + _TOO_MANY
)


class _Bounded(asyncio.Protocol):
    """One connection's protocol: aiohttp's, unless its address already holds MAX_CONNECTIONS_PER_ADDRESS
    open connections (then it is answered 503 and closed)."""

    __slots__ = ("_address", "_inner", "_open", "_refused")

    def __init__(self, inner: asyncio.Protocol, open_: Counter[str]) -> None:
        self._inner = inner
        self._open = open_
        self._address: str | None = None  # the origin counted in ``_open`` (None: not counted)
        self._refused = False  # answered 503 and closed: aiohttp never saw it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        origin = origin_of(peer[0] if isinstance(peer, tuple) and peer else None)
        if origin is not None:
            address = origin.address
            if self._open[address] >= MAX_CONNECTIONS_PER_ADDRESS:
                # (a stream transport writes: asyncio's is a WriteTransport, uvloop's TCPTransport is not one
                # by class, so an isinstance check failed there, a traceback per connection over the bound)
                cast(asyncio.WriteTransport, transport).write(_REFUSAL)
                transport.close()
                self._refused = True
                return
            self._open[address] += 1
            self._address = address
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        if self._address is not None:
            self._open[self._address] -= 1
            if self._open[self._address] <= 0:
                del self._open[self._address]
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class _BoundedSite(web.SockSite):
    """aiohttp's SockSite, each connection's protocol wrapped in :class:`_Bounded` (the counts per site)."""

    async def start(self) -> None:
        await web.BaseSite.start(self)  # (registers the site with its runner; SockSite.start would serve it)
        server: Callable[[], asyncio.Protocol] | None = self._runner.server
        assert server is not None
        open_: Counter[str] = Counter()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Bounded(server(), open_), sock=self._sock, backlog=self._backlog
        )


def _listen(info: tuple, backlog: int, *, v6only: bool) -> socket.socket:
    family, kind, proto, _, address = info
    sock = socket.socket(family, kind, proto)
    try:
        if _REUSE_ADDRESS:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if v6only and family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _addresses(host: str, port: int) -> list[tuple]:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return list(dict.fromkeys(infos))  # (without repeats, in the resolver's order)


def bind_listener(host: str, port: int, backlog: int) -> socket.socket:
    """One socket listening (non-blocking) on the first address of ``host`` at ``port`` (0: a free one).

    A connection made before :func:`start_serving` waits in the backlog. IPv6 ``::`` keeps the system's
    dual stack."""
    return _listen(_addresses(host, port)[0], backlog, v6only=False)


def bind_listeners(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Sockets listening on every address of ``host`` at ``port``, as aiohttp's ``TCPSite`` binds them
    (asyncio's ``create_server``): one socket per address, IPv6 ones IPv6-only, and with port 0 each its own
    free port."""
    sockets: list[socket.socket] = []
    try:
        for info in _addresses(host, port):
            sockets.append(_listen(info, backlog, v6only=True))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def start_serving(runner: web.BaseRunner, sockets: Iterable[socket.socket], backlog: int) -> None:
    """Serve ``runner`` (set up) on the bound sockets; ``backlog`` as they were bound with (asyncio listens
    again with it)."""
    for sock in sockets:
        await _BoundedSite(runner, sock, backlog=backlog).start()


async def stop_serving(runner: web.BaseRunner | None, sockets: Iterable[socket.socket]) -> None:
    """Stop accepting, let the connections already accepted reach aiohttp, clean ``runner`` up (None: it
    never served), close the sockets. See the module's docstring for why (CPython gh-109564)."""
    sockets = list(sockets)
    if runner is not None:
        loop = asyncio.get_running_loop()
        for sock in sockets:
            if sock.fileno() != -1:
                loop.remove_reader(sock.fileno())
        # The first yield runs the accepting tasks' first step (each connection's transport is made, while the
        # server is still open); the second runs each protocol's connection_made (aiohttp registers it).
        for _ in range(2):
            await asyncio.sleep(0)
        await runner.cleanup()
    for sock in sockets:
        sock.close()
