"""Serving this volunteer's newest state snapshot to newcomers, in ranges, over the peer server.

Routes (mounted by the volunteer on its one peer server via :meth:`StateServer.routes`):

* ``GET /v1/state/{content_hash}/manifest`` → :class:`StateManifest` JSON;
* ``GET /v1/state/{content_hash}`` → the snapshot bytes; ``Range: bytes=a-b`` (one range; ``a-`` and
  ``-n`` too) answers 206. When the request says ``Accept-Encoding: zstd`` and asks for exactly one of
  the manifest's ranges, the body is that range as one zstd frame (``Content-Encoding: zstd``; the Range
  and ``Content-Range`` count the uncompressed bytes), if compression makes it smaller.

Every request carries peer authentication (:mod:`crowdtrain.protocol.peerauth`, purpose ``"state"``,
fields: the content hash, then the ``Range`` header as sent, or ``"manifest"`` for the manifest); without
it: 401. Unknown hash: 404. Bad or unsatisfiable range: 416. More than ``max_uploads`` range uploads at
once: 503 with ``Retry-After``. Uploads are paced to ``upload_rate`` bytes/s in total when it is set.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zstandard
from aiohttp import web

from crowdtrain.protocol.errors import AuthError, ProtocolError
from crowdtrain.protocol.messages import HEX64, MAX_DECLARED_STATES, ErrorBody, StateVersion, encode
from crowdtrain.protocol.peerauth import check_headers
from crowdtrain.volunteer.events import Emit, StateServed, no_emit
from crowdtrain.volunteer.state.config import StateConfig
from crowdtrain.volunteer.state.snapshot import Snapshot

_RANGE = re.compile(r"^bytes=(\d{0,20})-(\d{0,20})$")
_WRITE_PIECE = 256 << 10
_PACED_PIECE = 128 << 10
_BURST_S = 0.25  # a pacer that fell behind (a busy machine) may catch up this much at once


class RangeNotSatisfiable(ProtocolError):
    """The request's Range header is malformed or outside the snapshot."""


def parse_range(header: str | None, total: int) -> tuple[int, int] | None:
    """``(start, end_exclusive)`` of a one-range ``Range`` header; ``None`` when there is none."""
    if header is None:
        return None
    match = _RANGE.match(header.strip())
    if match is None or (not match[1] and not match[2]):
        raise RangeNotSatisfiable(f"Range {header[:80]!r} is not one 'bytes=first-last' range")
    if not match[1]:  # suffix: the last n bytes
        n = int(match[2])
        if n == 0 or total == 0:
            raise RangeNotSatisfiable(f"Range {header!r} asks for no bytes")
        return max(0, total - n), total
    start = int(match[1])
    end = int(match[2]) + 1 if match[2] else total
    if start >= total or end <= start:
        raise RangeNotSatisfiable(f"Range {header!r} is outside the state's {total} bytes")
    return start, min(end, total)


def accepts_zstd(header: str | None) -> bool:
    for item in (header or "").split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() == "zstd":
            q = params.strip().removeprefix("q=")
            return not (params and q.replace(".", "", 1).isdigit() and float(q) == 0)
    return False


