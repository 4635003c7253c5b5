"""The averages a volunteer applied lately, kept so that a peer that fell asleep for a few steps rejoins by
replaying them on its own state instead of fetching the whole state.

A peer left out of a step (asleep when it closed, or when its round ran) still holds the state of that step:
its parameters and optimizer moments are the others' as they were then. What it lacks is the average each of
the steps since applied: the same bits on every member of the round (a lossy codec's owner answers with
what its receivers decode). Every volunteer keeps the averages of its last :data:`KEEP_STEPS` applied steps
(delay 0; with the parameters averaged on the steps that average them), within :data:`KEEP_BYTES`, and
serves them at ``GET /v1/average/{step}/{what}`` (``what``: ``grad`` or ``params``) to any member of the
run (signed, purpose ``average``, over the step and ``what``), raw float32 with their SHA-256 in
``X-Crowdtrain-Sha256``. The peer catching up takes each from two peers and uses it only where both sent
the same bytes (:func:`fetch_average`): one hostile peer cannot make it apply an average of its own. A model
of more than ``KEEP_BYTES / 4`` parameters keeps none: it catches up by state fetch, as before.
Like the all-reduce, this module imports neither torch nor rich.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib

import aiohttp
import numpy as np
from aiohttp import web

from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import AuthError
from crowdtrain.protocol.messages import Credential, Donor, ErrorBody, encode
from crowdtrain.protocol.peerauth import check_headers, sign_headers
from crowdtrain.protocol.peerclient import PeerClient, PeerUnreachable

KEEP_STEPS = 4  # applied averages a volunteer keeps
KEEP_BYTES = 128 << 20  # ... in at most this many bytes (fewer steps for a larger model; none above)
ROUTE = "/v1/average/{step}/{what}"
PURPOSE = "average"
HEADER_SHA = "X-Crowdtrain-Sha256"
WHAT = ("grad", "params")
FETCH_TIMEOUT_S = 30.0
ASKED = 3  # donors asked at once for one average (the first two answers are compared)
SILENT_S = 2.0  # a donor that sends nothing for this long is given up (one asleep itself: its kernel listens)


class AverageLog:
    """The averages of this peer's last applied steps, served to peers catching up."""

    def __init__(self, run_id: str, tracker_public_key: str) -> None:
        self.run_id = run_id
        self.tracker_public_key = tracker_public_key
        self.keep = KEEP_STEPS  # (set by the first average's size)
        # step -> what -> [values, sha256 hex (taken when first served)]
        self._steps: collections.OrderedDict[int, dict[str, list]] = collections.OrderedDict()

    def copy(self, mean: np.ndarray) -> np.ndarray | None:
        """A copy of the average about to be applied (applying it clips and then zeroes the buffer it is
        in), or None when a model of its size keeps none. Blocking (a vector's copy): call it in a thread."""
        self.keep = min(KEEP_STEPS, KEEP_BYTES // max(1, 4 * mean.size))
        return np.array(mean, dtype=np.float32) if self.keep > 0 else None

    def applied(self, step: int, mean: np.ndarray, params: np.ndarray | None) -> None:
        """``mean`` (a :meth:`copy`) was applied as the average of ``step``, and ``params`` set after it where
        that step averaged them: keep them. Blocking (copies ``params``): call it in a thread."""
        if self.keep <= 0:
            return
        kept = {"grad": [mean, ""]}
        if params is not None:
            kept["params"] = [np.array(params, dtype=np.float32), ""]
        self._steps.pop(step, None)
        self._steps[step] = kept
        while len(self._steps) > self.keep:
            self._steps.popitem(last=False)

    def forget_from(self, step: int) -> None:
        """Averages of ``step`` on are no longer this peer's (it loaded another state)."""
        for kept in [k for k in self._steps if k >= step]:
            del self._steps[kept]

    def steps(self) -> list[int]:
        return list(self._steps)

    def routes(self) -> list[web.RouteDef]:
        return [web.get(ROUTE, self._serve)]

    async def _serve(self, request: web.Request) -> web.Response:
        text, what = request.match_info["step"], request.match_info["what"]
        if not text.isdigit() or len(text) > 18 or what not in WHAT:
            return _error(404, f"the path must be /v1/average/<step number>/{'|'.join(WHAT)}")
        try:
            check_headers(request.headers, self.tracker_public_key, self.run_id, PURPOSE, int(text), what)
        except AuthError as exc:
            return _error(401, f"averages are served to the run's members, signed: {exc}")
        kept = self._steps.get(int(text), {}).get(what)
        if kept is None:
            return _error(
                404, f"this peer keeps no {what} average of step {text} (it keeps its last {self.keep} steps)"
            )
        values = kept[0]
        if not kept[1]:
            kept[1] = await asyncio.to_thread(lambda: hashlib.sha256(values.data).hexdigest())
        return web.Response(
            body=values.data, headers={HEADER_SHA: kept[1]}, content_type="application/octet-stream"
        )


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=encode(ErrorBody(error=message)), content_type="application/json")


ABSENT = (
    "absent"  # fetch_average: the two peers asked both keep none (a step whose parameters were not averaged)
)


async def fetch_average(
    donors: list[Donor], step: int, what: str, size: int, key: SigningKey, credential: Credential
) -> np.ndarray | str | None:
    """The ``what`` average of ``step`` as two of ``donors`` sent it, byte for byte the same; None when the
    first two differ or fewer than two answered at all; :data:`ABSENT` when two said they keep none, or one
    sent it and the others keep none (yet: the step's round may be under way there; or parameters that a
    partial parameter average left as they were). ASKED donors are asked at once, the next ones as those
    answer without it; one silent for SILENT_S is given up (a donor asleep itself: its kernel takes the
    request and nothing answers)."""
    headers = sign_headers(key, credential, PURPOSE, step, what)
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S, sock_read=SILENT_S)
    expected = 4 * size

    async def one(client: PeerClient, donor: Donor) -> tuple[bytes, str] | None:
        try:
            async with client.get(donor.address, path, headers=headers, timeouts=timeout) as resp:
                if resp.status == 404:
                    return (b"", ABSENT)
                if resp.status != 200 or resp.content_length != expected:
                    return None
                body = await resp.content.readexactly(expected)
                if not resp.content.at_eof() and await resp.content.read(1):
                    return None
        except PeerUnreachable:
            return None
        sha = await asyncio.to_thread(lambda: hashlib.sha256(body).hexdigest())
        return (body, sha) if sha == resp.headers.get(HEADER_SHA) else None

    got: list[tuple[bytes, str]] = []
    absent = 0
    left = list(donors)
    path = f"/v1/average/{step}/{what}"
    async with PeerClient() as client:
        asked: set[asyncio.Future[tuple[bytes, str] | None]] = set()
        try:
            while len(got) < 2 and (left or asked) and not (absent >= 2 and not got):
                while left and len(asked) < ASKED:
                    asked.add(asyncio.ensure_future(one(client, left.pop(0))))
                done, asked = await asyncio.wait(asked, return_when=asyncio.FIRST_COMPLETED)
                for result in (task.result() for task in done):
                    if result is not None and result[1] == ABSENT:
                        absent += 1
                    elif result is not None:
                        got.append(result)
        finally:
            for task in asked:
                task.cancel()
            await asyncio.gather(*asked, return_exceptions=True)
    if len(got) < 2:  # (one that keeps it and one that does not yet: ask again later)
        return ABSENT if absent >= 2 or (got and absent) else None
    if got[0][1] != got[1][1]:
        return None
    return np.frombuffer(got[0][0], dtype=np.float32).copy()
