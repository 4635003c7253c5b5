"""Fetching the run's current state from several donors at once, in verified ranges.

:func:`fetch_state` first asks every donor for the manifest of the wanted :class:`StateVersion` (run,
step, content hash and size must match, sizes bounded). If a majority of the donors sends the same
manifest, it is used and the others are banned; otherwise each distinct manifest is tried in turn, most
voted first, while the donors that sent another one sit out (a lying manifest must not get honest donors
banned). Once the state verifies, donors whose manifest contradicts it are banned.

Then ``ranges_per_donor`` workers per donor pull range indices from one shared queue, so a fast donor
takes more ranges than a slow one (work-stealing). A failed request puts its range back in the queue; a
donor failing ``max_donor_failures`` times in a row (or answering 503 ``max_busy_answers`` times, or
401/404/416 once) is dropped; a donor that sends a range whose sha256 differs from the manifest is banned
at once (:class:`DonorBanned`). When the queue is empty, an idle worker races a range still in flight
elsewhere (end-game); the first verified copy wins and the other request is cancelled. The whole-state
sha256 is computed in order while ranges arrive and checked at the end. Every request has a time-out,
and every failure counts against a donor, so the fetch ends: with the state, or with a
:class:`StateSyncError` naming every donor tried and why it failed.

The state is returned as ``bytes`` in memory (bounded by ``max_state_bytes``; the peak is about twice the
state, the verified ranges plus their final join), or, given ``into``, written to that file as the ranges
are hashed in order (only the ranges that arrived ahead of the next one to hash are held in memory). Load
it with ``await asyncio.to_thread(load_snapshot, data_or_path)``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, cast

import aiohttp
import zstandard

from crowdtrain.protocol.aio import BodyTooLong, read_body, wait_at_most
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import LimitExceeded, ProtocolError, StateSyncError
from crowdtrain.protocol.limits import Limits
from crowdtrain.protocol.messages import (
    HEX64,
    Credential,
    Donor,
    ErrorBody,
    StateManifest,
    StateVersion,
    decode,
)
from crowdtrain.protocol.peerauth import sign_headers
from crowdtrain.protocol.peerclient import NETWORK_ERRORS, PeerClient, PeerUnreachable
from crowdtrain.volunteer.events import (
    DonorBanned,
    Emit,
    StateLoaded,
    StateSyncProgress,
    StateSyncStarted,
    no_emit,
)
from crowdtrain.volunteer.state.config import KiB, MiB, StateConfig

_MAX_MANIFEST_BYTES = 8 * MiB
_MAX_ERROR_BYTES = 4 * KiB
_MANIFEST_LIMITS = Limits(max_json_bytes=_MAX_MANIFEST_BYTES)


def donor_name(donor: Donor) -> str:
    return f"{donor.peer_id} at {donor.address}"


class _Transient(Exception):
    """A request failed in a way that may not happen again (time-out, refused, short body)."""


class _Busy(Exception):
    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(f"busy (503), retry after {retry_after:g} s")


class _Refused(Exception):
    """The donor answered that it cannot serve this state to us (401, 404, 416…): do not ask again."""


class _BadRange(Exception):
    """The donor sent bytes whose sha256 is not the manifest's."""


@dataclass(slots=True)
class _DonorState:
    donor: Donor
    failures: int = 0  # in a row
    busy: int = 0
    out: str | None = None  # why this donor is no longer used
    banned: bool = False
    ranges: int = 0
    bytes: int = 0
    busy_until: float = 0.0
    sitting_out: bool = False  # voted for another manifest than the one being tried

    @property
    def active(self) -> bool:
        return self.out is None and not self.sitting_out

    @property
    def name(self) -> str:
        return donor_name(self.donor)


@dataclass(slots=True)
class _Job:
    manifest: StateManifest
    parts: list[bytes | None]  # verified ranges, in order
    done: list[bool]
    pending: deque[int]
    attempts: dict[int, dict[int, asyncio.Task[bytes]]] = field(default_factory=dict)  # range → worker → task
    started: dict[int, float] = field(default_factory=dict)
    remaining: int = 0
    done_bytes: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def span(self, index: int) -> tuple[int, int]:
        rb = self.manifest.range_bytes
        return index * rb, min((index + 1) * rb, self.manifest.total_bytes)


def _path(content_hash: str, suffix: str = "") -> str:
    return f"/v1/state/{content_hash}{suffix}"


