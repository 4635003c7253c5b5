"""The routes volunteers call: join, the signed heartbeat / ready / leave / state declaration, the donor list
and the step watch. Each reads the request, calls the run's :class:`~crowdtrain.tracker.collab.RunState`
and turns its answer (or refusal) into a reply; the rules live there."""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web

from crowdtrain import __version__
from crowdtrain.protocol import receipts
from crowdtrain.protocol.addresses import Origin, origin_of
from crowdtrain.protocol.codecs import Codec
from crowdtrain.protocol.credentials import issue_credential, verify_assignment
from crowdtrain.protocol.errors import AuthError, ProtocolError
from crowdtrain.protocol.messages import (
    MAX_INT,
    PEER_PROTOCOL,
    ColumnParts,
    Complaint,
    ComplaintReply,
    CutCall,
    CutVerdict,
    GroupAssignment,
    Heartbeat,
    JoinRequest,
    JoinResponse,
    LeaveRequest,
    PullReply,
    PullReport,
    ReadyRequest,
    RoundVerdict,
    RoundVerdicts,
    SpotCheckVerdict,
    StateDeclare,
    decode,
    round_tag,
)
from crowdtrain.tracker.collab import RunState, eval_refusal
from crowdtrain.tracker.cuts import CutRefused
from crowdtrain.tracker.donors import StateRefused
from crowdtrain.tracker.peers import Peer
from crowdtrain.tracker.pulls import PULL_WINDOW
from crowdtrain.tracker.reach import AddressError, resolve_address
from crowdtrain.tracker.replies import ApiError, json_reply, query_number
from crowdtrain.tracker.runs import Run
from crowdtrain.tracker.spotchecks import VerdictRefused
from crowdtrain.tracker.waits import ready_call, wait_close

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from crowdtrain.tracker.parts import TrackerParts

ADDRESS_CACHE = 100_000  # resolved addresses kept (then forgotten all at once)


