"""The member's side of a round: send this peer's copy of each part to its owner, read the reduced part back.

One ``POST`` per part this peer does not own, all at once. The body is the part as tensor frames of at most
``subframe_elements`` values: stored fp32 straight from the vector's memory with a ``Content-Length`` when the
part is dense and the codec is none, else encoded in a thread (the next sub-frame while this one is on the
wire) and sent chunked. The owner's answer is decoded into the round's output as it arrives. A part whose
owner fails, refuses or answers badly keeps this peer's own values and is listed as failed: a sender never
waits past the deadline plus ``grace_s``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator

import aiohttp
import numpy as np

from crowdtrain.protocol import peerauth, receipts
from crowdtrain.protocol.aio import BodyTooLong, read_body
from crowdtrain.protocol.codecs import Codec, Residual, untransform
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.protocol.messages import Credential, GroupMember
from crowdtrain.protocol.peerclient import PeerClient, PeerUnreachable
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.exchange import Round
from crowdtrain.volunteer.averaging.wire import (
    HEADER_ELEMENTS,
    HEADER_WEIGHT,
    PURPOSE,
    Coder,
    read_part,
    stored_frame,
    stored_length,
    subframe_bounds,
)

log = logging.getLogger(__name__)


class _Copy:
    """My copy of one part as its owner decodes it, frame by frame: the codec's payload of each (lossy), a
    copy of the values (codec none, averaging in place: the answer overwrites them), or nothing (the values
    stay in the vector); and its squared norm."""

    def __init__(self, weight: float, frames: list[np.ndarray] | None) -> None:
        self.weight = weight
        self.frames = frames
        self.payloads: list[bytes] = []
        self.norm2 = 0.0

    def add(self, sent: np.ndarray, raw: bytes | None) -> None:
        self.norm2 += float(np.dot(sent, sent))
        if raw is not None:
            self.payloads.append(raw)
        elif self.frames is not None:
            self.frames.append(np.array(sent, dtype=np.float32))

    def witness(self, answer: np.ndarray, vector: np.ndarray, codec: Codec, step: int) -> tuple[float, float]:
        """(‖copy‖², <copy, answer>); nothing sent: (0, 0)."""
        if self.weight <= 0 and not self.payloads and not self.frames:
            return 0.0, 0.0
        dot = 0.0
        for k, (a, b) in enumerate(subframe_bounds(0, answer.size, step)):
            if self.payloads:
                copy = untransform(self.payloads[k], codec, b - a)
            elif self.frames:
                copy = self.frames[k]
            else:
                copy = vector[a:b]
            dot += float(np.dot(copy, answer[a:b]))
        return self.norm2, dot


class Sender:
    """Sends this peer's copies of the parts others own and takes their answers, over one HTTP session.

    It keeps, per tag, the error-feedback residual of what it sends with a lossy codec (over the whole
    vector: a part that moves to another owner carries its residual along).
    """

    def __init__(
        self, *, key: SigningKey, credential: Credential, config: AveragingConfig, coder: Coder, run_id: str
    ) -> None:
        self.run_id = run_id
        self.key = key
        self.credential = credential
        self.config = config
        self._coder = coder
        self._residuals: dict[str, Residual] = {}
        self._client = PeerClient()  # (every request to the owners; closed with the sender)

    async def close(self) -> None:
        await self._client.close()

    def prepare(self, tag: str, size: int) -> None:
        """Start the residual of ``tag`` afresh when there is none for a vector of ``size`` values."""
        if self.config.codec.lossy:
            up = self._residuals.get(tag)
            if up is None or up.size != size:
                self._residuals[tag] = Residual.zeros(size)

    async def exchange(
        self,
        rnd: Round,
        owner: GroupMember,
        vector: np.ndarray,
        weight: float,
        tag: str,
        output: np.ndarray,
        failed: dict[int, str],
    ) -> None:
        """Send my copy of ``owner``'s part and take the reduced part from its answer."""
        start, stop = rnd.bounds[owner.part]
        if stop == start:
            return
        send = rnd.uniform or weight > 0
        headers = self._headers(rnd, owner.part, weight, stop - start if send else 0)
        residual = self._residuals.get(tag) if self.config.codec.lossy and not rnd.shared else None
        data: object = b""
        # my copy as the owner decodes it, to check my line of its receipt (in place, the answer overwrites
        # the vector's values: they are kept)
        mine = _Copy((1.0 if rnd.uniform else weight) if send else 0.0, None if output is not vector else [])
        if send and self._coder.stores(vector[start:stop]):
            # a known length: aiohttp writes each frame as it is instead of joining it into a chunk
            headers["Content-Length"] = str(stored_length(stop - start, self.config.frame_elements))
            data = self._stored(rnd, vector, start, stop, mine)
        elif send:
            data = self._coded(rnd, vector, start, stop, residual, mine)
        why = await self._post(rnd, owner, headers, data, output, vector, mine)
        rnd.moved()
        if why is not None:
            self._part_failed(rnd, owner, why, vector, output, failed)

    def _headers(self, rnd: Round, part: int, weight: float, elements: int) -> dict[str, str]:
        """The peer headers signed over this copy, and its declared weight and length."""
        weight_s, elements_s = repr(float(weight)), str(elements)
        headers = peerauth.sign_headers(
            self.key, self.credential, PURPOSE, rnd.key, part, weight_s, elements_s
        )
        return headers | {
            HEADER_WEIGHT: weight_s,
            HEADER_ELEMENTS: elements_s,
            "Content-Type": "application/octet-stream",
        }

    async def _coded(
        self, rnd: Round, vector: np.ndarray, start: int, stop: int, residual: Residual | None, mine: _Copy
    ) -> AsyncIterator[bytes | memoryview]:
        """The part as sub-frames; the next one is encoded in a thread while this one is sent (each one
        taken by the network moves the round: a slow uplink is not a quiet round)."""
        stats = rnd.stats
        bounds = subframe_bounds(start, stop, self.config.frame_elements)

        def encode_kept(a: int, b: int) -> tuple[bytes, bytes | memoryview]:
            res = None if residual is None else residual[a:b]
            header, body, sent, raw = self._coder.encode_raw(vector[a:b], res)
            mine.add(sent, raw)
            return header, body

        def encode(a: int, b: int) -> asyncio.Future[tuple[bytes, bytes | memoryview]]:
            return asyncio.ensure_future(asyncio.to_thread(encode_kept, a, b))

        t = time.perf_counter()
        ahead = encode(*bounds[0])
        try:
            for k, (a, b) in enumerate(bounds):
                header, frame = await ahead
                if k + 1 < len(bounds):
                    ahead = encode(*bounds[k + 1])
                stats.encode_s += time.perf_counter() - t
                stats.bytes_sent += len(header) + len(frame)
                stats.raw_bytes += 4 * (b - a)
                yield header
                yield frame
                rnd.moved()
                t = time.perf_counter()
        finally:
            if not ahead.done():  # (the last one is done: it was awaited)
                ahead.cancel()

    async def _stored(
        self, rnd: Round, vector: np.ndarray, start: int, stop: int, mine: _Copy
    ) -> AsyncIterator[bytes | memoryview]:
        """The part as stored sub-frames straight from ``vector``'s memory (only a checksum and a norm to
        compute: ~0.3 ms per sub-frame, on the loop)."""
        stats = rnd.stats
        for a, b in subframe_bounds(start, stop, self.config.frame_elements):
            t = time.perf_counter()
            header, frame = stored_frame(vector[a:b])
            mine.add(vector[a:b], None)
            stats.encode_s += time.perf_counter() - t
            stats.bytes_sent += len(header) + frame.nbytes
            stats.raw_bytes += 4 * (b - a)
            yield header
            yield frame
            rnd.moved()

    async def _post(
        self,
        rnd: Round,
        owner: GroupMember,
        headers: dict[str, str],
        data: object,
        output: np.ndarray,
        vector: np.ndarray,
        mine: _Copy,
    ) -> str | None:
        """POST the copy to the part's owner and decode its answer into ``output``: why that failed (the
        answer, or its receipt: see :meth:`_check_receipt`), or None."""
        cfg, j = self.config, owner.part
        start, stop = rnd.bounds[j]
        receipt = bytearray(receipts.size(len(rnd.members)))

        def into(a: int, b: int) -> np.ndarray:
            rnd.moved()  # (a sub-frame of the answer arrives: an answer coming up a slow line is no quiet)
            return output[start + a : start + b]

        remaining = rnd.deadline + cfg.grace_s - time.time()
        timeout = aiohttp.ClientTimeout(total=max(0.05, remaining), sock_connect=cfg.connect_timeout_s)
        try:
            async with self._client.post(
                owner.address or "",
                f"/v1/allreduce/{rnd.key}/{j}",
                data=data,
                headers=headers,
                timeouts=timeout,
            ) as resp:
                rnd.moved()  # (the owner answers once its part closed: it was awake)
                if resp.status != 200:
                    rnd.late |= resp.status == 410  # its part or round had closed: I was too late for it
                    return f"HTTP {resp.status}: {await self._error_text(resp)}"
                t = time.perf_counter()
                norm2, nbytes = await read_part(resp.content, self._coder, stop - start, into, receipt)
                rnd.stats.received(nbytes, time.perf_counter() - t)
        except ProtocolError as exc:
            return f"its answer was malformed: {exc}"
        except PeerUnreachable as exc:
            return (
                "did not answer by the deadline"
                if exc.timed_out
                else str(exc).removeprefix(f"peer {owner.address} ")
            )
        return await asyncio.to_thread(
            self._check_receipt,
            rnd,
            owner,
            bytes(receipt),
            norm2,
            output[start:stop],
            vector[start:stop],
            mine,
        )

    def _check_receipt(
        self,
        rnd: Round,
        owner: GroupMember,
        raw: bytes,
        norm2: float,
        answer: np.ndarray,
        vector: np.ndarray,
        mine: _Copy,
    ) -> str | None:
        """Why the owner's answer must not be used (None: its receipt holds), in a thread; a receipt that
        fails is kept in ``rnd.complaints`` for the tracker (protocol/receipts.py)."""
        members = list(rnd.members)
        try:
            receipt = receipts.Receipt.parse(raw, len(members))
        except ProtocolError as exc:
            return f"its answer was malformed: {exc}"
        finding = receipts.verify_owner(receipt, owner.public_key, self.run_id, rnd.key)
        if finding is None:
            own = mine.witness(answer, vector, self.config.codec, self.config.frame_elements)
            finding = receipts.check(
                receipt,
                part=owner.part,
                owner=members.index(owner.peer_id),
                weights=[1.0 if rnd.uniform else float(m.weight) for m in rnd.members.values()],
                clip_multiple=self.config.clip_multiple,
                codec=self.config.codec,
                shared=rnd.shared,
                mine=receipts.Mine(
                    members.index(self.credential.peer_id),
                    mine.weight,
                    math.sqrt(own[0]),
                    own[1],
                    norm2,
                    receipts.digest(answer),
                ),
            )
            if finding is not None:
                rnd.complaints.append((owner.peer_id, owner.part, raw, finding))
            else:
                rnd.held[owner.part] = (members.index(owner.peer_id), raw)
        if finding is None:
            return None
        return f"answered a part its receipt does not account for: {finding.why}"

    async def _error_text(self, resp: aiohttp.ClientResponse) -> str:
        """The owner's refusal, read whole up to ``max_error_bytes``."""
        limit = self.config.max_error_bytes
        try:
            raw = await read_body(resp.content, limit, resp.content_length)
        except BodyTooLong:
            return f"an answer of more than {limit} bytes"
        return raw.decode("utf-8", "replace")

    async def awake(self, owner: GroupMember, within_s: float) -> bool:
        """Whether ``owner``'s peer answers at all within ``within_s`` (``GET /v1/awake``): one that waits for
        other members' copies still answers; one asleep (stopped, a lid closed) does not."""
        try:
            async with asyncio.timeout(within_s), self._client.get(owner.address or "", "/v1/awake"):
                pass  # (its status line came: it is awake; its body is never read)
        except (PeerUnreachable, TimeoutError):
            return False
        return True

    def _part_failed(
        self,
        rnd: Round,
        owner: GroupMember,
        why: str,
        vector: np.ndarray,
        output: np.ndarray,
        failed: dict[int, str],
    ) -> None:
        """Keep my own values of ``owner``'s part, and say why."""
        j = owner.part
        start, stop = rnd.bounds[j]
        output[start:stop] = vector[start:stop]
        failed[j] = f"owner {owner.peer_id} of part {j} {why}"
        log.warning("round %s: keeping local values of part %d: %s", rnd.key, j, failed[j])