def check_manifest(manifest: StateManifest, version: StateVersion, run_id: str, config: StateConfig) -> None:
    """Raise :class:`ProtocolError` unless ``manifest`` describes exactly ``version`` within our limits."""
    if manifest.run_id != run_id:
        raise ProtocolError(f"manifest is for run {manifest.run_id!r}, not {run_id!r}")
    if manifest.content_hash != version.content_hash or manifest.step != version.step:
        raise ProtocolError(
            f"manifest describes step {manifest.step} ({manifest.content_hash[:12]}…), "
            f"not the wanted step {version.step} ({version.content_hash[:12]}…)"
        )
    if manifest.total_bytes != version.size:
        raise ProtocolError(f"manifest says {manifest.total_bytes} bytes; the tracker lists {version.size}")
    if not 0 < manifest.total_bytes <= config.max_state_bytes:
        raise LimitExceeded(
            f"state is {manifest.total_bytes} bytes; this volunteer accepts 1 to {config.max_state_bytes} "
            "(raise max_state_bytes if the run's model is really that large)"
        )
    if not 64 * KiB <= manifest.range_bytes <= 64 * MiB:
        raise ProtocolError(f"manifest range size {manifest.range_bytes} is outside 64 KiB..64 MiB")
    count = -(-manifest.total_bytes // manifest.range_bytes)
    if len(manifest.range_sha256) != count:
        raise ProtocolError(f"manifest lists {len(manifest.range_sha256)} range hashes for {count} ranges")
    if not all(HEX64.fullmatch(h) for h in manifest.range_sha256):
        raise ProtocolError("manifest range hashes must be 64 lowercase hex digits each")


async def fetch_state(
    *,
    donors: list[Donor],
    version: StateVersion,
    run_id: str,
    key: SigningKey,
    credential: Credential,
    config: StateConfig,
    emit: Emit = no_emit,
    into: Path | None = None,
) -> bytes | Path:
    """Download and verify the state ``version`` from ``donors``: its bytes, or the file ``into`` holding
    them; raise :class:`StateSyncError` if no donor can deliver it."""
    if not HEX64.fullmatch(version.content_hash):
        raise StateSyncError(f"state content hash {version.content_hash[:80]!r} is not 64 hex digits")
    states = {i: _DonorState(d) for i, d in enumerate(_unique(donors))}
    if not states:
        raise StateSyncError(
            f"no donor serves state step {version.step}; wait for a peer to publish it or ask the publisher "
            "to serve state",
            (),
        )
    fetcher = _Fetcher(states, version, run_id, key, credential, config, emit, into)
    async with PeerClient() as client:
        fetcher.client = client
        return await fetcher.run()


def _unique(donors: list[Donor]) -> list[Donor]:
    seen: set[str] = set()
    out = []
    for d in donors:
        if d.address not in seen:
            seen.add(d.address)
            out.append(d)
    return out


class _Fetcher:
    def __init__(
        self,
        states: dict[int, _DonorState],
        version: StateVersion,
        run_id: str,
        key: SigningKey,
        credential: Credential,
        config: StateConfig,
        emit: Emit,
        into: Path | None = None,
    ) -> None:
        self.into = into
        self.states = states
        self.version = version
        self.run_id = run_id
        self.key = key
        self.credential = credential
        self.config = config
        self.emit = emit
        self.client: PeerClient
        self.job: _Job
        self._t0 = time.monotonic()
        self._last_progress = 0.0

    # ------------------------------------------------------------ top level

    async def run(self) -> bytes | Path:
        candidates = await self._manifest_candidates()
        for k, (manifest, voters) in enumerate(candidates):
            later = {i for _, v in candidates[k + 1 :] for i in v}
            for i, s in self.states.items():
                s.sitting_out = i in later
            try:
                data = await self._download(manifest)
            except _ManifestFailed as exc:
                if k + 1 == len(candidates):
                    raise self._failure(str(exc)) from None
                # Other donors sent another manifest: theirs may be the true one. Those who sent this
                # one are banned when the whole hash proved it wrong; otherwise they may still serve
                # ranges, each checked against the next manifest.
                if exc.proven_wrong:
                    for i in voters:
                        self._drop(
                            i, "sent a manifest whose ranges do not add up to the content hash", ban=True
                        )
                continue
            # The content hash pins every byte, so a different manifest was a lie.
            for _, others in candidates[k + 1 :]:
                for i in others:
                    self._drop(i, "sent a manifest that the verified state contradicts", ban=True)
            return data
        raise AssertionError("unreachable: there is at least one manifest candidate")

    async def _download(self, manifest: StateManifest) -> bytes | Path:
        count = len(manifest.range_sha256)
        for s in self.states.values():
            s.ranges = s.bytes = s.failures = 0
        self.job = job = _Job(
            manifest=manifest,
            parts=[None] * count,
            done=[False] * count,
            pending=deque(range(count)),
            remaining=count,
        )
        self.emit(
            StateSyncStarted(
                step=manifest.step,
                content_hash=manifest.content_hash,
                total_bytes=manifest.total_bytes,
                donors=tuple(s.name for s in self.states.values() if s.active),
            )
        )
        whole = hashlib.sha256()
        sink = await asyncio.to_thread(open, self.into, "wb") if self.into is not None else None
        try:
            await self._gather(job, whole, sink)
        finally:
            if sink is not None:
                sink.close()
        if job.remaining:
            raise _ManifestFailed(f"no donor could deliver {job.remaining} of the state's {count} ranges")
        digest = whole.hexdigest()
        if digest != manifest.content_hash:
            raise _ManifestFailed(
                f"the assembled state hashes to {digest[:12]}…, not {manifest.content_hash[:12]}…: "
                "the manifest's range hashes were wrong",
                proven_wrong=True,
            )
        self._progress(force=True)
        used = tuple(s.name for s in self.states.values() if s.ranges)
        self.emit(
            StateLoaded(
                step=manifest.step,
                content_hash=manifest.content_hash,
                duration_s=time.monotonic() - self._t0,
                donors_used=used,
            )
        )
        if self.into is not None:
            return self.into
        return await asyncio.to_thread(
            b"".join, cast(list[bytes], job.parts)
        )  # every part is set: remaining == 0

    async def _gather(self, job: _Job, whole: hashlib._Hash, sink: BinaryIO | None) -> None:
        async with asyncio.TaskGroup() as tg:
            workers = [
                tg.create_task(self._worker(i))
                for i, s in self.states.items()
                if s.active
                for _ in range(self.config.ranges_per_donor)
            ]
            hasher = tg.create_task(self._hash_in_order(whole, sink))
            if not workers:
                job.finished.set()
            await job.finished.wait()
            for w in workers:
                w.cancel()
            if job.remaining:
                hasher.cancel()

    async def _hash_in_order(self, whole: hashlib._Hash, sink: BinaryIO | None) -> None:
        """Feed verified ranges to the whole-state hash in order while the rest still downloads; with a
        ``sink``, write each to it and let go of its bytes."""
        job = self.job
        hashed = 0
        count = len(job.parts)
        while hashed < count:
            ready: list[bytes] = []
            while hashed + len(ready) < count:
                part = job.parts[hashed + len(ready)]
                if part is None:
                    break
                ready.append(part)
            if ready:

                def take(ready: list[bytes] = ready) -> None:
                    for part in ready:
                        whole.update(part)
                        if sink is not None:
                            sink.write(part)

                await asyncio.to_thread(take)
                if sink is not None:
                    for k in range(hashed, hashed + len(ready)):
                        job.parts[k] = b""  # written: its bytes are no longer needed
                hashed += len(ready)
                continue
            await wait_at_most(job.changed, 1.0)

    def _failure(self, what: str) -> StateSyncError:
        tried = [
            f"{s.name} ({s.out or ('sent another manifest' if s.sitting_out else f'{s.ranges} ranges')})"
            for s in self.states.values()
        ]
        return StateSyncError(
            f"could not fetch state step {self.version.step} ({self.version.content_hash[:12]}…): {what}. "
            f"Donors tried: {'; '.join(tried)}. Check your network, or wait for more donors and join again.",
            tuple(s.name for s in self.states.values()),
        )

    # ------------------------------------------------------------ manifest

    async def _manifest_candidates(self) -> list[tuple[StateManifest, set[int]]]:
        """Ask every donor for the manifest. If a majority agrees, theirs is the only candidate and the
        others are banned; otherwise every distinct manifest is a candidate, most voted first."""
        loop = asyncio.get_running_loop()
        pending = {asyncio.ensure_future(self._get_manifest(i)) for i in self.states}
        voters: dict[bytes, set[int]] = {}
        manifests: dict[bytes, StateManifest] = {}
        deadline: float | None = None  # set by the first valid manifest: the others get a short grace
        try:
            while pending:
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                done, pending = await asyncio.wait(
                    pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    break  # the grace is over; silent donors may still serve ranges, checked one by one
                for task in done:
                    try:
                        i, manifest = task.result()
                    except _DonorOut:
                        continue
                    fingerprint = hashlib.sha256("\n".join(manifest.range_sha256).encode()).digest()
                    fingerprint += manifest.range_bytes.to_bytes(8, "little")
                    manifests.setdefault(fingerprint, manifest)
                    voters.setdefault(fingerprint, set()).add(i)
                    if deadline is None:
                        deadline = loop.time() + self.config.manifest_grace_s
                if any(len(v) * 2 > len(self.states) for v in voters.values()):
                    break
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if not voters:
            raise self._failure("no donor sent a valid manifest")
        ranked = sorted(voters, key=lambda fp: -len(voters[fp]))  # stable: ties keep arrival order
        if len(voters[ranked[0]]) * 2 > len(self.states):
            for fp in ranked[1:]:
                for i in voters[fp]:
                    self._drop(i, "sent a manifest that disagrees with the other donors'", ban=True)
            ranked = ranked[:1]
        return [(manifests[fp], voters[fp]) for fp in ranked]

    async def _get_manifest(self, index: int) -> tuple[int, StateManifest]:
        s = self.states[index]
        headers = sign_headers(self.key, self.credential, "state", self.version.content_hash, "manifest")
        timeout = aiohttp.ClientTimeout(
            total=self.config.manifest_timeout_s, sock_connect=self.config.connect_timeout_s
        )
        try:
            path = _path(self.version.content_hash, "/manifest")
            async with self.client.get(s.donor.address, path, headers=headers, timeouts=timeout) as resp:
                if resp.status != 200:
                    raise ProtocolError(f"manifest request answered {resp.status}: {await _error_text(resp)}")
                body = await _read_bounded(resp, _MAX_MANIFEST_BYTES)
            manifest = decode(body, StateManifest, _MANIFEST_LIMITS)
            check_manifest(manifest, self.version, self.run_id, self.config)
        except (PeerUnreachable, ValueError, ProtocolError) as exc:
            self._drop(index, f"manifest: {_describe(exc)}", ban=isinstance(exc, LimitExceeded))
            raise _DonorOut from None
        return index, manifest

    # ------------------------------------------------------------ ranges

    async def _worker(self, i: int) -> None:
        s = self.states[i]
        job = self.job
        while s.active and job.remaining:
            wait = s.busy_until - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            index = self._pick(i)
            if index is None:
                await wait_at_most(job.changed, 1.0)
                continue
            await self._attempt(i, index)

    def _pick(self, i: int) -> int | None:
        job = self.job
        while job.pending:
            index = job.pending.popleft()
            if not job.done[index]:
                return index
        # end-game: race the range that has been in flight longest, if this donor is not already on it
        candidates = [
            (job.started.get(r, 0.0), r)
            for r, tasks in job.attempts.items()
            if not job.done[r] and i not in tasks and len(tasks) < self.config.max_racers
        ]
        return min(candidates)[1] if candidates else None

    async def _attempt(self, i: int, index: int) -> None:
        s = self.states[i]
        job = self.job
        task = asyncio.ensure_future(self._get_range(s, index))
        attempts = job.attempts.setdefault(index, {})
        attempts[i] = task
        job.started.setdefault(index, time.monotonic())
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            attempts.pop(i, None)
            if not attempts:
                job.attempts.pop(index, None)
                job.started.pop(index, None)
        if task.cancelled() or job.done[index]:
            return  # another donor delivered this range first
        exc = task.exception()
        if exc is None:
            self._store(i, index, task.result())
            return
        if not attempts:
            job.pending.appendleft(index)
        job.notify()
        if isinstance(exc, _BadRange):
            self._drop(i, f"sent range {index} with a wrong sha256", ban=True)
        elif isinstance(exc, _Refused):
            self._drop(i, str(exc))
        elif isinstance(exc, _Busy):
            s.busy += 1
            s.busy_until = time.monotonic() + exc.retry_after
            if s.busy >= self.config.max_busy_answers:
                self._drop(i, f"answered 'busy' {s.busy} times")
        elif isinstance(exc, _Transient):
            s.failures += 1
            if s.failures >= self.config.max_donor_failures:
                self._drop(i, f"failed {s.failures} times in a row, last: {exc}")
        else:
            raise exc

    def _store(self, i: int, index: int, data: bytes) -> None:
        s = self.states[i]
        job = self.job
        start, end = job.span(index)
        job.parts[index] = data
        job.done[index] = True
        job.remaining -= 1
        job.done_bytes += end - start
        s.failures = 0
        s.ranges += 1
        s.bytes += end - start
        for other in list(job.attempts.get(index, {}).values()):
            other.cancel()
        if not job.remaining:
            job.finished.set()
        job.notify()
        self._progress()

    async def _get_range(self, s: _DonorState, index: int) -> bytes:
        job = self.job
        start, end = job.span(index)
        range_header = f"bytes={start}-{end - 1}"
        headers = sign_headers(self.key, self.credential, "state", self.version.content_hash, range_header)
        headers["Range"] = range_header
        headers["Accept-Encoding"] = "zstd" if self.config.accept_zstd else "identity"
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=cfg.range_timeout_s, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
        )
        want = end - start
        try:
            async with self.client.get(
                s.donor.address, _path(self.version.content_hash), headers=headers, timeouts=timeout
            ) as resp:
                if resp.status == 503:
                    raise _Busy(_retry_after(resp.headers.get("Retry-After"), cfg.max_retry_after_s))
                if resp.status in (401, 403, 404, 410, 416):
                    raise _Refused(f"answered {resp.status}: {await _error_text(resp)}")
                if resp.status != 206:
                    raise _Transient(f"answered {resp.status} to a range request")
                if resp.headers.get("Content-Range") != f"bytes {start}-{end - 1}/{job.manifest.total_bytes}":
                    raise _Transient(
                        f"sent Content-Range {resp.headers.get('Content-Range')!r} for {range_header}"
                    )
                encoding = resp.headers.get("Content-Encoding", "identity").lower()
                if encoding not in ("identity", "zstd") or (encoding == "zstd" and not cfg.accept_zstd):
                    raise _Transient(f"sent Content-Encoding {encoding!r}, which was not asked for")
                body = await _read_bounded(resp, want + (want >> 4) + 1024 if encoding == "zstd" else want)
        except (PeerUnreachable, ValueError, LimitExceeded) as exc:
            raise _Transient(_describe(exc)) from None  # a donor's defect never escapes as a crash
        expected = job.manifest.range_sha256[index]
        return await asyncio.to_thread(self._check, body, encoding, want, expected)

    def _check(self, body: bytes, encoding: str, want: int, expected: str) -> bytes:
        if encoding == "zstd":
            try:
                declared = zstandard.frame_content_size(body)
                if declared != want:  # checked before decompressing: the frame's size is allocated at once
                    raise _BadRange(f"zstd frame declares {declared} bytes, not the range's {want}")
                body = zstandard.ZstdDecompressor().decompress(body)
            except zstandard.ZstdError as exc:
                raise _BadRange(f"zstd frame does not decode ({exc})") from None
        if len(body) != want:
            raise _Transient(f"range body is {len(body)} bytes, not {want}")
        if hashlib.sha256(body).hexdigest() != expected:
            raise _BadRange("sha256 mismatch")
        return body

    # ------------------------------------------------------------ bookkeeping

    def _drop(self, i: int, reason: str, *, ban: bool = False) -> None:
        s = self.states[i]
        if s.out is not None:
            return
        s.out = ("banned: " if ban else "") + reason
        s.banned = ban
        if ban:
            self.emit(DonorBanned(donor=s.name, reason=reason))
        if hasattr(self, "job") and not any(v.active for v in self.states.values()):
            self.job.finished.set()
        if hasattr(self, "job"):
            self.job.notify()

    def _progress(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < self.config.progress_interval_s:
            return
        self._last_progress = now
        job = self.job
        elapsed = max(now - self._t0, 1e-6)
        rate = job.done_bytes / elapsed
        left = job.manifest.total_bytes - job.done_bytes
        self.emit(
            StateSyncProgress(
                done_bytes=job.done_bytes,
                total_bytes=job.manifest.total_bytes,
                rate=rate,
                donors_active=sum(1 for s in self.states.values() if s.active),
                eta_s=left / rate if rate > 0 else None,
            )
        )


class _ManifestFailed(Exception):
    """A download with one manifest failed; another donor's manifest may still work."""

    def __init__(self, message: str, *, proven_wrong: bool = False) -> None:
        self.proven_wrong = proven_wrong
        super().__init__(message)


class _DonorOut(Exception):
    """This donor gave no usable manifest (already recorded)."""


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    try:
        return await read_body(resp.content, limit, resp.content_length)
    except BodyTooLong as exc:
        raise LimitExceeded(f"response is {exc.size} bytes or more, more than the {limit} expected") from None


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    try:
        raw = await read_body(resp.content, _MAX_ERROR_BYTES, resp.content_length)
        body = decode(raw, ErrorBody)
        return body.error[:300]
    except (BodyTooLong, ProtocolError, *NETWORK_ERRORS):
        return resp.reason or "no reason given"


def _retry_after(value: str | None, cap: float) -> float:
    try:
        return min(max(float(value or 1), 0.1), cap)
    except ValueError:
        return min(1.0, cap)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) or (isinstance(exc, PeerUnreachable) and exc.timed_out):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text[:300]