class Volunteers:
    """The volunteers' routes of one tracker."""

    def __init__(self, tracker: TrackerParts) -> None:
        self.tracker = tracker
        self.config = tracker.config
        # (declared, seen from) -> the address others reach it at: every heartbeat declares it again, and
        # resolving it (IP parsing) cost a third of a heartbeat's handling
        self._addresses: dict[tuple[str, str | None], str] = {}

    def _full(self, run: RunState) -> ApiError:
        limit = self.config.max_peers_per_run
        return ApiError(503, f"run {run.run_id} has {limit} peers, its limit; try again later")

    def _origin(self, run: RunState, request: web.Request) -> Origin | None:
        """Where a new identity of ``run`` comes from, if one more may come from there (429 if not)."""
        origin = origin_of(request.remote)
        refusal = run.ledger.origins.admits(origin, self.config.max_peers_per_address)
        if refusal is not None:
            raise ApiError(429, refusal)
        return origin

    def _address(self, declared: str | None, request: web.Request) -> str | None:
        if declared is None:
            return None
        key = (declared, request.remote)
        address = self._addresses.get(key)
        if address is None:
            try:
                address = resolve_address(declared, request.remote, other_hosts=self.config.allow_other_hosts)
            except AddressError as exc:
                raise ApiError(400, str(exc)) from None
            if len(self._addresses) >= ADDRESS_CACHE:
                self._addresses.clear()
            self._addresses[key] = address
        return address

    async def _signed(self, request: web.Request, kind: type[Any]) -> tuple[RunState, Any, str]:
        """A volunteer's request: run, decoded body, the credential's public key (its peer id checked
        against the body's)."""
        run = self.tracker.run_of(request).state
        refusal = run.refusal()
        if refusal is not None and kind is not LeaveRequest:  # (leaving a closed run is fine)
            raise ApiError(410, refusal)
        body = await self.tracker.body(request)
        credential = self.tracker.auth.check(
            request.headers, run.run_id, request.path, hashlib.sha256(body).hexdigest()
        )
        msg = decode(body, kind, self.tracker.limits)
        if msg.peer_id != credential.peer_id:
            raise AuthError(f"credential is for peer {credential.peer_id}, not {msg.peer_id}")
        barred = run.checks.refusal(credential.public_key)
        if barred is not None and kind is not LeaveRequest:
            run.remove(msg.peer_id)
            raise ApiError(410, barred)
        return run, msg, credential.public_key

    @staticmethod
    def _known(run: RunState, peer_id: str) -> Peer:
        peer = run.peer(peer_id)
        if peer is None:
            raise ApiError(
                404, f"peer {peer_id} is not registered in run {run.run_id}; send a heartbeat or join again"
            )
        return peer

    def _check_join(self, record: Run, msg: JoinRequest) -> None:
        if record.private:
            if not msg.token:
                raise ApiError(401, f"run {record.run_id} is private; pass its join token (--token)")
            if not record.admits(msg.token):
                raise ApiError(403, f"the join token for run {record.run_id} is wrong")
        if msg.peer_protocol != PEER_PROTOCOL:
            theirs = f" ({msg.client_version})" if msg.client_version else ""
            raise ApiError(
                409,
                f"this volunteer's crowdtrain{theirs} speaks peer protocol {msg.peer_protocol} but the peers of "
                f"this tracker speak {PEER_PROTOCOL}; install crowdtrain {__version__}, the tracker's version",
            )

    async def join(self, request: web.Request) -> web.Response:
        record = self.tracker.run_of(request)
        run = record.state
        refusal = run.refusal()
        if refusal is not None:
            raise ApiError(410, refusal)
        if not self.tracker.join_limit.allow(request.remote or ""):
            raise ApiError(429, "too many joins from your address; wait a few seconds and try again")
        msg = decode(await self.tracker.body(request), JoinRequest, self.tracker.limits)
        self._check_join(record, msg)
        barred = run.checks.refusal(msg.public_key)
        if barred is not None:
            raise ApiError(410, barred)
        if run.full(self.config.max_peers_per_run):
            raise self._full(run)
        origin = self._origin(run, request)
        address = self._address(msg.address, request)
        peer_id = secrets.token_hex(8)
        credential = issue_credential(
            self.tracker.signer, run.run_id, peer_id, msg.public_key, self.config.credential_ttl_s
        )
        self.tracker.auth.remember(credential)
        peer = run.join(peer_id, msg.public_key, origin)
        self.tracker.checker.update(peer, address, None, request.remote or "", run.spec.dataset.infohash)
        return json_reply(
            JoinResponse(
                peer_id=peer_id,
                credential=credential,
                global_step=run.global_step,
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                peer_ttl_s=self.config.peer_ttl_s,
                session_key=self.tracker.auth.session_key_for(credential),
                observed_host=request.remote,
            )
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        run, hb, public_key = await self._signed(request, Heartbeat)
        address = self._address(hb.address, request)
        # after a tracker restart or an expiry: the signed credential registers it again
        origin = self._origin(run, request) if run.peer(hb.peer_id) is None else None
        peer = run.member(hb.peer_id, public_key, self.config.max_peers_per_run, origin)
        if peer is None:
            raise self._full(run)
        if hb.eval is not None:  # (before anything of the heartbeat is taken)
            refusal = eval_refusal(run, hb.eval)
            if refusal is not None:
                raise ApiError(400, refusal)
        self.tracker.checker.update(
            peer, address, hb.bt_port, request.remote or "", run.spec.dataset.infohash
        )
        return json_reply(run.heartbeat(peer, hb))

    async def ready(self, request: web.Request) -> web.Response:
        run, msg, _ = await self._signed(request, ReadyRequest)
        peer = self._known(run, msg.peer_id)
        long_poll_s = self.config.long_poll_s
        wait_s = min(long_poll_s, query_number(request, "wait_s", float, 0.0, 3600.0, default=long_poll_s))
        return json_reply(await ready_call(run, peer, msg.step, msg.weight, wait_s, msg.ahead))

    async def leave(self, request: web.Request) -> web.Response:
        run, msg, _ = await self._signed(request, LeaveRequest)
        if not run.leave(msg.peer_id, kept=msg.kept):
            raise ApiError(404, f"peer {msg.peer_id} is not registered in run {run.run_id}")
        return web.Response(status=204)

    async def declare_state(self, request: web.Request) -> web.Response:
        run, msg, _ = await self._signed(request, StateDeclare)
        peer = self._known(run, msg.peer_id)
        try:
            run.declare_state(peer, [msg.state, *msg.older])
        except StateRefused as exc:
            raise ApiError(exc.status, str(exc)) from None
        return web.Response(status=204)

    async def spot_check(self, request: web.Request) -> web.Response:
        """A checker's verdict on the contribution it was drawn to recompute (tracker/spotchecks.py)."""
        run, msg, public_key = await self._signed(request, SpotCheckVerdict)
        self._known(run, msg.peer_id)
        where = origin_of(request.remote)
        accuser = where.address if where is not None else f"key {public_key}"
        try:
            barred = run.checks.verdict(msg, public_key, accuser, run.run_id)
        except VerdictRefused as exc:
            raise ApiError(409, str(exc)) from None
        if barred is not None:  # its peers go: their allotments are freed, they weigh nothing from now on
            for peer in [p for p in run.peers.values() if p.public_key == barred]:
                run.remove(peer.peer_id)
            run.maybe_form(time.time())
        return web.Response(status=204)

    async def cut(self, request: web.Request) -> web.Response:
        """A member's vote to cut a part owner asleep in a round, or the owner's claim (tracker/cuts.py)."""
        run, msg, public_key = await self._signed(request, CutCall)
        a = msg.assignment
        self._member_round(run, a, msg.peer_id, public_key, msg.tag)
        owner = next((m for m in a.members if m.peer_id == msg.owner), None)
        if owner is None or owner.part < 0:
            raise ApiError(400, f"peer {msg.owner} owns no part of round {a.round_id}")
        try:
            decision = await run.cuts.call(a, msg.tag, msg.peer_id, msg.owner, time.time())
        except CutRefused as exc:
            raise ApiError(503, str(exc)) from None
        return json_reply(CutVerdict(decision=decision))

    def _member_round(
        self, run: RunState, a: GroupAssignment, peer_id: str, public_key: str, tag: str
    ) -> None:
        """Refuse (with a sentence) a call about round ``a`` that is not from one of its members, as this
        tracker signed it, under one of its phase's tags."""
        try:
            verify_assignment(a, self.tracker.signer.public_hex)
        except AuthError:
            raise ApiError(403, "the assignment is not one this tracker signed") from None
        if a.run_id != run.run_id:
            raise ApiError(400, f"the assignment is for run {a.run_id}, not {run.run_id}")
        caller = next((m for m in a.members if m.peer_id == peer_id), None)
        if caller is None or caller.public_key != public_key:
            raise ApiError(403, f"peer {peer_id} is not a member of round {a.round_id}")
        tags = (round_tag("grad", a.phase), round_tag("params", a.phase))
        if tag not in tags:
            raise ApiError(400, f"round {a.round_id} runs under {tags[0]} and {tags[1]}, not {tag}")

    async def complaint(self, request: web.Request) -> web.Response:
        """A member's complaint about a part owner's receipt (protocol/receipts.py): a receipt that breaks its
        own arithmetic bars the owner's key at once; any other counts one accusation from the caller's
        address (as a failed spot-check does). Answers with what the tracker concluded."""
        run, msg, public_key = await self._signed(request, Complaint)
        a = msg.assignment
        self._member_round(run, a, msg.peer_id, public_key, msg.tag)
        members = [m.peer_id for m in a.members]
        owner = next((m for m in a.members if m.peer_id == msg.owner), None)
        if owner is None or owner.part < 0 or owner.peer_id == msg.peer_id:
            raise ApiError(
                400, f"peer {msg.owner} owns no part of round {a.round_id} that {msg.peer_id} sent to"
            )
        try:
            receipt = receipts.Receipt.parse(bytes.fromhex(msg.receipt), len(members))
            receipt.verify(owner.public_key, run.run_id, f"{a.round_id}/{msg.tag}")
        except (ValueError, ProtocolError, AuthError) as exc:
            raise ApiError(422, f"the receipt is not {msg.owner}'s for round {a.round_id}: {exc}") from None
        uniform = all(m.weight == 0 for m in a.members)
        finding = receipts.check(
            receipt,
            part=owner.part,
            owner=members.index(owner.peer_id),
            weights=[1.0 if uniform else float(m.weight) for m in a.members],
            clip_multiple=run.spec.averaging.clip_multiple,
            codec=Codec.parse(run.spec.averaging.codec),
            shared=a.phase > 0,
        )
        proven = finding is not None and finding.proven
        if finding is not None and finding.proven:
            why = f"as a part owner it signed a receipt that does not hold (round {a.round_id} part {owner.part}: {finding.why})"
            barred = run.checks.bar_on_proof(owner.public_key, why)
            outcome: Literal["barred", "already barred", "accused"] = "barred" if barred else "already barred"
        else:
            where = origin_of(request.remote)
            accuser = where.address if where is not None else f"key {public_key}"
            barred = run.checks.accuse(owner.public_key, accuser, run.run_id) is not None
            outcome = "barred" if barred else "accused"
        log.warning(
            "run %s: %s complains of part owner %s in round %s (%s): %s",
            run.run_id,
            msg.peer_id,
            msg.owner,
            a.round_id,
            "proven: barred" if proven and barred else outcome,
            msg.why,
        )
        if barred:
            for peer in [p for p in run.peers.values() if p.public_key == owner.public_key]:
                run.remove(peer.peer_id)
            run.maybe_form(time.time())
        return json_reply(ComplaintReply(outcome=outcome, proven=proven))

    async def pull(self, request: web.Request) -> web.Response:
        """A member's report of another whose copy pointed against the others' terms in a first phase, with
        the signed receipts that show it (tracker/pulls.py): checked and recomputed here; enough such rounds
        from enough reporters bar the member's key."""
        run, msg, public_key = await self._signed(request, PullReport)
        a = msg.assignment
        self._member_round(run, a, msg.peer_id, public_key, msg.tag)
        if a.phase != 0 or msg.tag != round_tag("grad", 0):
            raise ApiError(400, f"a pull is reported of a first phase's {round_tag('grad', 0)} round only")
        members = [m.peer_id for m in a.members]
        accused = next((m for m in a.members if m.peer_id == msg.member), None)
        if accused is None or accused.peer_id == msg.peer_id or accused.weight <= 0:
            raise ApiError(400, f"peer {msg.member} is no other member of round {a.round_id} with a weight")
        held = self._pull_receipts(run, msg)
        clip = run.spec.averaging.clip_multiple
        if len(held) < receipts.PULL_PARTS:
            raise ApiError(422, f"a pull is shown by the receipts of {receipts.PULL_PARTS} parts or more")
        cos = receipts.alignment(list(held.values()), members.index(msg.member), clip)
        threshold = receipts.pull_cos(run.spec.averaging.local)
        if cos is None or cos >= threshold:
            shown = "no cosine" if cos is None else f"a cosine of {cos:.3f}"
            raise ApiError(
                422,
                f"the receipts give {msg.member}'s copy {shown} with the others' terms, not below {threshold}",
            )
        where = origin_of(request.remote)
        reporter = where.address if where is not None else f"key {public_key}"
        outcome: Literal["barred", "already barred", "counted"] = "counted"
        if accused.public_key in run.checks.barred_keys():
            outcome = "already barred"
        elif run.checks.pulls.report(accused.public_key, a.step, reporter):
            why = (
                f"its copies pointed against the other members' in {run.checks.pulls.rounds(accused.public_key)} "
                f"rounds within {PULL_WINDOW} steps (cosine {cos:.2f} at step {a.step}), as part owners' "
                "signed receipts show"
            )
            run.checks.bar_on_proof(accused.public_key, why)
            outcome = "barred"
        log.warning(
            "run %s: %s reports member %s of round %s pulling against the others (cosine %.3f): %s",
            run.run_id,
            msg.peer_id,
            msg.member,
            a.round_id,
            cos,
            outcome,
        )
        if outcome == "barred":
            for peer in [p for p in run.peers.values() if p.public_key == accused.public_key]:
                run.remove(peer.peer_id)
            run.maybe_form(time.time())
        return json_reply(PullReply(outcome=outcome, alignment=cos))

    @staticmethod
    def _pull_receipts(run: RunState, msg: PullReport) -> dict[int, tuple[receipts.Receipt, int]]:
        """The report's receipts, by part (with the owner's index): each of a part owned by neither the
        reporter nor the accused, signed by its owner and sound by its own arithmetic (else 422)."""
        a = msg.assignment
        members = [m.peer_id for m in a.members]
        owners = {m.part: m for m in a.members if m.part >= 0}
        uniform = all(m.weight == 0 for m in a.members)
        weights = [1.0 if uniform else float(m.weight) for m in a.members]
        held: dict[int, tuple[receipts.Receipt, int]] = {}
        for raw in msg.receipts:
            try:
                r = receipts.Receipt.parse(bytes.fromhex(raw), len(members))
            except (ValueError, ProtocolError) as exc:
                raise ApiError(422, f"a receipt of the report is not one: {exc}") from None
            owner = owners.get(r.part)
            if owner is None or owner.peer_id in (msg.peer_id, msg.member) or r.part in held:
                raise ApiError(
                    422, f"part {r.part}'s receipt is not one of a part owned by neither reporter nor accused"
                )
            try:
                r.verify(owner.public_key, run.run_id, f"{a.round_id}/{msg.tag}")
            except AuthError as exc:
                raise ApiError(422, f"part {r.part}'s receipt is not its owner's: {exc}") from None
            finding = receipts.check(
                r,
                part=r.part,
                owner=members.index(owner.peer_id),
                weights=weights,
                clip_multiple=run.spec.averaging.clip_multiple,
                codec=Codec.parse(run.spec.averaging.codec),
                shared=False,
            )
            if finding is not None:
                raise ApiError(422, f"part {r.part}'s receipt does not hold ({finding.why}): complain of it")
            held[r.part] = (r, members.index(owner.peer_id))
        return held

    async def verdicts(self, request: web.Request) -> web.Response:
        """A member's failed parts of a round; answered with every member's (tracker/verdicts.py)."""
        run, msg, public_key = await self._signed(request, RoundVerdict)
        a = msg.assignment
        self._member_round(run, a, msg.peer_id, public_key, msg.tag)
        if any(p >= a.parts for p in msg.failed):
            raise ApiError(400, f"round {a.round_id} has {a.parts} parts")
        # (a later phase: one board for the cluster's columns, which make one mean; tracker/verdicts.py)
        columns = {b.round_id: b for b in run.rounds.columns(a)} or {a.round_id: a}
        key = a.round_id if a.phase == 0 else f"{a.run_id}.{a.step}.{a.phase}.c{a.cluster}.{a.seed:016x}"
        told = await run.verdicts.report(
            f"{key}/{msg.tag}",
            frozenset(m.peer_id for b in columns.values() for m in b.members),
            msg.peer_id,
            msg.failed,
            column=a.round_id,
            spoiled=msg.spoiled,
            deadline=a.deadline if a.phase > 0 else 0.0,
        )
        elsewhere = [
            ColumnParts(parts=columns[c].parts, part_weights=columns[c].part_weights, failed=parts)
            for c, parts in told.elsewhere.items()
            if c in columns
        ]
        return json_reply(
            RoundVerdicts(
                failed=told.failed,
                reported=told.reported,
                late=told.late,
                elsewhere=elsewhere,
                spoiled=told.spoiled,
            )
        )

    async def donors(self, request: web.Request) -> web.Response:
        """The state donors; ``?without=PEER``: that peer's snapshots are not counted (a peer catching up
        asks without its own: with one other peer serving, that one is then the run's only donor)."""
        without = request.query.get("without")
        if without is not None and not 0 < len(without) <= 64:
            raise ApiError(400, "without= names one peer id (1 to 64 characters)")
        return json_reply(self.tracker.run_of(request).state.donors(without=without))

    async def watch_step(self, request: web.Request) -> web.Response:
        """A long-poll: answers once step ``step`` closed or the run passed it (or after ``wait_s``)."""
        run = self.tracker.run_of(request).state
        step = query_number(request, "step", int, 0, MAX_INT)
        wait_s = min(
            self.config.long_poll_s, query_number(request, "wait_s", float, 0.0, 3600.0, default=0.0)
        )
        return json_reply(await wait_close(run, step, wait_s))
