"""A volunteer's own samples, kept for spot-checks (see :mod:`crowdtrain.volunteer.spotcheck`).

Every volunteer keeps the samples of its gradient of each of its last :data:`KEEP_STEPS` steps (each
micro-batch's ``(chunk index, offset)`` pairs, in order, and the sum of their losses × n) and serves them at
``GET /v1/spotcheck/{step}`` to any member of the run (signed, purpose ``spotcheck``, over the step). It lives
beside the all-reduce (its routes are the averager's) and, like it, imports neither torch nor rich.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from aiohttp import web

from crowdtrain.protocol.errors import AuthError
from crowdtrain.protocol.messages import MAX_CHECKED_SAMPLES, ErrorBody, SpotCheckAnswer, encode
from crowdtrain.protocol.peerauth import check_headers

KEEP_STEPS = 8  # steps whose samples a volunteer keeps for checkers
ROUTE = "/v1/spotcheck/{step}"
PURPOSE = "spotcheck"


class SampleLog:
    """The suspect's side: the samples of its gradients of its last KEEP_STEPS steps, served to checkers."""

    def __init__(self, run_id: str, tracker_public_key: str) -> None:
        self.run_id = run_id
        self.tracker_public_key = tracker_public_key
        # step -> (micro-batches, Σ n × loss)
        self._steps: collections.OrderedDict[int, tuple[list[list[tuple[int, int]]], float]] = (
            collections.OrderedDict()
        )

    def computed(self, step: int, provenance: Sequence[tuple[int, int]], loss: float) -> None:
        """A micro-batch accumulated toward ``step``: its samples, in order, and its mean loss."""
        batches, total = self._steps.pop(step, ([], 0.0))
        batches.append(list(provenance))
        self._steps[step] = (batches, total + loss * len(provenance))
        while len(self._steps) > KEEP_STEPS:
            self._steps.popitem(last=False)

    def dropped(self, step: int) -> None:
        """The accumulation toward ``step`` (and beyond: computed ahead) was dropped (a missed step, a
        catch-up): none of it will be averaged. What earlier steps averaged is still served."""
        for kept in [k for k in self._steps if k >= step]:
            del self._steps[kept]

    def answer(self, step: int) -> SpotCheckAnswer | None:
        kept = self._steps.get(step)
        if kept is None or sum(len(b) for b in kept[0]) > MAX_CHECKED_SAMPLES:
            return None
        return SpotCheckAnswer(step=step, batches=kept[0], loss_sum=kept[1])

    def routes(self) -> list[web.RouteDef]:
        return [web.get(ROUTE, self._serve)]

    async def _serve(self, request: web.Request) -> web.Response:
        text = request.match_info["step"]
        if not text.isdigit() or len(text) > 18:
            return _error(404, f"{text[:40]!r} is not a step number")
        try:
            check_headers(request.headers, self.tracker_public_key, self.run_id, PURPOSE, int(text))
        except AuthError as exc:
            return _error(401, f"spot-check requests need a run member's signature: {exc}")
        answer = self.answer(int(text))
        if answer is None:
            return _error(404, f"this peer keeps no samples of step {text} (it keeps its last {KEEP_STEPS})")
        return web.Response(body=encode(answer), content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=encode(ErrorBody(error=message)), content_type="application/json")
