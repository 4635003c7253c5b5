"""The one client of peer-to-peer calls, as :class:`~crowdtrain.protocol.client.TrackerClient` is the tracker's:
every request one volunteer makes of another (a copy of a part and its answer, a kept average, a spot-check's
samples, a state's manifest and ranges, "are you awake") goes through a :class:`PeerClient`.

One session policy: a session of its own per client (connections to a peer reused across its requests, no
limit on them: the callers bound their own concurrency), bodies passed as sent (``auto_decompress=False``: a
state range's zstd frame is checked before it is decoded), a timeout per request, redirects never followed
(the tracker's reachability checks use it too: a peer cannot send them elsewhere).

One mapping of failures: whatever the network does while a request is open (refused, reset, cut short, the
deadline passed) comes out of :meth:`PeerClient.request` as :class:`PeerUnreachable`, saying so in a phrase and
whether the time ran out; the status of an answer and its body are the caller's to judge (a refusal's sentence
read whole by :func:`error_text`), and a malformed body is the caller's :class:`ProtocolError`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from crowdtrain.protocol.aio import BodyTooLong, read_body
from crowdtrain.protocol.errors import CrowdtrainError

# what the network may raise while a request is open: the transport's errors, a body cut short, the time out
NETWORK_ERRORS = (aiohttp.ClientError, asyncio.IncompleteReadError, ConnectionError, OSError, TimeoutError)


class PeerUnreachable(CrowdtrainError):
    """A peer did not answer, or its answer was cut off (refused, reset, timed out): ``timed_out`` says
    whether the time ran out."""

    def __init__(self, address: str, why: str, *, timed_out: bool = False) -> None:
        self.address = address
        self.timed_out = timed_out
        super().__init__(f"peer {address} {why}")


def describe(exc: BaseException) -> str:
    """A network failure as a phrase: ``did not answer in time``, or its class and message."""
    if isinstance(exc, TimeoutError):
        return "did not answer in time"
    return f"failed: {type(exc).__name__}: {exc}"[:200]


class PeerClient:
    """Requests of other peers, over one session of its own (opened on the first request, closed by
    :meth:`close` or ``async with``)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False),
                auto_decompress=False,
            )
        return self._session

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        address: str,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        data: Any = None,
        timeouts: aiohttp.ClientTimeout | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """``method`` ``http://{address}{path}``: the response, open while the block runs (read its body
        there). A network failure, at the request or while the block reads, raises :class:`PeerUnreachable`;
        what the block itself raises otherwise passes through."""
        try:
            async with self._open().request(
                method,
                f"http://{address}{path}",
                headers=headers,
                data=data,
                timeout=timeouts,
                allow_redirects=False,  # (a peer's answer is its own: a redirect is not followed anywhere)
            ) as resp:
                yield resp
        except NETWORK_ERRORS as exc:
            raise PeerUnreachable(address, describe(exc), timed_out=isinstance(exc, TimeoutError)) from None

    def get(
        self, address: str, path: str, **kw: Any
    ) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientResponse]:
        return self.request("GET", address, path, **kw)

    def post(
        self, address: str, path: str, **kw: Any
    ) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientResponse]:
        return self.request("POST", address, path, **kw)


async def error_text(resp: aiohttp.ClientResponse, limit: int = 4096) -> str:
    """A peer's refusal (its body), read whole up to ``limit`` bytes."""
    try:
        raw = await read_body(resp.content, limit, resp.content_length)
    except BodyTooLong:
        return f"an answer of more than {limit} bytes"
    return raw.decode("utf-8", "replace")
