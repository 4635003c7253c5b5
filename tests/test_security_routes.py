"""Authentication end to end: every route of the tracker and of a volunteer's peer server, walked from the
live aiohttp routers, refuses requests without or with wrong credentials with 401/403 and a sentence.

The table below has one entry per route. A route is either public (with the reason it may be) or carries
attack cases; each attack is a real HTTP request built from the protocol's own signing code (the way a
hostile peer would build it) against a real tracker / peer server on 127.0.0.1:0, and every route also
gets one correctly signed request that must NOT be refused (so a refusal is due to the credential, not to
a broken request). A route added without a table entry fails ``test_every_route_is_in_the_table``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web

from crowdtrain.protocol import receipts
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.codecs import Codec, Compressor
from crowdtrain.protocol.credentials import SigningKey, issue_credential, request_bytes, sign_assignment
from crowdtrain.protocol.messages import (
    PEER_PROTOCOL,
    Complaint,
    Credential,
    CutCall,
    GroupAssignment,
    GroupMember,
    Heartbeat,
    JoinRequest,
    LeaveRequest,
    PullReport,
    ReadyRequest,
    RoundVerdict,
    SpotCheckVerdict,
    StateDeclare,
    StateVersion,
    encode,
)
from crowdtrain.protocol.peerauth import HEADER_CREDENTIAL, HEADER_SIGNATURE, HEADER_TIME, sign_headers
from crowdtrain.tracker.auth import HEADER_SESSION_MAC
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from crowdtrain.volunteer.averaging import Averager, AveragingConfig
from crowdtrain.volunteer.averaging.wire import HEADER_ELEMENTS, HEADER_WEIGHT
from crowdtrain.volunteer.peer_server import PeerServer
from crowdtrain.volunteer.state.config import StateConfig
from crowdtrain.volunteer.state.serve import StateServer
from tests.frames import encode_frame
from tests.sim import make_run_create
from tests.snapshots import make_snapshot

JOIN_TOKEN = "private-join-token-0123456789"
N = 1000  # values in the all-reduce vector (one part)


# ---------------------------------------------------------------------------------------------- fixtures


@dataclass
class Member:
    """A peer that joined a run on the real tracker: its key and tracker-signed credential."""

    key: SigningKey
    peer_id: str
    credential: Credential


@dataclass
class World:
    tracker: Any
    public: str  # run ids
    private: str
    other: str  # a second public run: its credentials must not work in ``public``
    members: dict[
        str, Member
    ]  # in ``public``: "a" (owner), "b" (round member), "c" (run member, not in round)
    stranger: Member  # a member of ``other``
    server: PeerServer
    averager: Averager
    state_hash: str
    http: aiohttp.ClientSession
    round_id: str = "r-now"  # the live all-reduce round on the owner "a"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"


async def join(client: TrackerClient, run_id: str, token: str | None = None) -> Member:
    key = SigningKey()
    joined = await client.join(
        run_id, JoinRequest(public_key=key.public_hex, token=token, peer_protocol=PEER_PROTOCOL)
    )
    return Member(key, joined.peer_id, joined.credential)


@pytest.fixture
async def world(tmp_path):
    async with serve(TrackerConfig()) as tracker:
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as admin:
            public = (await admin.create_run(make_run_create("public run"))).run_id
            private = (await admin.create_run(make_run_create("private run", join_token=JOIN_TOKEN))).run_id
            other = (await admin.create_run(make_run_create("other run"))).run_id
            members = {name: await join(admin, public) for name in "abc"}
            stranger = await join(admin, other)
        a = members["a"]
        averager = Averager(
            run_id=public,
            tracker_public_key=tracker.public_key,
            peer_id=a.peer_id,
            key=a.key,
            credential=a.credential,
            config=AveragingConfig(clip_multiple=0.0, assignment_wait_s=0.5),
        )
        state = StateServer(run_id=public, tracker_public_key=tracker.public_key, config=StateConfig())
        snap = make_snapshot(
            tmp_path,
            run_id=public,
            step=3,
            recipe="mlp",
            args={},
            model_state={"w": torch.ones(1000)},
            optimizer_state={"state": {}, "param_groups": []},
            scheduler_state=None,
            range_bytes=64 << 10,
        )
        state.publish(snap)
        server = PeerServer("127.0.0.1", 0)
        server.peer_id = a.peer_id
        server.add_routes(averager.routes())
        server.add_routes(state.routes())
        await server.start()
        try:
            async with aiohttp.ClientSession() as http:
                yield World(
                    tracker,
                    public,
                    private,
                    other,
                    members,
                    stranger,
                    server,
                    averager,
                    snap.content_hash,
                    http,
                )
        finally:
            await averager.close()
            await server.stop()


async def call(
    w: World, method: str, url: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, str]:
    """One request; (status, the refusal's sentence or "")."""
    async with w.http.request(method, url, headers=headers, data=body) as resp:
        raw = await resp.read()
        if resp.status in (401, 403):
            return resp.status, _sentence(raw)
        return resp.status, ""


def _sentence(raw: bytes) -> str:
    import json

    return json.loads(raw)["error"]


def expired(w: World, m: Member, run_id: str | None = None) -> Credential:
    return issue_credential(w.tracker.signer, run_id or w.public, m.peer_id, m.key.public_hex, -10.0)


def foreign(m: Member, run_id: str) -> Credential:
    """A credential in the right shape, signed by a key that is not this tracker's."""
    return issue_credential(SigningKey(), run_id, m.peer_id, m.key.public_hex, 3600.0)


def stale_headers(key: SigningKey, cred: Credential, purpose: str, *fields: str | int) -> dict[str, str]:
    """Correctly signed, but at a time 10 minutes ago (a recorded request replayed later)."""
    stamp = f"{time.time() - 600:.3f}"
    return {
        HEADER_CREDENTIAL: base64.urlsafe_b64encode(encode(cred)).decode(),
        HEADER_TIME: stamp,
        HEADER_SIGNATURE: key.sign(request_bytes(purpose, stamp, *fields)),
    }


# ---------------------------------------------------------------------------------------------- tracker


Attack = Callable[[World], Awaitable[tuple[int, str]]]


def admin_route(
    path: str | Callable[[World], str], body: Callable[[World], bytes], method: str = "POST"
) -> dict[str, tuple[int, Attack]]:
    def with_auth(value: str | None) -> Attack:
        async def attack(w: World) -> tuple[int, str]:
            headers = {"Content-Type": "application/json"}
            if value is not None:
                headers["Authorization"] = value
            where = path(w) if callable(path) else path
            return await call(w, method, w.tracker.url + where, headers, body(w))

        return attack

    return {
        "no Authorization header": (401, with_auth(None)),
        "wrong admin token": (403, with_auth("Bearer not-the-admin-token-at-all")),
        "admin token with the wrong scheme": (403, with_auth("Basic " + "x" * 24)),
        "admin token of another tracker": (403, with_auth("Bearer " + "A" * 32)),
    }


def run_create_body(w: World) -> bytes:
    return encode(make_run_create("created by the attacker"))


def no_body(w: World) -> bytes:
    return b""


def dataset_body(w: World) -> bytes:
    return b'{"infohash": "' + b"ab" * 20 + b'", "name": "attacker"}'


def signed_route(
    suffix: str, body: Callable[[Member], Any], query: str = "", *, world_body: bool = False
) -> dict[str, tuple[int, Attack]]:
    """Attacks on a volunteer route of the tracker (signed with peerauth over path + body hash); with
    ``world_body`` the body is ``body(world, member)``."""

    def body_for(w: World, m: Member) -> bytes:
        return encode(body(w, m) if world_body else body(m))  # type: ignore[call-arg]

    def path(run_id: str) -> str:
        return f"/api/v1/runs/{run_id}/{suffix}"

    def send(
        headers_for: Callable[[World, Member, str, str], dict[str, str]],
        *,
        run: Callable[[World], str] = lambda w: w.public,
        who: Callable[[World], Member] = lambda w: w.members["b"],
        body_of: Callable[[World, Member], bytes] | None = None,
    ) -> Attack:
        async def attack(w: World) -> tuple[int, str]:
            m = who(w)
            data = body_of(w, m) if body_of else body_for(w, m)
            p = path(run(w))
            headers = headers_for(w, m, p, hashlib.sha256(data).hexdigest())
            headers["Content-Type"] = "application/json"
            return await call(w, "POST", w.tracker.url + p + query, headers, data)

        return attack

    def honest(w: World, m: Member, p: str, digest: str) -> dict[str, str]:
        return sign_headers(m.key, m.credential, "tracker", p, digest)

    other_path = "/leave" if suffix != "leave" else "/heartbeat"
    return {
        "no authentication headers": (401, send(lambda w, m, p, d: {})),
        "credential without a signature": (
            401,
            send(lambda w, m, p, d: {k: v for k, v in honest(w, m, p, d).items() if k != HEADER_SIGNATURE}),
        ),
        "signature by another key": (
            401,
            send(lambda w, m, p, d: sign_headers(w.members["c"].key, m.credential, "tracker", p, d)),
        ),
        "credential of another run": (
            401,
            send(
                lambda w, m, p, d: sign_headers(m.key, m.credential, "tracker", p, d),
                who=lambda w: w.stranger,
            ),
        ),
        "expired credential": (
            401,
            send(lambda w, m, p, d: sign_headers(m.key, expired(w, m), "tracker", p, d)),
        ),
        "credential signed by another tracker": (
            401,
            send(lambda w, m, p, d: sign_headers(m.key, foreign(m, w.public), "tracker", p, d)),
        ),
        "signature of another route replayed": (
            401,
            send(
                lambda w, m, p, d: sign_headers(
                    m.key, m.credential, "tracker", p.rsplit("/", 1)[0] + other_path, d
                )
            ),
        ),
        "signature of another body": (
            401,
            send(lambda w, m, p, d: sign_headers(m.key, m.credential, "tracker", p, "0" * 64)),
        ),
        "signature from 10 minutes ago": (
            401,
            send(lambda w, m, p, d: stale_headers(m.key, m.credential, "tracker", p, d)),
        ),
        "signature for the all-reduce purpose": (
            401,
            send(lambda w, m, p, d: sign_headers(m.key, m.credential, "allreduce", p, d)),
        ),
        "wrong session MAC": (
            401,
            send(
                lambda w, m, p, d: {
                    **{k: v for k, v in honest(w, m, p, d).items() if k != HEADER_SIGNATURE},
                    HEADER_SESSION_MAC: "0" * 64,
                }
            ),
        ),
        "body speaks for another peer": (
            401,
            send(honest, body_of=lambda w, m: body_for(w, w.members["c"])),
        ),
        "valid": (0, send(honest)),
    }


def join_private(token: str | None) -> Attack:
    async def attack(w: World) -> tuple[int, str]:
        body = encode(
            JoinRequest(public_key=SigningKey().public_hex, token=token, peer_protocol=PEER_PROTOCOL)
        )
        return await call(
            w,
            "POST",
            f"{w.tracker.url}/api/v1/runs/{w.private}/join",
            {"Content-Type": "application/json"},
            body,
        )

    return attack


TRACKER_PUBLIC = {
    (
        "GET",
        "/announce",
    ): "BitTorrent clients announce without accounts (BEP 3); info-hashes must be registered",
    ("GET", "/scrape"): "BitTorrent scrape (BEP 48) is public by design",
    ("GET", "/healthz"): "liveness probe: says only ok and the number of runs",
    ("GET", "/metrics"): "Prometheus counters, no secrets; bind the tracker privately to hide them",
    ("GET", "/api/v1/runs"): "listing runs is public; a private run hides nothing but needs a token to join",
    ("GET", "/api/v1/runs/{run_id}"): "the spec carries the tracker's public key volunteers verify with",
    ("GET", "/api/v1/runs/{run_id}/torrent"): "the data set's torrent is public (any BitTorrent client)",
    (
        "GET",
        "/api/v1/runs/{run_id}/tokenizer",
    ): "the data set's tokenizer is public like its torrent (its sha256 is in the public spec)",
    ("GET", "/api/v1/runs/{run_id}/status"): "progress of the run, shown by `crowdtrain status`",
    (
        "GET",
        "/api/v1/runs/{run_id}/step",
    ): "a long-poll for a step's close: the global step and one flag, public",
    ("GET", "/api/v1/runs/{run_id}/state/donors"): "donor addresses; every state request is signed anyway",
    ("GET", "/api/v1/runs/{run_id}/history"): "the closed steps' samples and loss, drawn by the run's page",
    ("GET", "/"): "the public runs' list (private runs are not on it)",
    (
        "GET",
        "/runs/{run_id}",
    ): "a public run's page; a private run's needs its token (test_web_page.py checks the refusal)",
}

TRACKER_AUTH: dict[tuple[str, str], dict[str, tuple[int, Attack]]] = {
    ("POST", "/api/v1/datasets"): admin_route("/api/v1/datasets", dataset_body),
    ("POST", "/api/v1/runs"): admin_route("/api/v1/runs", run_create_body),
    ("POST", "/api/v1/runs/{run_id}/close"): admin_route(lambda w: f"/api/v1/runs/{w.public}/close", no_body),
    ("DELETE", "/api/v1/runs/{run_id}"): admin_route(
        lambda w: f"/api/v1/runs/{w.public}", no_body, method="DELETE"
    ),
    ("POST", "/api/v1/runs/{run_id}/join"): {
        "private run without a join token": (401, join_private(None)),
        "private run with a wrong join token": (403, join_private("not-the-token-0123456789")),
        "valid": (0, join_private(JOIN_TOKEN)),
    },
    ("POST", "/api/v1/runs/{run_id}/heartbeat"): signed_route(
        "heartbeat", lambda m: Heartbeat(peer_id=m.peer_id, step=0, samples=0, samples_per_s=0.0)
    ),
    ("POST", "/api/v1/runs/{run_id}/ready"): signed_route(
        "ready", lambda m: ReadyRequest(peer_id=m.peer_id, step=0, weight=0), query="?wait_s=0"
    ),
    ("POST", "/api/v1/runs/{run_id}/state"): signed_route(
        "state",
        lambda m: StateDeclare(
            peer_id=m.peer_id, state=StateVersion(step=0, content_hash="ab" * 32, size=10)
        ),
    ),
    ("POST", "/api/v1/runs/{run_id}/leave"): signed_route("leave", lambda m: LeaveRequest(peer_id=m.peer_id)),
    # (the valid verdict is refused 409: no check was drawn for it; what matters is that it passed the gate)
    ("POST", "/api/v1/runs/{run_id}/spotcheck"): signed_route(
        "spotcheck",
        lambda m: SpotCheckVerdict(peer_id=m.peer_id, step=0, suspect="0" * 16, outcome="mismatch"),
    ),
    # (the valid call is a vote that completes the set: the owner "a" is cut at once)
    ("POST", "/api/v1/runs/{run_id}/cut"): signed_route(
        "cut",
        lambda w, m: CutCall(
            peer_id=m.peer_id, assignment=cut_round(w, m), tag="grad", owner=w.members["a"].peer_id
        ),
        world_body=True,
    ),
    # (the valid verdict waits for the round's other member, at most tracker/verdicts.py's WAIT_S)
    ("POST", "/api/v1/runs/{run_id}/verdicts"): signed_route(
        "verdicts",
        lambda w, m: RoundVerdict(peer_id=m.peer_id, assignment=cut_round(w, m), tag="grad", failed=[]),
        world_body=True,
    ),
    # (the valid complaint is an accusation: the receipt "a" signed holds by its own arithmetic)
    ("POST", "/api/v1/runs/{run_id}/complaint"): signed_route(
        "complaint",
        lambda w, m: Complaint(
            peer_id=m.peer_id,
            assignment=cut_round(w, m),
            tag="grad",
            owner=w.members["a"].peer_id,
            receipt=consistent_receipt(w, m).hex(),
            why="the receipt says this member's copy has norm 2, not 1",
        ),
        world_body=True,
    ),
    # (the valid report is refused 422: the only receipt is the accused's own part's)
    ("POST", "/api/v1/runs/{run_id}/pull"): signed_route(
        "pull",
        lambda w, m: PullReport(
            peer_id=m.peer_id,
            assignment=cut_round(w, m),
            tag="grad",
            member=w.members["a"].peer_id,
            receipts=[consistent_receipt(w, m).hex()],
        ),
        world_body=True,
    ),
}


def consistent_receipt(w: World, m: Member) -> bytes:
    """A receipt "a" signs for its part of :func:`cut_round`: both copies of norm 1 and weight 1, the answer
    their mean with norm 1 (each term ½ of it): nothing in it is wrong by itself."""
    lines = (receipts.Line(1.0, 1.0, 0.5, 0), receipts.Line(1.0, 1.0, 0.5, 1))
    r = receipts.Receipt(0, False, 1.0, b"\0" * 16, lines)
    return r.signed(w.members["a"].key, w.public, f"cut-{m.peer_id}/grad").to_bytes()


def cut_round(w: World, m: Member) -> GroupAssignment:
    """A round the tracker signed: "a" owns its only part, ``m`` is the other member."""
    a = w.members["a"]
    members = [
        GroupMember(peer_id=a.peer_id, address="127.0.0.1:1", public_key=a.key.public_hex, weight=1, part=0),
        GroupMember(peer_id=m.peer_id, address=None, public_key=m.key.public_hex, weight=1, part=-1),
    ]
    unsigned = GroupAssignment(
        run_id=w.public,
        round_id=f"cut-{m.peer_id}",
        step=1,
        members=members,
        parts=1,
        average_params=False,
        deadline=time.time() + 30,
        seed=0,
        signature="",
    )
    return sign_assignment(w.tracker.signer, unsigned)


# ---------------------------------------------------------------------------------------------- peer server


def allreduce_attack(
    *,
    who: str = "b",
    cred: Callable[[World, Member], Credential] = lambda w, m: m.credential,
    sign_key: Callable[[World, Member], SigningKey] = lambda w, m: m.key,
    signed_round: str | None = None,  # sign for this round key instead of the one posted to
    stale: bool = False,
    headers_off: bool = False,
) -> Attack:
    async def attack(w: World) -> tuple[int, str]:
        m = w.stranger if who == "stranger" else w.members[who]
        key = f"{w.round_id}/grad"
        fields = (signed_round or key, 0, "1.0", str(N))
        make = stale_headers if stale else sign_headers
        headers = {} if headers_off else make(sign_key(w, m), cred(w, m), "allreduce", *fields)
        headers |= {HEADER_WEIGHT: "1.0", HEADER_ELEMENTS: str(N), "Content-Type": "application/octet-stream"}
        body = encode_frame(np.full(N, 1.0, dtype=np.float32), Codec.NONE, Compressor())
        return await call(w, "POST", f"{w.peer_url}/v1/allreduce/{key}/0", headers, body)

    return attack


def state_attack(
    suffix: str,
    *,
    who: str = "c",
    cred: Callable[[World, Member], Credential] = lambda w, m: m.credential,
    sign_key: Callable[[World, Member], SigningKey] = lambda w, m: m.key,
    signed_hash: str | None = None,
    signed_field: str | None = None,
    stale: bool = False,
    headers_off: bool = False,
) -> Attack:
    async def attack(w: World) -> tuple[int, str]:
        m = w.stranger if who == "stranger" else w.members[who]
        extra = {"Range": "bytes=0-99"} if suffix == "" else {}
        field = "manifest" if suffix else extra["Range"]
        make = stale_headers if stale else sign_headers
        headers = (
            {}
            if headers_off
            else make(sign_key(w, m), cred(w, m), "state", signed_hash or w.state_hash, signed_field or field)
        )
        return await call(w, "GET", f"{w.peer_url}/v1/state/{w.state_hash}{suffix}", headers | extra)

    return attack


def spot_attack(
    *,
    who: str = "c",
    cred: Callable[[World, Member], Credential] = lambda w, m: m.credential,
    sign_key: Callable[[World, Member], SigningKey] = lambda w, m: m.key,
    signed_step: int = 3,
    stale: bool = False,
    headers_off: bool = False,
) -> Attack:
    async def attack(w: World) -> tuple[int, str]:
        m = w.stranger if who == "stranger" else w.members[who]
        make = stale_headers if stale else sign_headers
        headers = {} if headers_off else make(sign_key(w, m), cred(w, m), "spotcheck", signed_step)
        return await call(w, "GET", f"{w.peer_url}/v1/spotcheck/3", headers)

    return attack


def average_attack(
    *,
    who: str = "c",
    cred: Callable[[World, Member], Credential] = lambda w, m: m.credential,
    sign_key: Callable[[World, Member], SigningKey] = lambda w, m: m.key,
    signed_step: int = 3,
    signed_what: str = "grad",
    stale: bool = False,
    headers_off: bool = False,
) -> Attack:
    async def attack(w: World) -> tuple[int, str]:
        m = w.stranger if who == "stranger" else w.members[who]
        make = stale_headers if stale else sign_headers
        headers = {} if headers_off else make(sign_key(w, m), cred(w, m), "average", signed_step, signed_what)
        return await call(w, "GET", f"{w.peer_url}/v1/average/3/grad", headers)

    return attack


def peer_cases(make: Callable[..., Attack], **kw: Any) -> dict[str, tuple[int, Attack]]:
    return {
        "no authentication headers": (401, make(headers_off=True, **kw)),
        "signature by another key": (401, make(sign_key=lambda w, m: w.members["a"].key, **kw)),
        "credential of another run": (401, make(who="stranger", **kw)),
        "expired credential": (401, make(cred=lambda w, m: expired(w, m), **kw)),
        "credential signed by another tracker": (401, make(cred=lambda w, m: foreign(m, w.public), **kw)),
        "signature from 10 minutes ago": (401, make(stale=True, **kw)),
    }


PEER_PUBLIC = {
    ("GET", "/v1/ping"): "the tracker's reachability check; answers only this peer's id",
    ("GET", "/v1/awake"): "asked by a round's members before they vote to cut it: 204, says nothing",
}

PEER_AUTH: dict[tuple[str, str], dict[str, tuple[int, Attack]]] = {
    ("POST", "/v1/allreduce/{round_id}/{tag}/{part}"): {
        **peer_cases(allreduce_attack),
        "signature of another round replayed": (401, allreduce_attack(signed_round="r-earlier/grad")),
        "run member outside the round's group": (403, allreduce_attack(who="c")),
        "valid": (0, allreduce_attack(who="b")),
    },
    ("GET", "/v1/state/{content_hash}/manifest"): {
        **peer_cases(state_attack, suffix="/manifest"),
        "signature for another state replayed": (401, state_attack("/manifest", signed_hash="cd" * 32)),
        "valid": (0, state_attack("/manifest")),
    },
    ("GET", "/v1/state/{content_hash}"): {
        **peer_cases(state_attack, suffix=""),
        "signature for another state replayed": (401, state_attack("", signed_hash="cd" * 32)),
        "signature for another range replayed": (401, state_attack("", signed_field="bytes=100-199")),
        "valid": (0, state_attack("")),
    },
    ("GET", "/v1/spotcheck/{step}"): {
        **peer_cases(spot_attack),
        "signature for another step replayed": (401, spot_attack(signed_step=2)),
        "valid": (0, spot_attack()),
    },
    ("GET", "/v1/average/{step}/{what}"): {
        **peer_cases(average_attack),
        "signature for another step replayed": (401, average_attack(signed_step=2)),
        "signature for the parameters replayed for the gradient": (401, average_attack(signed_what="params")),
        "valid": (0, average_attack()),
    },
}


# ---------------------------------------------------------------------------------------------- tests


def live_routes(app: web.Application) -> set[tuple[str, str]]:
    out = set()
    for route in app.router.routes():
        if route.method == "HEAD":  # aiohttp's automatic HEAD of a GET route: same handler, same checks
            continue
        assert route.resource is not None
        out.add((route.method, route.resource.canonical))
    return out


async def test_every_route_is_in_the_table(world):
    tracker_routes = live_routes(world.tracker.app())
    assert tracker_routes == set(TRACKER_PUBLIC) | set(TRACKER_AUTH), (
        "a tracker route has no entry in the security table (public with a reason, or attack cases): "
        f"{sorted(tracker_routes ^ (set(TRACKER_PUBLIC) | set(TRACKER_AUTH)))}"
    )
    assert not set(TRACKER_PUBLIC) & set(TRACKER_AUTH)
    peer_routes = live_routes(world.server._app)
    assert peer_routes == set(PEER_PUBLIC) | set(PEER_AUTH), (
        "a peer-server route has no entry in the security table: "
        f"{sorted(peer_routes ^ (set(PEER_PUBLIC) | set(PEER_AUTH)))}"
    )


def check_refusals(results: dict[str, tuple[int, int, str]]) -> None:
    failures = []
    for case, (want, status, sentence) in results.items():
        if want == 0:
            if status in (401, 403):
                failures.append(f"{case}: a correctly signed request was refused with {status}: {sentence}")
        elif status != want:
            failures.append(f"{case}: expected {want}, got {status}")
        elif len(sentence.split()) < 4:
            failures.append(f"{case}: refusal {sentence!r} is not a sentence")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("route", sorted(TRACKER_AUTH), ids=lambda r: f"{r[0]} {r[1]}")
async def test_tracker_route_refuses_wrong_credentials(world, route):
    results = {}
    for case, (want, attack) in TRACKER_AUTH[route].items():
        status, sentence = await attack(world)
        results[case] = (want, status, sentence)
    check_refusals(results)


@pytest.mark.parametrize("route", sorted(PEER_AUTH), ids=lambda r: f"{r[0]} {r[1]}")
async def test_peer_route_refuses_wrong_credentials(world, route):
    a, b = world.members["a"], world.members["b"]
    # a live round on the owner "a": "a" owns the only part, "b" is a client-mode member with 4 samples
    assignment = sign_assignment(
        world.tracker.signer,
        GroupAssignment(
            run_id=world.public,
            round_id=world.round_id,
            step=1,
            members=[
                GroupMember(
                    peer_id=a.peer_id,
                    address=f"127.0.0.1:{world.server.port}",
                    public_key=a.key.public_hex,
                    weight=4,
                    part=0,
                ),
                GroupMember(peer_id=b.peer_id, address=None, public_key=b.key.public_hex, weight=4, part=-1),
            ],
            parts=1,
            average_params=False,
            deadline=time.time() + 30,
            seed=0,
            signature="",
        ),
    )
    own = np.full(N, 2.0, dtype=np.float32)
    is_allreduce = route[1].startswith("/v1/allreduce")
    owner = asyncio.create_task(world.averager.allreduce(assignment, own, 4.0)) if is_allreduce else None
    results = {}
    for case, (want, attack) in PEER_AUTH[route].items():  # "valid" comes last: it settles the round
        status, sentence = await attack(world)
        results[case] = (want, status, sentence)
    check_refusals(results)
    if owner is not None:
        result = await asyncio.wait_for(owner, 30)
        # nothing refused left a trace in the round: only b's copy (1.0, weight 1) was averaged with a's
        assert result.rejected == () and result.dropped == () and result.clipped == ()
        np.testing.assert_allclose(result.values, np.full(N, (4 * 2.0 + 1 * 1.0) / 5), rtol=1e-6)