class _Pacer:
    """A shared clock that spaces writes to ``rate`` bytes/s on average (bursts up to ``_BURST_S``)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._next = 0.0

    async def take(self, n: int) -> None:
        if self.rate is None:
            return
        now = asyncio.get_running_loop().time()
        self._next = max(self._next, now - _BURST_S) + n / self.rate
        if self._next > now:
            await asyncio.sleep(self._next - now)


@dataclass(slots=True)
class _Served:
    snapshot: Snapshot
    compressed: dict[int, bytes | None] = field(default_factory=dict)  # range index → frame, None = no gain
    locks: dict[int, asyncio.Lock] = field(default_factory=dict)
    last_access: float = 0.0  # monotonic time of the last request for it
    sending: int = 0  # uploads of it in progress (its file is kept until they end)


class StateServer:
    def __init__(
        self, *, run_id: str, tracker_public_key: str, config: StateConfig, emit: Emit = no_emit
    ) -> None:
        self.run_id = run_id
        self.tracker_public_key = tracker_public_key
        self.config = config
        self._emit = emit
        self._served: OrderedDict[str, _Served] = OrderedDict()
        self._uploads = 0
        self._pacer = _Pacer(config.upload_rate)

    # ------------------------------------------------------------ publishing

    def publish(self, snapshot: Snapshot) -> None:
        """Serve ``snapshot`` from now on; keep the previous one too when ``keep_previous``."""
        if snapshot.manifest.run_id != self.run_id:
            raise ValueError(f"snapshot is of run {snapshot.manifest.run_id!r}, not {self.run_id!r}")
        self._served.pop(snapshot.content_hash, None)
        self._served[snapshot.content_hash] = _Served(snapshot)
        # Older snapshots go, except one that a newcomer fetched within ``pin_s`` (its download must be
        # able to finish even when steps are quicker than it), up to ``max_snapshots`` in memory.
        keep = 2 if self.config.keep_previous else 1
        now = time.monotonic()
        for content_hash, served in list(self._served.items())[:-keep]:
            in_use = now - served.last_access < self.config.pin_s
            if not in_use or len(self._served) > self.config.max_snapshots:
                del self._served[content_hash]
                if not served.sending:
                    served.snapshot.discard()  # its file (an upload in progress discards it when done)
        self._emit(StateServed(step=snapshot.step, content_hash=snapshot.content_hash, size=snapshot.size))

    def close(self) -> None:
        """Stop serving: every snapshot file is deleted."""
        for served in self._served.values():
            served.snapshot.discard()
        self._served.clear()

    @property
    def versions(self) -> list[StateVersion]:
        """The versions served, newest first (as declared to the tracker)."""
        return [served.snapshot.version for served in reversed(self._served.values())][:MAX_DECLARED_STATES]

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/state/{content_hash}/manifest", self._manifest, allow_head=False),
            web.get("/v1/state/{content_hash}", self._state, allow_head=False),
        ]

    # ------------------------------------------------------------ handlers

    def _lookup(self, request: web.Request, *fields: str) -> _Served:
        content_hash = request.match_info["content_hash"]
        if not HEX64.fullmatch(content_hash):
            raise _error(
                web.HTTPNotFound, f"{content_hash[:80]!r} is not a state content hash (64 hex digits)"
            )
        try:
            check_headers(
                request.headers, self.tracker_public_key, self.run_id, "state", content_hash, *fields
            )
        except AuthError as exc:
            raise _error(
                web.HTTPUnauthorized, f"state requests need a run member's signature: {exc}"
            ) from None
        served = self._served.get(content_hash)
        if served is not None:
            served.last_access = time.monotonic()
        if served is None:
            raise _error(
                web.HTTPNotFound,
                f"this peer does not serve state {content_hash}; ask the tracker for the current donors",
            )
        return served

    async def _manifest(self, request: web.Request) -> web.Response:
        served = self._lookup(request, "manifest")
        return web.Response(body=encode(served.snapshot.manifest), content_type="application/json")

    async def _state(self, request: web.Request) -> web.StreamResponse:
        range_header = request.headers.get("Range")
        served = self._lookup(request, range_header or "")
        snap = served.snapshot
        total = snap.size
        try:
            span = parse_range(range_header, total)
        except RangeNotSatisfiable as exc:
            raise _error(
                web.HTTPRequestRangeNotSatisfiable, str(exc), headers={"Content-Range": f"bytes */{total}"}
            ) from None
        if self._uploads >= self.config.max_uploads:
            raise _error(
                web.HTTPServiceUnavailable,
                f"this peer already uploads {self._uploads} state ranges; retry later or use another donor",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        self._uploads += 1
        served.sending += 1
        try:
            return await self._send(request, served, span)
        finally:
            self._uploads -= 1
            served.sending -= 1
            if not served.sending and self._served.get(snap.content_hash) is not served:
                served.snapshot.discard()  # replaced while this upload ran

    async def _send(
        self, request: web.Request, served: _Served, span: tuple[int, int] | None
    ) -> web.StreamResponse:
        snap = served.snapshot
        total = snap.size
        start, end = span if span is not None else (0, total)
        frame: bytes | None = None
        headers = {
            "Accept-Ranges": "bytes",
            "ETag": f'"{snap.content_hash}"',
            "Content-Type": "application/octet-stream",
        }
        if span is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{total}"
        rb = snap.manifest.range_bytes
        aligned = span is not None and start % rb == 0 and end == min(start + rb, total)
        if aligned and self.config.zstd_level > 0 and accepts_zstd(request.headers.get("Accept-Encoding")):
            frame = await self._compressed(served, start // rb)
            if frame is not None:
                headers["Content-Encoding"] = "zstd"
        response = web.StreamResponse(status=206 if span is not None else 200, headers=headers)
        response.content_length = len(frame) if frame is not None else end - start
        piece = _PACED_PIECE if self._pacer.rate is not None else _WRITE_PIECE
        chunk: bytes | memoryview
        try:
            await response.prepare(request)
            for offset in range(0, response.content_length, piece):
                if frame is not None:
                    chunk = memoryview(frame)[offset : offset + piece]
                else:  # read from its file as it goes: a large state is never held in memory to serve it
                    chunk = await asyncio.to_thread(
                        snap.read, start + offset, min(start + offset + piece, end)
                    )
                await self._pacer.take(len(chunk))
                await response.write(chunk)
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away (e.g. another donor delivered this range first); nothing to answer
        return response

    async def _compressed(self, served: _Served, index: int) -> bytes | None:
        if index in served.compressed:
            return served.compressed[index]
        lock = served.locks.setdefault(index, asyncio.Lock())
        async with lock:
            if index in served.compressed:
                return served.compressed[index]
            snap = served.snapshot
            rb = snap.manifest.range_bytes
            level = self.config.zstd_level

            def compress() -> tuple[bytes, int]:
                raw = snap.read(index * rb, min((index + 1) * rb, snap.size))
                return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw), len(raw)

            frame, raw_size = await asyncio.to_thread(compress)
            result = frame if len(frame) < raw_size else None
            # Compressed ranges are kept for the next newcomer, within a byte budget: a state larger than
            # it is compressed again per request rather than held in memory twice.
            held = sum(len(f) for f in served.compressed.values() if f is not None)
            if result is None or held + len(result) <= self.config.compressed_cache_bytes:
                served.compressed[index] = result
            served.locks.pop(index, None)
        return result


def _error(
    kind: type[web.HTTPException], message: str, headers: dict[str, str] | None = None
) -> web.HTTPException:
    return kind(
        text=encode(ErrorBody(error=message)).decode(), content_type="application/json", headers=headers
    )
