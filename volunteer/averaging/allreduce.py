"""Group all-reduce as a butterfly over HTTP: one round trip per pair of members.

The flat vector is cut into one contiguous part per member that owns a part (``part >= 0``, in part
order): in proportion to the assignment's ``part_weights`` (the tracker's, by the owners' upload rates), or
as even as possible without them. Member *i* ``POST``s its copy of part *j* to the owner of *j* at
``/v1/allreduce/{round_id}/{tag}/{j}``; the owner waits for every member's copy (or the assignment's
deadline), takes the weighted mean in fp32 and answers every waiting request with the reduced part.
The owner's own copy never leaves the process. Client-mode members own nothing and only send.

Pipelined: a sender encodes its next sub-frame while the current one is on the wire; a receiver decodes
a sub-frame in a thread while the next one arrives (a stored codec-none body lands straight in its
destination); the owner computes each copy's norm as it arrives, decides clipping once every copy is in,
then reduces and encodes its part slice by slice and streams each answer sub-frame to every waiting
sender as soon as that slice is ready, instead of answering after the whole part is reduced.

Failures are local, never a hang: a copy that arrives after the deadline is dropped and the weights
renormalised (its sender's copies are refused with 410, and its result says ``late``: the others averaged
without it, so it catches up instead of applying values that are not the group's); a copy that fails a
check is refused with a 4xx sentence and listed as rejected; a sender
whose owner fails keeps its own values for that part and lists it in ``failed_parts``. A round returns by
the deadline plus ``grace_s``. A round fails as a whole (:class:`AveragingError`, after a ``RoundFailed``
event; one meaning for both) only when it cannot start. Once started it returns, with ``RoundDone``, even when
every part failed: the group then agrees on what each part holds (a part with no copy of positive weight
fails alike for all its members, e.g. when no member had samples), which a round failed as a whole (the
caller then fetches the state) would not keep.

A member asleep in the round (a part owner that neither answers nor sends) is cut by the group through the
tracker when the averager has a ``referee`` (:mod:`~crowdtrain.volunteer.averaging.cutting`): its part then
fails alike for every member, and it hears it was cut (its round is ``late``) when it wakes.

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

Where each side lives: :class:`Averager` (here) checks the assignment and runs the round;
:mod:`~crowdtrain.volunteer.averaging.owner` receives, reduces and answers the part this peer owns;
:mod:`~crowdtrain.volunteer.averaging.sender` sends this peer's copies of the other parts and reads the
answers; :mod:`~crowdtrain.volunteer.averaging.exchange` holds the round's record and result.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np
from aiohttp import web

from crowdtrain.protocol.credentials import SigningKey, verify_assignment
from crowdtrain.protocol.errors import AuthError, AveragingError
from crowdtrain.protocol.messages import Credential, GroupAssignment, GroupMember
from crowdtrain.protocol.receipts import Finding
from crowdtrain.volunteer.averaging.averages import AverageLog
from crowdtrain.volunteer.averaging.complaints import Complainer
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.cutting import Cutter, Referee
from crowdtrain.volunteer.averaging.exchange import NAME, Round, RoundResult, part_bounds
from crowdtrain.volunteer.averaging.owner import ROUTE, Owner
from crowdtrain.volunteer.averaging.pulls import PullJudge
from crowdtrain.volunteer.averaging.samples import SampleLog
from crowdtrain.volunteer.averaging.sender import Sender
from crowdtrain.volunteer.averaging.wire import Coder, KeptPart
from crowdtrain.volunteer.events import AnswerRefused, Emit, RoundDone, RoundFailed, no_emit

log = logging.getLogger(__name__)


AWAKE_ROUTE = "/v1/awake"  # answers whenever this peer's loop runs: asked before a vote to cut it


async def _awake(request: web.Request) -> web.Response:
    return web.Response(status=204)


class Averager:
    """This peer's side of group all-reduce: it checks each assignment, then runs the round between the part
    owner (:class:`~crowdtrain.volunteer.averaging.owner.Owner`, whose route it mounts) and the sender
    (:class:`~crowdtrain.volunteer.averaging.sender.Sender`), and tells what the round gave."""

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
        referee: Referee | None = None,
        complainer: Complainer | None = None,
    ) -> None:
        """``referee``: the tracker's decisions on members asleep in a round (None: never cut one);
        ``complainer``: where part owners whose receipts fail are reported (None: only logged)."""
        self.run_id = run_id
        self.tracker_public_key = tracker_public_key
        self.peer_id = peer_id
        self.key = key
        self.credential = credential
        self.config = config or AveragingConfig()
        self.emit = emit
        self.complainer = complainer
        self._complaints: set[asyncio.Task[None]] = set()
        self.pulls = PullJudge(peer_id, self.config)
        self._coder = Coder(self.config)  # one coder for both sides
        self.owner = Owner(
            run_id=run_id,
            tracker_public_key=tracker_public_key,
            peer_id=peer_id,
            config=self.config,
            coder=self._coder,
            key=key,
        )
        self.sender = Sender(
            key=key, credential=credential, config=self.config, coder=self._coder, run_id=run_id
        )
        self.cutter = Cutter(peer_id, referee, self.sender.awake) if referee is not None else None
        # spot-checks: the samples of this peer's own gradients, served to checkers; as a checker, the
        # suspect wanted per round id (and the event its copy's arrival sets), and its copy of my part kept
        # (my part's bounds, the values)
        self.samples = SampleLog(run_id, tracker_public_key)
        # the averages this peer applied lately, served to peers that missed those steps
        self.averages = AverageLog(run_id, tracker_public_key)
        self.wanted: dict[str, tuple[str, asyncio.Event]] = {}
        self.kept: dict[str, tuple[int, int, np.ndarray | KeptPart]] = {}

    # ------------------------------------------------------------------ public

    @property
    def upload_bps(self) -> float | None:
        """The rate its answers went out at lately, bytes per second (None: not measured yet)."""
        return self.owner.upload_bps

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(ROUTE, self.owner.handle),
            web.get(AWAKE_ROUTE, _awake),
            *self.samples.routes(),
            *self.averages.routes(),
        ]

    async def close(self) -> None:
        if self._complaints:  # (a complaint still on its way goes, within the tracker client's timeout)
            await asyncio.wait(list(self._complaints))
        await self.sender.close()

    def bounds(self, assignment: GroupAssignment, size: int) -> list[tuple[int, int]]:
        """The parts a vector of ``size`` values is cut into in ``assignment``'s rounds."""
        return part_bounds(size, assignment.parts, assignment.part_weights, self.config.align)

    async def claim_ahead(self, assignment: GroupAssignment, tag: str) -> None:
        """Tell the tracker this peer is awake for its part of a round it will join late (a spot-check comes
        first); nothing without a referee, or without a part of its own."""
        me = next((m for m in assignment.members if m.peer_id == self.peer_id), None)
        if self.cutter is not None and me is not None and me.part >= 0 and len(assignment.members) > 1:
            await self.cutter.claim_ahead(assignment, tag)

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
        if rnd.reducer is not None and tag == "grad" and assignment.round_id in self.wanted:
            # a spot-check of a member's copy of my part
            rnd.reducer.suspect(*self.wanted.pop(assignment.round_id))
        failed: dict[int, str] = {}
        cutter = self.cutter if len(assignment.members) > 1 else None
        await self.owner.open(rnd)
        try:
            await self._run(rnd, vector, weight, failed, cutter)
            if rnd.reducer is not None:  # every read into them is over and the part is reduced
                if rnd.reducer.kept is not None:
                    self.kept[assignment.round_id] = (*rnd.bounds[rnd.my_part], rnd.reducer.kept)
                self.owner.give_back(rnd.reducer)
        finally:
            self.owner.retire(rnd)
        duration = time.perf_counter() - started
        if cutter is not None and not rnd.cut:
            cutter.measured(duration)
        return self._finish(rnd, output, failed, duration, tag)

    async def _run(
        self, rnd: Round, vector: np.ndarray, weight: float, failed: dict[int, str], cutter: Cutter | None
    ) -> None:
        """Both sides of the round at once: my part (and, with a cutter, its claim), my copies of the others'
        parts (and the votes on owners that do not answer)."""
        output = rnd.output
        assert output is not None
        async with asyncio.TaskGroup() as tg:
            if rnd.reducer is not None:
                tg.create_task(self.owner.close_part(rnd))
                tg.create_task(self.owner.own_part(rnd, output, failed))
                if cutter is not None:
                    tg.create_task(cutter.claim(rnd))
            exchanges = {
                member.part: tg.create_task(
                    self.sender.exchange(rnd, member, vector, weight, rnd.tag, output, failed)
                )
                for member in rnd.assignment.members
                if member.part >= 0 and member.part != rnd.my_part
            }
            if cutter is not None and exchanges:
                tg.create_task(cutter.watch(rnd, exchanges, failed, vector))

    # ------------------------------------------------------------------ round set-up

    def _prepare(
        self, a: GroupAssignment, vector: np.ndarray, weight: float, tag: str, out: np.ndarray | None = None
    ) -> Round:
        key = f"{a.round_id}/{tag}"
        me = self._check_group(a, tag, key)
        self._check_values(a, key, me, vector, weight, out)
        bounds = self.bounds(a, vector.size)
        self.sender.prepare(tag, vector.size)
        members = {m.peer_id: m for m in a.members}
        uniform = all(m.weight == 0 for m in a.members)
        rnd = Round(key, a, members, bounds, me.part, a.deadline, uniform, tag)
        # every value of the output is written: the reduced part, a decoded answer, or my own for a failed part
        rnd.output = np.empty_like(vector) if out is None else out
        rnd.in_place = rnd.output is vector
        if me.part >= 0:
            self.owner.prepare(rnd, vector, weight)
        return rnd

    def _check_group(self, a: GroupAssignment, tag: str, key: str) -> GroupMember:
        """This peer's entry in an assignment the tracker signed for a new round of this run, whose parts
        each have one owner with an address."""
        try:
            verify_assignment(a, self.tracker_public_key)
        except AuthError as exc:
            raise AveragingError(
                f"group assignment for round {a.round_id!r} is not the tracker's: {exc}"
            ) from None
        if a.run_id != self.run_id:
            raise AveragingError(f"group assignment is for run {a.run_id!r}, not {self.run_id!r}")
        if not NAME.fullmatch(a.round_id) or not NAME.fullmatch(tag):
            raise AveragingError(
                f"round id {a.round_id!r} and tag {tag!r} must be 1–200 letters, digits, '.', '_' or '-'"
            )
        if self.owner.known(key):
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
        if a.part_weights and len(a.part_weights) != a.parts:
            raise AveragingError(
                f"group assignment for round {key} weighs {len(a.part_weights)} parts, not {a.parts}"
            )
        return me

    def _check_values(
        self,
        a: GroupAssignment,
        key: str,
        me: GroupMember,
        vector: np.ndarray,
        weight: float,
        out: np.ndarray | None,
    ) -> None:
        """The vector, the output buffer and the weight fit the round, and its deadline is still ahead."""
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

    # ------------------------------------------------------------------ complaints

    def _complain(self, rnd: Round, owner: str, part: int, receipt: bytes, finding: Finding) -> None:
        """Say that ``owner``'s answer was refused (a warning and an event) and tell the tracker, in the
        background."""
        a = rnd.assignment
        log.warning(
            "round %s: the answer of part owner %s (part %d) was refused: %s",
            rnd.key,
            owner,
            part,
            finding.why,
        )

        async def send() -> None:
            outcome = None
            if self.complainer is not None:
                outcome = await self.complainer.of_owner(a, rnd.tag, owner, receipt, finding.why)
            self.emit(
                AnswerRefused(
                    round_id=a.round_id,
                    step=a.step,
                    owner=owner,
                    part=part,
                    reason=finding.why,
                    proven=finding.proven,
                    tracker=outcome or "",
                )
            )

        self._background(send())

    def _pulling(self, rnd: Round) -> None:
        """Judge, in the background, whether a member's copy points against the others' terms in this first
        phase (:class:`~crowdtrain.volunteer.averaging.pulls.PullJudge`)."""
        self._background(self.pulls.judge(rnd, self.complainer, self.emit))

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` (a call to the tracker) in the background; :meth:`close` awaits it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._complaints.add(task)
        task.add_done_callback(self._complaints.discard)

    # ------------------------------------------------------------------ result

    def _finish(
        self, rnd: Round, output: np.ndarray, failed: dict[int, str], duration: float, tag: str
    ) -> RoundResult:
        outcome = rnd.reducer.outcome if rnd.reducer is not None else None
        reasons = {f"part {j}": why for j, why in failed.items()}
        if outcome is not None:
            reasons |= rnd.reducer.rejected if rnd.reducer else {}
        phases = {
            "encode": rnd.stats.encode_s,
            "decode": rnd.stats.decode_s,
            "reduce": outcome.reduce_s if outcome else 0.0,
            "upload": rnd.stats.upload_s,  # its answers, first byte out to last acknowledged (so far)
            "total": duration,
        }
        for owner, part, receipt, finding in rnd.complaints:
            self._complain(rnd, owner, part, receipt, finding)
        if rnd.held and not rnd.shared and tag == "grad":
            self._pulling(rnd)
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
            late=rnd.late,
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
