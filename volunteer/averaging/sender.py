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
import time
from collections.abc import AsyncIterator

import aiohttp
import numpy as np

from crowdtrain.protocol import peerauth
from crowdtrain.protocol.aio import BodyTooLong, read_body
from crowdtrain.protocol.codecs import Residual
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.protocol.messages import Credential, GroupMember
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.round import Round
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

_NETWORK_ERRORS = (aiohttp.ClientError, asyncio.IncompleteReadError, ConnectionError, OSError, TimeoutError)


class Sender:
    """Sends this peer's copies of the parts others own and takes their answers, over one HTTP session.

    It keeps, per tag, the error-feedback residual of what it sends with a lossy codec (over the whole
    vector: a part that moves to another owner carries its residual along).
    """

    def __init__(
        self, *, key: SigningKey, credential: Credential, config: AveragingConfig, coder: Coder
    ) -> None:
        self.key = key
        self.credential = credential
        self.config = config
        self._coder = coder
        self._residuals: dict[str, Residual] = {}
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        if send and self._coder.stores(vector[start:stop]):
            # a known length: aiohttp writes each frame as it is instead of joining it into a chunk
            headers["Content-Length"] = str(stored_length(stop - start, self.config.frame_elements))
            data = self._stored(rnd, vector, start, stop)
        elif send:
            data = self._coded(rnd, vector, start, stop, residual)
        why = await self._post(rnd, owner, headers, data, output)
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
        self, rnd: Round, vector: np.ndarray, start: int, stop: int, residual: Residual | None
    ) -> AsyncIterator[bytes | memoryview]:
        """The part as sub-frames; the next one is encoded in a thread while this one is sent (each one
        taken by the network moves the round: a slow uplink is not a quiet round)."""
        stats = rnd.stats
        bounds = subframe_bounds(start, stop, self.config.frame_elements)

        def encode(a: int, b: int) -> asyncio.Future[tuple[bytes, bytes | memoryview]]:
            res = None if residual is None else residual[a:b]
            return asyncio.ensure_future(asyncio.to_thread(self._coder.encode, vector[a:b], res))

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
        self, rnd: Round, vector: np.ndarray, start: int, stop: int
    ) -> AsyncIterator[bytes | memoryview]:
        """The part as stored sub-frames straight from ``vector``'s memory (only a checksum to compute:
        ~0.2 ms per sub-frame, on the loop)."""
        stats = rnd.stats
        for a, b in subframe_bounds(start, stop, self.config.frame_elements):
            t = time.perf_counter()
            header, frame = stored_frame(vector[a:b])
            stats.encode_s += time.perf_counter() - t
            stats.bytes_sent += len(header) + frame.nbytes
            stats.raw_bytes += 4 * (b - a)
            yield header
            yield frame
            rnd.moved()

    async def _post(
        self, rnd: Round, owner: GroupMember, headers: dict[str, str], data: object, output: np.ndarray
    ) -> str | None:
        """POST the copy to the part's owner and decode its answer into ``output``: why that failed, or None."""
        cfg, j = self.config, owner.part
        start, stop = rnd.bounds[j]

        def into(a: int, b: int) -> np.ndarray:
            rnd.moved()  # (a sub-frame of the answer arrives: an answer coming up a slow line is no quiet)
            return output[start + a : start + b]

        url = f"http://{owner.address}/v1/allreduce/{rnd.key}/{j}"
        remaining = rnd.deadline + cfg.grace_s - time.time()
        timeout = aiohttp.ClientTimeout(total=max(0.05, remaining), sock_connect=cfg.connect_timeout_s)
        try:
            async with self._session_for().post(url, data=data, headers=headers, timeout=timeout) as resp:
                rnd.moved()  # (the owner answers once its part closed: it was awake)
                if resp.status != 200:
                    rnd.late |= resp.status == 410  # its part or round had closed: I was too late for it
                    return f"HTTP {resp.status}: {await self._error_text(resp)}"
                t = time.perf_counter()
                _, nbytes = await read_part(resp.content, self._coder, stop - start, into)
                rnd.stats.decode_s += time.perf_counter() - t
                rnd.stats.bytes_received += nbytes
        except ProtocolError as exc:
            return f"its answer was malformed: {exc}"
        except _NETWORK_ERRORS as exc:
            return "did not answer by the deadline" if isinstance(exc, TimeoutError) else f"failed: {exc!r}"
        return None

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
        url = f"http://{owner.address}/v1/awake"
        try:
            async with asyncio.timeout(within_s), self._session_for().get(url):
                pass  # (its status line came: it is awake; its body is never read)
        except _NETWORK_ERRORS:
            return False
        return True

    def _session_for(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False), auto_decompress=False
            )
        return self._session

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
