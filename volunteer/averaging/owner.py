"""The part owner's side of a round: receive the members' copies of my part, reduce it, answer them all.

The owner's route takes each member's ``POST`` of its copy: it authenticates the request before saying
anything about the round, checks the sender against the round's signed group, reads the copy whole (bounded,
sub-frame by sub-frame, its norm computed as it arrives) into a buffer kept from earlier rounds, and waits.
The part closes when every member's copy is in, refused or cut off (its sender's connection closed in the
middle of it), or at the deadline; it is then reduced and encoded
slice by slice in a thread, and every waiting request streams each answer sub-frame as soon as it is ready.
A copy that fails a check is refused with a 4xx sentence (the table in
:mod:`~crowdtrain.volunteer.averaging.allreduce`) and listed as rejected.

The owner also keeps the rounds this peer takes part in, so that a request that beats this peer's own
``allreduce()`` call waits a bounded time for its round, and one that comes after it learns it is too late.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time

import aiohttp
import numpy as np
from aiohttp import web

from crowdtrain.protocol import peerauth, receipts
from crowdtrain.protocol.aio import acknowledged, wait_at_most
from crowdtrain.protocol.codecs import Residual, transform
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import AuthError, LimitExceeded, ProtocolError
from crowdtrain.protocol.messages import Credential, GroupMember
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.exchange import NAME, Round
from crowdtrain.volunteer.averaging.reducer import Contribution, PartReducer, Term
from crowdtrain.volunteer.averaging.wire import (
    HEADER_ELEMENTS,
    HEADER_WEIGHT,
    PURPOSE,
    Coder,
    KeptPart,
    NonFinite,
    read_part,
    stored_length,
    subframe_bounds,
)

log = logging.getLogger(__name__)

ROUTE = "/v1/allreduce/{round_id}/{tag}/{part}"
# The upload rate a peer reports is taken from its answers (the bytes an owner sends grow with its part):
# from the first byte handed to the network to the last one acknowledged (the kernel takes megabytes into
# a send buffer at once), in rounds that answered at least UPLOAD_MIN_BYTES; UPLOAD_EMA of each new
# measure plus the rest of the one before.
UPLOAD_MIN_BYTES = 64 * 1024
# Once the members with a weight sent their copies, a part waits at most this long (or half the round so far)
# for the requests of members of weight 0, which only want the mean.
WEIGHT0_GRACE_S = 1.0
UPLOAD_EMA = 0.5


def _refuse_if_over(finished: collections.OrderedDict[str, bool], key: str, part: int) -> None:
    """Refuse a copy for a round that is over here: 410 (too late: the others averaged without it), or 503
    when my part of it was never reduced (I gave the round up, e.g. leaving): that part failed for every
    member alike, which a late copy's sender must know, or it would drop the step the others keep."""
    if key not in finished:
        return
    if not finished[key]:
        raise _Refused(503, f"part {part} of round {key} was not reduced (its owner gave the round up)")
    raise _Refused(410, f"round {key} is over on this peer; the contribution came too late")


class _Refused(Exception):
    """A copy this owner will not take: answered with ``status`` and the sentence ``text``."""

    def __init__(self, status: int, text: str) -> None:
        self.status = status
        self.text = text
        super().__init__(text)


