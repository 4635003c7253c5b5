"""Group all-reduce as a butterfly over HTTP: one round trip per pair of members.

The flat vector is cut into one contiguous part per member that owns a part (``part >= 0``, in part
order, as even as possible). Member *i* ``POST``s its copy of part *j* to the owner of *j* at
``/v1/allreduce/{round_id}/{tag}/{j}``; the owner waits for every member's copy (or the assignment's
deadline), takes the weighted mean in fp32 and answers every waiting request with the reduced part.
The owner's own copy never leaves the process. Client-mode members own nothing and only send.

Pipelined: a sender encodes its next sub-frame while the current one is on the wire; a receiver decodes
a sub-frame in a thread while the next one arrives (a stored codec-none body lands straight in its
destination); the owner computes each copy's norm as it arrives, decides clipping once every copy is in,
then reduces and encodes its part slice by slice and streams each answer sub-frame to every waiting
sender as soon as that slice is ready, instead of answering after the whole part is reduced.

Failures are local, never a hang: a copy that arrives after the deadline is dropped and the weights
renormalised; a copy that fails a check is refused with a 4xx sentence and listed as rejected; a sender
whose owner fails keeps its own values for that part and lists it in ``failed_parts``. A round returns by
the deadline plus ``grace_s``. A round fails as a whole (:class:`AveragingError`, after a ``RoundFailed``
event; one meaning for both) only when it cannot start. Once started it returns, with ``RoundDone``, even when
every part failed: the group then agrees on what each part holds (a part with no copy of positive weight
fails alike for all its members, e.g. when no member had samples), which a round failed as a whole (the
caller then fetches the state) would not keep.

Wire: the request carries the peer headers of :mod:`crowdtrain.protocol.peerauth` signed over
(``"allreduce"``, round key, part, weight, values), plus ``X-Crowdtrain-Weight`` (samples, ≤ the weight
in the assignment) and ``X-Crowdtrain-Elements`` (the part's length, or 0 from a weight-0 member when
some member has a weight: it only wants the result). Body and answer are streams of tensor frames of at
most ``subframe_elements`` values each: stored fp32 with a ``Content-Length`` when the part is dense and the
codec is none (sent straight from memory), else chunked (zstd, lossy codecs). Answers other than 200 are ``{"error": "<sentence>"}``:

====  =======================================================================================
400   malformed path, headers or frames (bad shape, codec, sizes, checksum, extra bytes)
401   missing or invalid credential or request signature
403   the sender is not a member of this round's signed group
404   no assignment for this round arrived here in time, or this peer does not own that part
408   the copy did not arrive completely by the deadline (the sender is listed as dropped)
409   the sender already sent its copy of this part in this round
410   the round or part is already closed
413   a frame is larger than the limits
422   NaN/inf values, a length other than the part's, or a weight above the assignment's
503   the part could not be reduced (no copy with a positive weight arrived in time)
====  =======================================================================================

Round key: ``f"{round_id}/{tag}"``, so one assignment carries a gradient round and a parameter round.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import re
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from aiohttp import web

from crowdtrain.protocol import peerauth
from crowdtrain.protocol.aio import BodyTooLong, read_body, wait_at_most
from crowdtrain.protocol.codecs import Residual
from crowdtrain.protocol.credentials import SigningKey, verify_assignment
from crowdtrain.protocol.errors import AuthError, AveragingError, LimitExceeded, ProtocolError
from crowdtrain.protocol.messages import Credential, GroupAssignment, GroupMember
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.reducer import Contribution, PartReducer, Term
from crowdtrain.volunteer.averaging.wire import (
    HEADER_ELEMENTS,
    HEADER_WEIGHT,
    PURPOSE,
    Coder,
    KeptPart,
    NonFinite,
    read_part,
    stored_frame,
    stored_length,
    subframe_bounds,
)
from crowdtrain.volunteer.events import Emit, RoundDone, RoundFailed, no_emit

log = logging.getLogger(__name__)

ROUTE = "/v1/allreduce/{round_id}/{tag}/{part}"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_NETWORK_ERRORS = (aiohttp.ClientError, asyncio.IncompleteReadError, ConnectionError, OSError, TimeoutError)


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What one all-reduce round gave this peer."""

    round_key: str
    values: np.ndarray  # the weighted mean (float32); local values in ``failed_parts``
    members: tuple[str, ...]
    my_part: int  # -1: client mode
    dropped: tuple[str, ...]  # members whose copy of my part did not arrive by the deadline
    rejected: tuple[str, ...]  # members whose copy of my part failed a check
    clipped: tuple[str, ...]  # members whose copy of my part was scaled down to the norm bound
    failed_parts: tuple[int, ...]  # parts whose owner failed or refused me; local values kept
    bytes_sent: int
    bytes_received: int
    raw_bytes: int  # what the values I sent would have taken as plain fp32
    duration: float
    phases: dict[str, float]
    reasons: dict[str, str] = field(default_factory=dict)  # "part 2" / peer id → why, for the log

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.bytes_sent if self.bytes_sent else 0.0


@dataclass(slots=True)
class _Stats:
    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0


@dataclass(slots=True)
class _Round:
    key: str
    assignment: GroupAssignment
    members: dict[str, GroupMember]
    bounds: list[tuple[int, int]]  # part index → [start, stop)
    my_part: int
    deadline: float
    uniform: bool  # every assigned weight is 0: the plain mean of everyone's values
    tag: str
    answer_stored: bool = False  # my part's answer goes stored, with a Content-Length (see Coder.stores)
    reducer: PartReducer | None = None
    output: np.ndarray | None = None  # where the round's result is written
    in_place: bool = False  # ``output`` is this peer's vector itself
    stats: _Stats = field(default_factory=_Stats)


class _Refused(Exception):
    def __init__(self, status: int, text: str) -> None:
        self.status = status
        self.text = text
        super().__init__(text)


def part_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous slices of ``n`` values, one per part, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class Averager:
    """This peer's side of group all-reduce: the part owner's HTTP routes and the sender."""

    def __init__(
        self,
        *,
        run_id: str,
        tracker_public_key: str,
        peer_id: str,
        key: SigningKey,
        credential: Credential,
        config: AveragingConfig | None = None,
        emit: Emit = no_emit,
    ) -> None:
        self.run_id = run_id
        self.tracker_public_key = tracker_public_key
        self.peer_id = peer_id
        self.key = key
        self.credential = credential
        self.config = config or AveragingConfig()
        self.emit = emit
        self._coder = Coder(self.config)
        self._rounds: dict[str, _Round] = {}
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._registered: asyncio.Condition | None = None
        # error feedback of lossy codecs, per tag: what I send (over the whole vector) and what I answer
        # with (over the part I own, with its bounds: a part that moves starts afresh)
        self._residuals: dict[str, Residual] = {}
        self._down_residuals: dict[str, tuple[tuple[int, int], Residual]] = {}
        self._session: aiohttp.ClientSession | None = None
        # buffers that received the copies of my part in earlier rounds, reused next round: a fresh one
        # costs page faults and zeroing (~15 % of a round's CPU for 10M values in a group of 4). A buffer
        # serves any part as long or shorter, so a group that grows (shorter parts) allocates nothing.
        self._spare: list[np.ndarray] = []

    # ------------------------------------------------------------------ public

    def routes(self) -> list[web.RouteDef]:
        return [web.post(ROUTE, self._handle)]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def allreduce(
        self,
        assignment: GroupAssignment,
        vector: np.ndarray,
        weight: float,
        *,
        tag: str = "grad",
        out: np.ndarray | None = None,
    ) -> RoundResult:
        """Average ``vector`` (flat float32, same length on every member) with the assignment's group.

        The result is written to ``out`` when given (flat float32 of ``vector``'s length; a caller that
        averages every step can hand the same buffer back each time), else to a new array. ``out`` may be
        ``vector`` itself (the round then costs no buffer of the vector's size): each part of it is
        overwritten only once this peer's copy of that part was sent, and its own part is reduced a slice at
        a time through a small buffer. A part that fails then keeps what it holds, which may be partly the
        owner's answer: a caller averaging in place zeroes failed parts (as the engine does).

        Raises :class:`AveragingError` (and emits ``RoundFailed``) when the round cannot start; once started
        it returns (and emits ``RoundDone``), listing the parts that failed.
        """
        started = time.perf_counter()
        try:
            rnd = self._prepare(assignment, vector, weight, tag, out)
        except AveragingError as exc:
            self.emit(RoundFailed(round_id=assignment.round_id, step=assignment.step, reason=str(exc)))
            raise
        output = rnd.output
        assert output is not None
        failed: dict[int, str] = {}
        self._rounds[rnd.key] = rnd
        await self._announce()
        try:
            async with asyncio.TaskGroup() as tg:
                if rnd.reducer is not None:
                    tg.create_task(self._close_part(rnd))
                    tg.create_task(self._own_part(rnd, output, failed))
                for member in assignment.members:
                    if member.part >= 0 and member.part != rnd.my_part:
                        tg.create_task(self._exchange(rnd, member, vector, weight, tag, output, failed))
            if rnd.reducer is not None:  # every read into them is over and the part is reduced
                self._give_back(rnd.reducer)
        finally:
            if rnd.reducer is not None:  # cancelled: answer waiting senders now; streaming ones stop waiting
                rnd.reducer.abandon(f"round {rnd.key} was abandoned")
            del self._rounds[rnd.key]
            self._finished[rnd.key] = None
            while len(self._finished) > self.config.remember_rounds:
                self._finished.popitem(last=False)
        return self._finish(rnd, output, failed, time.perf_counter() - started, tag)

    # ------------------------------------------------------------------ round set-up

    def _prepare(
        self, a: GroupAssignment, vector: np.ndarray, weight: float, tag: str, out: np.ndarray | None = None
    ) -> _Round:
        try:
            verify_assignment(a, self.tracker_public_key)
        except AuthError as exc:
            raise AveragingError(
                f"group assignment for round {a.round_id!r} is not the tracker's: {exc}"
            ) from None
        if a.run_id != self.run_id:
            raise AveragingError(f"group assignment is for run {a.run_id!r}, not {self.run_id!r}")
        if not _NAME.match(a.round_id) or not _NAME.match(tag):
            raise AveragingError(
                f"round id {a.round_id!r} and tag {tag!r} must be 1–200 letters, digits, '.', '_' or '-'"
            )
        key = f"{a.round_id}/{tag}"
        if key in self._rounds or key in self._finished:
            raise AveragingError(f"round {key} was already run by this peer; use a new tag or round")
        if not 1 <= len(a.members) <= self.config.max_members:
            raise AveragingError(
                f"group has {len(a.members)} members; 1 to {self.config.max_members} allowed"
            )
        members = {m.peer_id: m for m in a.members}
        if len(members) != len(a.members):
            raise AveragingError(f"group assignment for round {key} lists a peer twice")
        me = members.get(self.peer_id)
        if me is None or me.public_key != self.key.public_hex:
            raise AveragingError(f"this peer ({self.peer_id}) is not a member of round {key}")
        owners = sorted(m.part for m in a.members if m.part >= 0)
        if owners != list(range(a.parts)) or a.parts < 1:
            raise AveragingError(
                f"group assignment for round {key} does not give parts 0..{a.parts - 1} one owner each"
            )
        if any(m.part >= 0 and not m.address for m in a.members):
            raise AveragingError(
                f"group assignment for round {key} gives a part to a member without an address"
            )
        if vector.dtype != np.float32 or vector.ndim != 1:
            raise AveragingError(f"vector must be flat float32, got {vector.dtype} with shape {vector.shape}")
        if vector.size > self.config.max_vector_elements:
            raise AveragingError(f"vector has {vector.size} values, above max_vector_elements")
        if out is not None and (
            out.dtype != np.float32
            or out.shape != vector.shape
            or (out is not vector and np.shares_memory(out, vector))
        ):
            raise AveragingError(
                f"out must be flat float32 of {vector.size} values, the vector itself or apart from it, got "
                f"{out.dtype} with shape {out.shape}"
            )
        if not (math.isfinite(weight) and 0 <= weight <= me.weight):
            raise AveragingError(f"weight {weight} must be between 0 and the assigned {me.weight} samples")
        if time.time() >= a.deadline:
            raise AveragingError(
                f"round {key} reached its deadline before it started; wait for the next group"
            )
        bounds = part_bounds(vector.size, a.parts)
        if self.config.codec.lossy:
            up = self._residuals.get(tag)
            if up is None or up.size != vector.size:
                self._residuals[tag] = Residual.zeros(vector.size)
            down = self._down_residuals.get(tag)
            if me.part >= 0 and (down is None or down[0] != bounds[me.part]):
                start, stop = bounds[me.part]
                self._down_residuals[tag] = ((start, stop), Residual.zeros(stop - start))
        uniform = all(m.weight == 0 for m in a.members)
        rnd = _Round(key, a, members, bounds, me.part, a.deadline, uniform, tag, None)
        # every value of the output is written: the reduced part, a decoded answer, or my own for a failed part
        rnd.output = np.empty_like(vector) if out is None else out
        rnd.in_place = rnd.output is vector
        if me.part >= 0 and bounds[me.part][1] > bounds[me.part][0]:  # an empty part needs no owner
            start, stop = bounds[me.part]
            rnd.reducer = PartReducer(
                me.part, stop - start, tuple(members), self.config.clip_multiple, done=asyncio.Event()
            )
            own = vector[start:stop]
            # the mean of dense copies is dense: judge the answer by my own copy, before anything is reduced
            rnd.answer_stored = self._coder.stores(own)
            rnd.reducer.begin(self.peer_id)
            rnd.reducer.accept(
                Contribution(
                    self.peer_id,
                    1.0 if uniform else float(weight),
                    own,
                    float(np.linalg.norm(own)),
                )
            )
        return rnd

    def _take_buffer(self, nbytes: int) -> np.ndarray:
        """A byte buffer of ``nbytes``: the shortest spare that holds them, or a new one."""
        fitting = [i for i, b in enumerate(self._spare) if b.size >= nbytes > 0]
        if fitting:
            best = min(fitting, key=lambda i: self._spare[i].size)
            return self._spare.pop(best)
        return np.empty(nbytes, dtype=np.uint8)

    def _give_back(self, red: PartReducer) -> None:
        """Keep the buffers of the copies read completely for the next round (a buffer a request may still
        be writing into is never kept: only accepted copies, whose reads are over, come back). The largest
        are kept, as many as this round's other members: a group that shrank (longer parts) leaves its
        shorter buffers to be freed rather than held beside the new ones."""
        self._spare.extend(c.storage for c in red.contributions.values() if c.storage is not None)
        self._spare.sort(key=lambda b: b.size, reverse=True)
        del self._spare[max(0, len(red.members) - 1) :]

    async def _announce(self) -> None:
        if self._registered is None:
            self._registered = asyncio.Condition()
        async with self._registered:
            self._registered.notify_all()

    # ------------------------------------------------------------------ owner side

    async def _close_part(self, rnd: _Round) -> None:
        """Close my part when every member settled or at the deadline, then reduce and encode it slice by
        slice; each sub-frame of the answer is published as soon as it is ready, and the senders' handlers
        stream it while the next slice is reduced."""
        red = rnd.reducer
        assert red is not None
        await wait_at_most(red.settled, rnd.deadline - time.time())
        t = time.perf_counter()
        start, stop = rnd.bounds[rnd.my_part]
        assert rnd.output is not None
        out = rnd.output[start:stop]
        terms = red.close(out)
        try:
            for a, b in subframe_bounds(0, stop - start, self.config.subframe_elements) if terms else ():
                red.add_frame(await asyncio.to_thread(self._reduce_encode, rnd, terms, out, a, b))
        finally:
            red.finish(reduce_s=time.perf_counter() - t)

    def _reduce_encode(
        self, rnd: _Round, terms: list[Term], out: np.ndarray, a: int, b: int
    ) -> tuple[bytes, bytes | memoryview]:
        """Reduce values ``[a, b)`` of my part into ``out`` and encode them as one frame (call in a thread).

        With a lossy codec the owner keeps its own error-feedback residual for the part it answers with,
        and ``out`` becomes exactly what the receivers decode, so the whole group holds the same numbers.
        """
        if rnd.in_place:  # my own copy is a term, read until the slice is reduced
            reduced = np.empty(b - a, dtype=np.float32)
            PartReducer.reduce_slice(terms, a, b, reduced)
            out[a:b] = reduced
        else:
            PartReducer.reduce_slice(terms, a, b, out[a:b])
        kept = self._down_residuals.get(rnd.tag)
        res = kept[1][a:b] if kept is not None and kept[0] == rnd.bounds[rnd.my_part] else None
        header, body, sent = self._coder.encode_sent(out[a:b], res, stored=rnd.answer_stored)
        if self.config.codec.lossy:
            out[a:b] = sent
        return header, body

    async def _own_part(self, rnd: _Round, output: np.ndarray, failed: dict[int, str]) -> None:
        red = rnd.reducer
        assert red is not None
        await red.done.wait()
        assert red.outcome is not None
        start, stop = rnd.bounds[rnd.my_part]
        if red.outcome.values is None:
            failed[rnd.my_part] = red.outcome.reason
            output[start:stop] = red.contributions[self.peer_id].values  # my own values
            return
        await red.complete.wait()
        answered = len(red.outcome.accepted) - 1  # every accepted sender but me gets the frames
        rnd.stats.bytes_sent += answered * sum(len(h) + len(b) for h, b in red.outcome.frames)
        rnd.stats.raw_bytes += answered * 4 * (stop - start)

    async def _find_round(self, key: str) -> _Round | None:
        """The round ``key``; a request that beat our own allreduce() call waits a bounded time for it."""
        if self._registered is None:
            self._registered = asyncio.Condition()
        try:
            async with asyncio.timeout(self.config.assignment_wait_s), self._registered:
                await self._registered.wait_for(lambda: key in self._rounds or key in self._finished)
        except TimeoutError:
            return None
        return self._rounds.get(key)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._receive(request)
        except _Refused as r:
            return web.json_response({"error": r.text}, status=r.status)

    async def _receive(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        round_id, tag, part_s = info["round_id"], info["tag"], info["part"]
        if not _NAME.match(round_id) or not _NAME.match(tag) or not part_s.isdigit() or len(part_s) > 6:
            raise _Refused(400, "the path must be /v1/allreduce/<round id>/<tag>/<part number>")
        key, part = f"{round_id}/{tag}", int(part_s)
        weight_s = request.headers.get(HEADER_WEIGHT, "")[:64]
        elements_s = request.headers.get(HEADER_ELEMENTS, "")[:64]
        try:  # authenticate first: strangers learn nothing about the round
            cred = peerauth.check_headers(
                request.headers,
                self.tracker_public_key,
                self.run_id,
                PURPOSE,
                key,
                part,
                weight_s,
                elements_s,
            )
        except AuthError as exc:
            raise _Refused(401, f"{exc}") from None
        try:
            declared = float(weight_s)
        except ValueError:
            declared = math.nan
        if not (math.isfinite(declared) and declared >= 0):
            raise _Refused(400, f"header {HEADER_WEIGHT} must be a finite number of samples ≥ 0")
        if not elements_s.isdigit() or len(elements_s) > 12:
            raise _Refused(400, f"header {HEADER_ELEMENTS} must be the number of values sent")
        elements = int(elements_s)
        if key in self._finished:
            raise _Refused(410, f"round {key} is over on this peer; the contribution came too late")
        rnd = await self._find_round(key)
        if rnd is None:
            if key in self._finished:
                raise _Refused(410, f"round {key} is over on this peer; the contribution came too late")
            raise _Refused(404, f"this peer has no assignment for round {key}; is the round id right?")
        member = rnd.members.get(cred.peer_id)
        if member is None or member.public_key != cred.public_key:
            raise _Refused(403, f"peer {cred.peer_id} is not a member of round {key}")
        red = rnd.reducer
        if red is None or part != rnd.my_part:
            raise _Refused(404, f"this peer owns part {rnd.my_part} of round {key}, not part {part}")
        begun = red.begin(cred.peer_id)
        if begun == "closed":
            raise _Refused(
                410, f"part {part} of round {key} closed at its deadline; the contribution came too late"
            )
        if begun == "duplicate":
            raise _Refused(409, f"peer {cred.peer_id} already sent its copy of part {part} in round {key}")
        try:
            contribution = await self._read_contribution(request, rnd, member, declared, elements)
        except _Refused as r:
            if r.status != 408:
                red.reject(cred.peer_id, r.text)
                log.warning("round %s: refused %s's copy of part %d: %s", key, cred.peer_id, part, r.text)
            raise
        if not red.accept(contribution):
            raise _Refused(
                410, f"part {part} of round {key} closed at its deadline; the contribution came too late"
            )
        try:
            async with asyncio.timeout(max(0.0, rnd.deadline + self.config.grace_s - time.time())):
                await red.done.wait()
        except TimeoutError:
            raise _Refused(503, f"part {part} of round {key} was not reduced in time") from None
        outcome = red.outcome
        assert outcome is not None
        if outcome.values is None:
            raise _Refused(503, outcome.reason)
        response = web.StreamResponse(headers={HEADER_ELEMENTS: str(red.length)})
        response.content_type = "application/octet-stream"
        if rnd.answer_stored:  # a known length: no chunked encoding, frames go out without being joined
            response.content_length = stored_length(red.length, self.config.subframe_elements)
        await response.prepare(request)
        sent = 0
        try:
            async with asyncio.timeout(max(0.0, rnd.deadline + self.config.grace_s - time.time())):
                while True:  # each sub-frame as soon as its slice is reduced
                    while sent >= len(outcome.frames) and not red.complete.is_set():
                        await red.more.wait()
                    if sent >= len(outcome.frames):
                        break
                    header, body = outcome.frames[sent]
                    await response.write(header)
                    await response.write(body)
                    sent += 1
        except TimeoutError:  # the answer stays incomplete: the sender keeps its own values for this part
            log.warning("round %s: the answer for part %d did not finish in time", key, part)
        await response.write_eof()
        return response

    async def _read_contribution(
        self, request: web.Request, rnd: _Round, member: GroupMember, declared: float, elements: int
    ) -> Contribution:
        red = rnd.reducer
        assert red is not None
        peer = member.peer_id
        if declared > member.weight:
            raise _Refused(
                422,
                f"peer {peer} declares weight {declared:g}, above the {member.weight} samples it reported",
            )
        expected = 0 if (declared == 0 and not rnd.uniform) else red.length
        if elements != expected:
            raise _Refused(422, f"peer {peer} sends {elements} values but part {red.part} holds {expected}")
        codec, step = self.config.codec, self.config.subframe_elements
        storage = None
        into: KeptPart | np.ndarray | None = None
        if expected and codec.lossy:  # kept as the codec's payload: 1 or 2 bytes a value instead of 4
            storage = self._take_buffer(KeptPart.nbytes(codec, expected, step))
            into = KeptPart(codec, expected, step, storage)
        elif expected:
            storage = self._take_buffer(4 * expected)
            into = storage[: 4 * expected].view(np.float32)
        t = time.perf_counter()
        try:
            async with asyncio.timeout(rnd.deadline - time.time()):
                dest = into if isinstance(into, KeptPart) else lambda a, b: into[a:b]
                norm2, nbytes = await read_part(request.content, self._coder, expected, dest)
        except TimeoutError:
            raise _Refused(
                408, f"peer {peer}'s copy of part {red.part} did not arrive by the deadline"
            ) from None
        except NonFinite as exc:
            raise _Refused(422, f"peer {peer}: {exc}") from None
        except LimitExceeded as exc:
            raise _Refused(413, f"peer {peer}: {exc}") from None
        except ProtocolError as exc:
            raise _Refused(400, f"peer {peer}: {exc}") from None
        except (asyncio.IncompleteReadError, ConnectionError, aiohttp.ClientPayloadError):
            raise _Refused(408, f"peer {peer} went away while sending part {red.part}") from None
        rnd.stats.decode_s += time.perf_counter() - t
        rnd.stats.bytes_received += nbytes
        weight = 1.0 if rnd.uniform else declared
        return Contribution(peer, weight, into, math.sqrt(norm2), storage=storage)

    # ------------------------------------------------------------------ sender side

    def _session_for(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False), auto_decompress=False
            )
        return self._session

    async def _exchange(
        self,
        rnd: _Round,
        owner: GroupMember,
        vector: np.ndarray,
        weight: float,
        tag: str,
        output: np.ndarray,
        failed: dict[int, str],
    ) -> None:
        """Send my copy of ``owner``'s part and take the reduced part from its answer."""
        j = owner.part
        start, stop = rnd.bounds[j]
        if stop == start:
            return
        cfg = self.config
        send = rnd.uniform or weight > 0
        elements = stop - start if send else 0
        weight_s, elements_s = repr(float(weight)), str(elements)
        headers = peerauth.sign_headers(self.key, self.credential, PURPOSE, rnd.key, j, weight_s, elements_s)
        headers |= {
            HEADER_WEIGHT: weight_s,
            HEADER_ELEMENTS: elements_s,
            "Content-Type": "application/octet-stream",
        }
        residual = self._residuals.get(tag) if cfg.codec.lossy else None
        stats = rnd.stats
        bounds = subframe_bounds(start, stop, cfg.subframe_elements)

        def encode(a: int, b: int) -> asyncio.Future[tuple[bytes, bytes | memoryview]]:
            res = None if residual is None else residual[a:b]
            return asyncio.ensure_future(asyncio.to_thread(self._coder.encode, vector[a:b], res))

        async def coded():
            """The part as sub-frames; the next one is encoded in a thread while this one is sent."""
            t = time.perf_counter()
            ahead = encode(*bounds[0])
            try:
                for k, (a, b) in enumerate(bounds):
                    header, frame = await ahead
                    ahead = encode(*bounds[k + 1]) if k + 1 < len(bounds) else None
                    stats.encode_s += time.perf_counter() - t
                    stats.bytes_sent += len(header) + len(frame)
                    stats.raw_bytes += 4 * (b - a)
                    yield header
                    yield frame
                    t = time.perf_counter()
            finally:
                if ahead is not None and not ahead.done():
                    ahead.cancel()

        async def stored():
            """The part as stored sub-frames straight from ``vector``'s memory (only a checksum to compute:
            ~0.2 ms per sub-frame, on the loop)."""
            for a, b in bounds:
                t = time.perf_counter()
                header, frame = stored_frame(vector[a:b])
                stats.encode_s += time.perf_counter() - t
                stats.bytes_sent += len(header) + frame.nbytes
                stats.raw_bytes += 4 * (b - a)
                yield header
                yield frame

        data: object = b""
        if send and self._coder.stores(vector[start:stop]):
            # a known length: aiohttp writes each frame as it is instead of joining it into a chunk
            headers["Content-Length"] = str(stored_length(stop - start, cfg.subframe_elements))
            data = stored()
        elif send:
            data = coded()

        url = f"http://{owner.address}/v1/allreduce/{rnd.key}/{j}"
        remaining = rnd.deadline + cfg.grace_s - time.time()
        timeout = aiohttp.ClientTimeout(total=max(0.05, remaining), sock_connect=cfg.connect_timeout_s)
        try:
            async with self._session_for().post(url, data=data, headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    try:
                        raw = await read_body(resp.content, cfg.max_error_bytes, resp.content_length)
                        text = raw.decode("utf-8", "replace")
                    except BodyTooLong:
                        text = f"an answer of more than {cfg.max_error_bytes} bytes"
                    raise _Refused(resp.status, text)
                t = time.perf_counter()
                _, nbytes = await read_part(
                    resp.content, self._coder, stop - start, lambda a, b: output[start + a : start + b]
                )
                stats.decode_s += time.perf_counter() - t
                stats.bytes_received += nbytes
        except _Refused as r:
            self._part_failed(rnd, j, owner, f"HTTP {r.status}: {r.text}", vector, output, failed)
        except ProtocolError as exc:
            self._part_failed(rnd, j, owner, f"its answer was malformed: {exc}", vector, output, failed)
        except _NETWORK_ERRORS as exc:
            what = "did not answer by the deadline" if isinstance(exc, TimeoutError) else f"failed: {exc!r}"
            self._part_failed(rnd, j, owner, what, vector, output, failed)

    def _part_failed(
        self,
        rnd: _Round,
        j: int,
        owner: GroupMember,
        why: str,
        vector: np.ndarray,
        output: np.ndarray,
        failed: dict[int, str],
    ) -> None:
        start, stop = rnd.bounds[j]
        output[start:stop] = vector[start:stop]
        failed[j] = f"owner {owner.peer_id} of part {j} {why}"
        log.warning("round %s: keeping local values of part %d: %s", rnd.key, j, failed[j])

    # ------------------------------------------------------------------ result

    def _finish(
        self, rnd: _Round, output: np.ndarray, failed: dict[int, str], duration: float, tag: str
    ) -> RoundResult:
        outcome = rnd.reducer.outcome if rnd.reducer is not None else None
        reasons = {f"part {j}": why for j, why in failed.items()}
        if outcome is not None:
            reasons |= rnd.reducer.rejected if rnd.reducer else {}
        phases = {
            "encode": rnd.stats.encode_s,
            "decode": rnd.stats.decode_s,
            "reduce": outcome.reduce_s if outcome else 0.0,
            "total": duration,
        }
        result = RoundResult(
            round_key=rnd.key,
            values=output,
            members=tuple(rnd.members),
            my_part=rnd.my_part,
            dropped=outcome.dropped if outcome else (),
            rejected=outcome.rejected if outcome else (),
            clipped=outcome.clipped if outcome else (),
            failed_parts=tuple(sorted(failed)),
            bytes_sent=rnd.stats.bytes_sent,
            bytes_received=rnd.stats.bytes_received,
            raw_bytes=rnd.stats.raw_bytes,
            duration=duration,
            phases=phases,
            reasons=reasons,
        )
        self.emit(
            RoundDone(
                round_id=rnd.assignment.round_id,
                kind=tag,
                step=rnd.assignment.step,
                members=result.members,
                my_part=result.my_part,
                bytes_sent=result.bytes_sent,
                bytes_received=result.bytes_received,
                raw_bytes=result.raw_bytes,
                duration_s=duration,
                phases=dict(phases),
                dropped=result.dropped,
                rejected=result.rejected,
                clipped=result.clipped,
                failed_parts=result.failed_parts,
                duplicates=tuple(sorted(rnd.reducer.duplicates)) if rnd.reducer is not None else (),
            )
        )
        return result