def _parse(
    request: web.Request, tracker_public_key: str, run_id: str
) -> tuple[str, int, Credential, float, int]:
    """The request's round key, part, sender, declared weight and length, the sender authenticated
    first: strangers learn nothing about the round."""
    info = request.match_info
    round_id, tag, part_s = info["round_id"], info["tag"], info["part"]
    if not NAME.fullmatch(round_id) or not NAME.fullmatch(tag) or not part_s.isdigit() or len(part_s) > 6:
        raise _Refused(400, "the path must be /v1/allreduce/<round id>/<tag>/<part number>")
    key, part = f"{round_id}/{tag}", int(part_s)
    weight_s = request.headers.get(HEADER_WEIGHT, "")[:64]
    elements_s = request.headers.get(HEADER_ELEMENTS, "")[:64]
    try:
        cred = peerauth.check_headers(
            request.headers,
            tracker_public_key,
            run_id,
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
    return key, part, cred, declared, int(elements_s)


class Owner:
    """The rounds this peer takes part in, and the route that receives, reduces and answers its part of each.

    It keeps, per tag, the error-feedback residual of the answers it encodes with a lossy codec: over the
    part it owns, with its bounds (a part that moves starts afresh: an int8 residual is under half a
    quantisation step), or, for a codec that withholds most values for rounds (sparse), over the whole
    vector, so what it held back of a part reaches the group the next time it owns those values, whoever
    owned them in between; and the buffers that received the
    copies of its part in earlier rounds, reused next round: a fresh one costs page faults and zeroing (~15 %
    of a round's CPU for 10M values in a group of 4). A buffer serves any part as long or shorter, so a group
    that grows (shorter parts) allocates nothing.
    """

    def __init__(
        self,
        *,
        run_id: str,
        tracker_public_key: str,
        peer_id: str,
        config: AveragingConfig,
        coder: Coder,
        key: SigningKey,
    ) -> None:
        self.run_id = run_id
        self.key = key  # signs the receipt at the end of each answer (protocol/receipts.py)
        self.tracker_public_key = tracker_public_key
        self.peer_id = peer_id
        self.config = config
        self.upload_bps: float | None = None  # see UPLOAD_MIN_BYTES
        self._coder = coder
        self.rounds: dict[str, Round] = {}
        # finished round keys, and whether my part of each was reduced (False: it failed for every member)
        self.finished: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self._registered: asyncio.Condition | None = None
        # tag -> (the values it spans, their residual)
        self._down_residuals: dict[str, tuple[tuple[int, int], Residual]] = {}
        self._spare: list[np.ndarray] = []

    # ------------------------------------------------------------------ the rounds

    def known(self, key: str) -> bool:
        """This peer runs or already ran round ``key``."""
        return key in self.rounds or key in self.finished

    async def open(self, rnd: Round) -> None:
        """Take requests for ``rnd`` from now on, waking those that arrived before it."""
        self.rounds[rnd.key] = rnd
        if self._registered is None:
            self._registered = asyncio.Condition()
        async with self._registered:
            self._registered.notify_all()

    def retire(self, rnd: Round) -> None:
        """End ``rnd``: senders still waiting are answered now (streaming ones stop waiting), later ones are
        told it is over for as long as ``remember_rounds`` rounds are remembered."""
        red = rnd.reducer
        reduced = red is None or (red.outcome is not None and red.outcome.values is not None)
        if red is not None:
            red.abandon(f"round {rnd.key} was abandoned")
        del self.rounds[rnd.key]
        self.finished[rnd.key] = reduced
        while len(self.finished) > self.config.remember_rounds:
            self.finished.popitem(last=False)

    def prepare(self, rnd: Round, vector: np.ndarray, weight: float) -> None:
        """Set up my part of ``rnd``: its residual, its reducer, and my own copy already in it."""
        start, stop = rnd.bounds[rnd.my_part]
        codec = self.config.codec
        # Answers carry an error-feedback residual only in a first phase (a later phase's columns must answer the
        # same bytes) and only with int2 and sparse, which round or withhold too much without it: with a residual
        # an answer's rounding is no longer bounded by its own blocks, and its receipt's ‖a‖² = Σ g could not be
        # held to the codec's tolerance (protocol/receipts.py)
        if codec.lossy and not rnd.shared and receipts.tolerance(codec) is None:
            span = (0, vector.size) if codec.withholds else (start, stop)
            down = self._down_residuals.get(rnd.tag)
            if down is None or down[0] != span:
                self._down_residuals[rnd.tag] = (span, Residual.zeros(span[1] - span[0]))
        if stop == start:  # an empty part needs no owner
            return
        needed = frozenset(p for p, m in rnd.members.items() if m.weight > 0 or rnd.uniform)
        rnd.reducer = PartReducer(
            rnd.my_part,
            stop - start,
            tuple(rnd.members),
            receipts.clip_for_phase(self.config.clip_multiple, rnd.shared),
            owner=self.peer_id,
            done=asyncio.Event(),
            shared=needed if rnd.shared else None,
            needed=needed,
        )
        own = vector[start:stop]
        # the mean of dense copies is dense: judge the answer by my own copy, before anything is reduced
        rnd.answer_stored = self._coder.stores(own)
        rnd.reducer.begin(self.peer_id)
        rnd.reducer.accept(
            Contribution(self.peer_id, 1.0 if rnd.uniform else float(weight), own, float(np.linalg.norm(own)))
        )

    async def _find_round(self, key: str) -> Round | None:
        """The round ``key``; a request that beat our own allreduce() call waits a bounded time for it."""
        if self._registered is None:
            self._registered = asyncio.Condition()
        try:
            async with asyncio.timeout(self.config.assignment_wait_s), self._registered:
                await self._registered.wait_for(lambda: self.known(key))
        except TimeoutError:
            return None
        return self.rounds.get(key)

    # ------------------------------------------------------------------ my part

    async def close_part(self, rnd: Round) -> None:
        """Close my part when every member settled or at the deadline, then reduce and encode it slice by
        slice; each sub-frame of the answer is published as soon as it is ready, and the senders' handlers
        stream it while the next slice is reduced."""
        red = rnd.reducer
        assert red is not None
        began = time.monotonic()
        await wait_at_most(red.settled, rnd.deadline - time.time())
        if not red.everyone.is_set():
            # members of weight 0 (catching up) still to ask: a live one asked at once (it sends nothing), so
            # wait a grace for it, as long as half the round so far (at least WEIGHT0_GRACE_S), then close
            grace = max(WEIGHT0_GRACE_S, 0.5 * (time.monotonic() - began))
            await wait_at_most(red.everyone, min(grace, rnd.deadline - time.time()))
        t = time.perf_counter()
        start, stop = rnd.bounds[rnd.my_part]
        assert rnd.output is not None
        out = rnd.output[start:stop]
        digests = None
        if rnd.shared:  # (see Round.shared)
            if self.config.codec.lossy:
                await asyncio.to_thread(self._quantise_own, red)
            digests = await asyncio.to_thread(red.digests)
        terms = red.close(out, digests)
        try:
            for a, b in subframe_bounds(0, stop - start, self.config.frame_elements) if terms else ():
                red.add_frame(await asyncio.to_thread(self._reduce_encode, rnd, terms, out, a, b))
            if terms:
                receipt = red.receipt(list(rnd.members), rnd.shared)
                signed = await asyncio.to_thread(receipt.signed, self.key, self.run_id, rnd.key)
                red.witness.signed(signed.to_bytes())
        finally:
            red.finish(reduce_s=time.perf_counter() - t)

    def _quantise_own(self, red: PartReducer) -> None:
        """In a later phase, my own copy counts as the other members receive theirs (call in a thread)."""
        own = red.contributions.get(self.peer_id)
        if own is not None and isinstance(own.values, np.ndarray):
            codec, step = self.config.codec, self.config.frame_elements
            storage = self._take_buffer(KeptPart.nbytes(codec, red.length, step))
            own.values, own.norm = quantised(own.values, KeptPart(codec, red.length, step, storage))
            own.storage = storage

    def _reduce_encode(
        self, rnd: Round, terms: list[Term], out: np.ndarray, a: int, b: int
    ) -> tuple[bytes, bytes | memoryview]:
        """Reduce values ``[a, b)`` of my part into ``out`` and encode them as one frame (call in a thread).

        With a lossy codec the owner keeps its own error-feedback residual for the part it answers with,
        and ``out`` becomes exactly what the receivers decode, so the whole group holds the same numbers.
        """
        red = rnd.reducer
        assert red is not None
        # (in place, my own copy is a term: it is read until the slice is reduced and witnessed)
        reduced = np.empty(b - a, dtype=np.float32) if rnd.in_place else out[a:b]
        PartReducer.reduce_slice(terms, a, b, reduced)
        kept, (start, stop) = self._down_residuals.get(rnd.tag), rnd.bounds[rnd.my_part]
        res = None
        # (a later phase has no residual: every column's owner must answer the same bytes; else it spans my part)
        if not rnd.shared and kept is not None and kept[0][0] <= start and stop <= kept[0][1]:
            at = start - kept[0][0]
            res = kept[1][at + a : at + b]
        header, body, sent = self._coder.encode_sent(reduced, res, stored=rnd.answer_stored)
        red.witness.add(terms, a, b, sent)
        if rnd.in_place or self.config.codec.lossy:
            out[a:b] = sent
        return header, body

    async def own_part(self, rnd: Round, output: np.ndarray, failed: dict[int, str]) -> None:
        """Wait for my part's outcome: my own values stay when it failed; the answers are counted as sent."""
        red = rnd.reducer
        assert red is not None
        await red.done.wait()
        assert red.outcome is not None
        start, stop = rnd.bounds[rnd.my_part]
        if red.outcome.values is None:
            failed[rnd.my_part] = red.outcome.reason
            own = red.contributions[self.peer_id].values  # my own values
            if isinstance(own, KeptPart):  # (quantised in a later phase)
                for a, b in subframe_bounds(0, own.length, own.step):
                    output[start + a : start + b] = own.values(a, b)
            elif own is not None:
                output[start:stop] = own
            return
        await red.complete.wait()
        answered = len(red.outcome.accepted) - 1  # every accepted sender but me gets the frames
        rnd.stats.sent(
            answered * sum(len(h) + len(b) for h, b in red.outcome.frames), answered * 4 * (stop - start)
        )

    def _take_buffer(self, nbytes: int) -> np.ndarray:
        """A byte buffer of ``nbytes``: the shortest spare that holds them, or a new one."""
        fitting = [i for i, b in enumerate(self._spare) if b.size >= nbytes > 0]
        if fitting:
            best = min(fitting, key=lambda i: self._spare[i].size)
            return self._spare.pop(best)
        return np.empty(nbytes, dtype=np.uint8)

    def give_back(self, red: PartReducer) -> None:
        """Keep the buffers of the copies read completely for the next round (a buffer a request may still
        be writing into is never kept: only accepted copies, whose reads are over, come back). The largest
        are kept, as many as this round's other members: a group that shrank (longer parts) leaves its
        shorter buffers to be freed rather than held beside the new ones."""
        self._spare.extend(c.storage for c in red.contributions.values() if c.storage is not None)
        self._spare.sort(key=lambda b: b.size, reverse=True)
        del self._spare[max(0, len(red.members) - 1) :]

    # ------------------------------------------------------------------ the route

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._receive(request)
        except _Refused as r:
            return web.json_response({"error": r.text}, status=r.status)

    async def _receive(self, request: web.Request) -> web.StreamResponse:
        key, part, cred, declared, elements = _parse(request, self.tracker_public_key, self.run_id)
        _refuse_if_over(self.finished, key, part)
        rnd = await self._find_round(key)
        if rnd is None:
            _refuse_if_over(self.finished, key, part)
            raise _Refused(404, f"this peer has no assignment for round {key}; is the round id right?")
        member = rnd.members.get(cred.peer_id)
        if member is None or member.public_key != cred.public_key:
            raise _Refused(403, f"peer {cred.peer_id} is not a member of round {key}")
        red = rnd.reducer
        if red is None or part != rnd.my_part:
            raise _Refused(404, f"this peer owns part {rnd.my_part} of round {key}, not part {part}")
        await self._collect(request, rnd, red, member, declared, elements)
        return await self._answer(request, rnd, red)

    async def _collect(
        self,
        request: web.Request,
        rnd: Round,
        red: PartReducer,
        member: GroupMember,
        declared: float,
        elements: int,
    ) -> None:
        """Read ``member``'s copy of my part into the reducer, or refuse it (and reject it, but for a copy
        that only came too late)."""
        key, part, peer = rnd.key, red.part, member.peer_id
        begun = red.begin(peer)
        if begun == "closed" and member.weight == 0 and elements == 0 and not rnd.uniform:
            return  # (it only wants the mean, which it may have as long as the round lasts)
        if begun == "closed":
            raise _Refused(
                410, f"part {part} of round {key} closed at its deadline; the contribution came too late"
            )
        if begun == "duplicate":
            raise _Refused(409, f"peer {peer} already sent its copy of part {part} in round {key}")
        try:
            contribution = await self._read_contribution(request, rnd, member, declared, elements)
        except _Refused as r:
            if r.status != 408:
                red.reject(peer, r.text)
                log.warning("round %s: refused %s's copy of part %d: %s", key, peer, part, r.text)
            raise
        rnd.moved()
        if not red.accept(contribution):
            raise _Refused(
                410, f"part {part} of round {key} closed at its deadline; the contribution came too late"
            )

    async def _answer(self, request: web.Request, rnd: Round, red: PartReducer) -> web.StreamResponse:
        """Stream my reduced part to a sender whose copy is in, each sub-frame as soon as its slice is
        reduced; an answer unfinished by the deadline plus ``grace_s`` is cut short (the sender then keeps
        its own values for this part)."""
        key, part = rnd.key, red.part
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
            response.content_length = stored_length(red.length, self.config.frame_elements) + receipts.size(
                len(rnd.members)
            )
        sent = 0
        try:
            await response.prepare(request)
            try:
                async with asyncio.timeout(max(0.0, rnd.deadline + self.config.grace_s - time.time())):
                    while True:  # each sub-frame as soon as its slice is reduced
                        while sent >= len(outcome.frames) and not red.complete.is_set():
                            await red.more.wait()
                        if sent >= len(outcome.frames):
                            break
                        header, body = outcome.frames[sent]
                        rnd.stats.mark()
                        await response.write(header)
                        await response.write(body)
                        rnd.stats.answered(len(header) + len(body))
                        sent += 1
                    if red.witness.receipt_bytes is not None:  # (every frame is out: their receipt ends it)
                        await response.write(red.witness.receipt_bytes)
            except TimeoutError:  # the answer stays incomplete: the sender keeps its own values for this part
                log.warning("round %s: the answer for part %d did not finish in time", key, part)
            await response.write_eof()
        # the sender hung up: it gave up on this answer (it voted this owner out)
        except ConnectionResetError:
            log.info("round %s: a sender of part %d hung up before its answer was sent", key, part)
            return response
        if sent == len(outcome.frames):
            await self._measure_upload(rnd, request.transport, len(outcome.accepted) - 1)
        return response

    async def _measure_upload(
        self, rnd: Round, transport: asyncio.BaseTransport | None, answers: int
    ) -> None:
        """Once every answer of the round is acknowledged by its sender, take the rate they went out at:
        the upload rate this peer reports (the tracker sizes the parts it owns by it)."""
        remaining = rnd.deadline + self.config.grace_s - time.time()
        if not await acknowledged(transport, remaining):
            return
        stats = rnd.stats
        stats.mark()
        stats.answers_acked += 1
        if stats.answers_acked == answers and stats.answered_bytes >= UPLOAD_MIN_BYTES and stats.upload_s > 0:
            measured = stats.answered_bytes / stats.upload_s
            last = self.upload_bps
            self.upload_bps = measured if last is None else UPLOAD_EMA * measured + (1 - UPLOAD_EMA) * last

    async def _read_contribution(
        self, request: web.Request, rnd: Round, member: GroupMember, declared: float, elements: int
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
        codec, step = self.config.codec, self.config.frame_elements
        storage = None
        into: KeptPart | np.ndarray | None = None
        if expected and codec.lossy:  # kept as the codec's payload: 1 or 2 bytes a value instead of 4
            storage = self._take_buffer(KeptPart.nbytes(codec, expected, step))
            into = KeptPart(codec, expected, step, storage)
        elif expected:
            storage = self._take_buffer(4 * expected)
            into = storage[: 4 * expected].view(np.float32)
        floats = into if isinstance(into, np.ndarray) else np.empty(0, np.float32)  # (none: an empty part)
        t = time.perf_counter()
        try:
            async with asyncio.timeout(rnd.deadline - time.time()):
                dest = into if isinstance(into, KeptPart) else lambda a, b: floats[a:b]
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
            red.gone(peer)  # (it cannot send this copy again: the part does not wait for it)
            raise _Refused(408, f"peer {peer} went away while sending part {red.part}") from None
        rnd.stats.received(nbytes, time.perf_counter() - t)
        weight = 1.0 if rnd.uniform else declared
        return Contribution(peer, weight, into, math.sqrt(norm2), storage=storage)


def quantised(values: np.ndarray, into: KeptPart) -> tuple[KeptPart, float]:
    """``values`` encoded with ``into``'s codec, frame by frame and without error feedback, kept in ``into``
    as a received copy is; and the norm of what they decode to."""
    norm2 = 0.0
    for a, b in subframe_bounds(0, into.length, into.step):
        raw = transform(np.ascontiguousarray(values[a:b]), into.codec)
        into.slot(a, b)[:] = np.frombuffer(raw, dtype=np.uint8)
        decoded = into.values(a, b)
        norm2 += float(np.dot(decoded, decoded))
    return into, math.sqrt(norm2)
