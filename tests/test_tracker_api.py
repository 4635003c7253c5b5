"""The tracker's JSON API on a real server (127.0.0.1:0): each endpoint, and each bad input with the exact
sentence the client sees."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import logging
import re

import aiohttp
import pytest

from crowdtrain.protocol import bencode
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import SigningKey, verify_credential
from crowdtrain.protocol.errors import TrackerError, TrackerUnreachable
from crowdtrain.protocol.limits import MAX_TOKENIZER_BASE64, MAX_TORRENT_BYTES
from crowdtrain.protocol.messages import PEER_PROTOCOL, Heartbeat, JoinRequest, ReadyRequest, encode, replace
from crowdtrain.protocol.peerauth import sign_headers, sign_session_headers
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from tests.harness import closed_port, until
from tests.sim import PingServer, SimVolunteer, make_run_create, make_torrent

pytestmark = pytest.mark.tracker_config(max_body_bytes=64 * 1024)


@pytest.fixture
async def run_id(admin):
    return (await admin.create_run(make_run_create(target_batch_size=100))).run_id


async def raw(tracker, method, path, body=None, headers=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, tracker.url + path, data=body, headers=headers or {}) as r:
            return r.status, await r.read()


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


async def test_healthz_and_metrics(tracker, admin, run_id):
    assert await admin.healthz() == {"ok": True, "runs": 1}
    status, body = await raw(tracker, "GET", "/metrics")
    text = body.decode()
    assert status == 200
    assert 'crowdtrain_tracker_requests_total{route="/api/v1/runs",status="201"} 1.0' in text
    assert "crowdtrain_tracker_runs 1.0" in text
    assert "crowdtrain_tracker_peers_online 0.0" in text


async def test_create_get_list_and_torrent(tracker, admin):
    torrent = make_torrent("set-a", b"a" * 50000)
    created = await admin.create_run(make_run_create("My First Run!", torrent, target_batch_size=512))
    assert created.run_id.startswith("my-first-run-")
    spec = await admin.get_spec(created.run_id)
    assert spec == created.spec
    assert spec.tracker_public_key == tracker.public_key
    assert spec.target_batch_size == 512
    assert spec.created_at > 0
    assert await admin.get_torrent(created.run_id) == torrent
    runs = await admin.list_runs()
    assert [(r.run_id, r.global_step, r.peers_online) for r in runs.runs] == [(created.run_id, 0, 0)]


async def test_create_needs_the_admin_token(tracker, run_id):
    body = encode(make_run_create())
    status, reply = await raw(tracker, "POST", "/api/v1/runs", body)
    assert (status, error_of(reply)) == (
        401,
        "this endpoint needs the tracker's admin token in an 'Authorization: Bearer <token>' header",
    )
    async with TrackerClient(tracker.url, admin_token="not-the-token-at-all") as c:
        with pytest.raises(TrackerError) as info:
            await c.create_run(make_run_create())
    assert info.value.status == 403
    assert str(info.value) == "the admin token is wrong; use the token the tracker printed when it started"


@pytest.mark.parametrize(
    ("mutate", "status", "message"),
    [
        (lambda d: b"{not json", 400, "RunCreate is not valid JSON: "),
        (
            lambda d: d.replace(b'"name":', b'"colour":"red","name":', 1),
            400,
            "Object contains unknown field `colour`",
        ),
        (
            lambda d: d.replace(b'"target_batch_size":100', b'"target_batch_size":"lots"'),
            400,
            "RunCreate: Expected `int`, got `str` - at `$.target_batch_size`",
        ),
        (
            lambda d: d.replace(b'"target_batch_size":100', b'"target_batch_size":0'),
            400,
            "RunCreate: target_batch_size must be at least 1, got 0",
        ),
        (
            lambda d: d.replace(b'"param_hash":"' + b"ab" * 32, b'"param_hash":"' + b"AB" * 32),
            400,
            "RunCreate: Expected `str` of 64 lowercase hex characters (or empty) - at `$.model.param_hash`",
        ),
        (
            lambda d: re.sub(rb'"infohash":"[0-9a-f]{40}"', b'"infohash":"XYZ"', d),
            400,
            "RunCreate: Expected `str` of 40 lowercase hex characters - at `$.dataset.infohash`",
        ),
        (  # a new run's body may carry a tokenizer beyond max_body_bytes; no more
            lambda d: io.BytesIO(b"x" * (65536 + MAX_TOKENIZER_BASE64 + 1)),  # (streamed: it is large)
            413,
            f"request body is larger than the tracker's limit of {65536 + MAX_TOKENIZER_BASE64} bytes",
        ),
    ],
)
async def test_create_refuses_bad_bodies(tracker, mutate, status, message):
    body = mutate(encode(make_run_create(target_batch_size=100)))
    got, reply = await raw(
        tracker, "POST", "/api/v1/runs", body, {"Authorization": f"Bearer {tracker.admin_token}"}
    )
    assert got == status
    assert message in error_of(reply)


async def test_a_torrent_of_the_largest_allowed_size_reaches_the_tracker_within_its_body_limit():
    """MAX_TORRENT_BYTES is the bound everywhere (make, publish, register, download); a RunCreate carrying
    one in base64 must fit the tracker's default request body, so it is judged on its merits (here: a
    torrent of another data set), not refused as too large. One byte more is refused with a sentence
    (by the tracker's torrent bound when its body limit is raised)."""
    good = make_run_create()
    pieces = b"\x01" * (20 * ((MAX_TORRENT_BYTES - 4096) // 20))  # piece hashes: nearly all of the bytes
    info = {b"name": "big", b"length": len(pieces) // 20 * 16384, b"piece length": 16384, b"pieces": pieces}
    big = bencode.encode({b"announce": "http://127.0.0.1/announce", b"info": info})
    assert MAX_TORRENT_BYTES - 8192 < len(big) <= MAX_TORRENT_BYTES
    too_big = big + b"x" * (MAX_TORRENT_BYTES + 1 - len(big))
    for config, torrent, status, text in (
        (TrackerConfig(), big, 400, f"RunCreate: dataset.infohash is {good.dataset.infohash}"),
        (
            TrackerConfig(max_body_bytes=8 << 20),
            too_big,
            400,
            f"RunCreate: torrent is {MAX_TORRENT_BYTES + 1} bytes, more than the {MAX_TORRENT_BYTES} bytes",
        ),
    ):
        async with (
            serve(config) as tracker,
            TrackerClient(tracker.url, admin_token=tracker.admin_token) as admin,
        ):
            with pytest.raises(TrackerError) as refused:
                await admin.create_run(replace(good, torrent=base64.b64encode(torrent).decode()))
        assert refused.value.status == status
        assert str(refused.value).startswith(text)


async def test_create_checks_the_torrent_against_the_info_hash(admin):
    good = make_run_create()
    other = make_torrent("other", b"y" * 100)
    bad = replace(good, torrent=base64.b64encode(other).decode())
    with pytest.raises(TrackerError) as info:
        await admin.create_run(bad)
    assert str(info.value).startswith(
        f"RunCreate: dataset.infohash is {good.dataset.infohash} but the torrent's"
    )
    with pytest.raises(TrackerError, match="RunCreate: torrent is not valid base64"):
        await admin.create_run(replace(good, torrent="***"))
    with pytest.raises(
        TrackerError, match=r"RunCreate: torrent is not a .torrent file \(bencode is malformed"
    ):
        await admin.create_run(replace(good, torrent=base64.b64encode(b"hello").decode()))
    with pytest.raises(TrackerError, match="RunCreate: join_token is required when join_policy is 'token'"):
        await admin.create_run(replace(good, join_policy="token"))
    with pytest.raises(TrackerError, match=r"model\.param_hash must be the 64-hex-character parameter hash"):
        await admin.create_run(replace(good, model=replace(good.model, param_hash="")))


async def test_unknown_run_and_unknown_route(tracker, admin):
    with pytest.raises(TrackerError) as info:
        await admin.get_spec("no-such-run")
    assert info.value.status == 404
    assert str(info.value) == "there is no run 'no-such-run' on this tracker; list runs with GET /api/v1/runs"
    status, body = await raw(tracker, "GET", "/api/v2/whatever")
    assert (status, error_of(body)) == (404, "no such endpoint: GET /api/v2/whatever")
    status, body = await raw(tracker, "DELETE", "/api/v1/runs")
    assert status == 405
    assert error_of(body) == "DELETE is not allowed on /api/v1/runs; use GET, HEAD, POST"


async def test_join_gives_a_credential_signed_by_the_tracker(admin, run_id, tracker):
    v = SimVolunteer(admin, run_id)
    joined = await v.join()
    verify_credential(joined.credential, tracker.public_key, run_id)
    assert joined.credential.public_key == v.key.public_hex
    assert joined.global_step == 0
    assert (joined.heartbeat_interval_s, joined.peer_ttl_s) == (2.0, 30.0)
    reply = await v.heartbeat(0, 10)
    assert (reply.samples, reply.target, reply.peers_online, reply.step_closed) == (10, 100, 1, False)
    assert reply.reachable is False  # client mode


async def test_join_rejects_bad_public_key_and_address(admin, run_id):
    with pytest.raises(TrackerError) as info:
        await admin.join(run_id, JoinRequest(public_key="zz", peer_protocol=PEER_PROTOCOL))
    assert (info.value.status, str(info.value)) == (
        400,
        "JoinRequest: Expected `str` of 64 lowercase hex characters - at `$.public_key`",
    )
    with pytest.raises(TrackerError) as info:
        await admin.join(
            run_id, JoinRequest(public_key="ab" * 32, address="nohost", peer_protocol=PEER_PROTOCOL)
        )
    assert str(info.value) == "address 'nohost' must be host:port with a port between 1 and 65535"


async def test_join_refuses_a_volunteer_of_another_peer_protocol_with_a_sentence(admin, run_id):
    """A build whose frames the others cannot read (a JoinRequest without ``peer_protocol`` is from one) is
    refused at the door instead of failing every round later."""
    for theirs, client in ((1, ""), (PEER_PROTOCOL + 1, "9.9.9")):
        with pytest.raises(TrackerError) as info:
            await admin.join(
                run_id,
                JoinRequest(public_key="ab" * 32, client_version=client, peer_protocol=theirs),
            )
        assert info.value.status == 409
        assert f"speaks peer protocol {theirs} but the peers of this tracker speak {PEER_PROTOCOL}" in str(
            info.value
        )
        assert "install crowdtrain" in str(info.value)
    status = await admin.status(run_id)
    assert status.peers_online == 0


async def test_private_run_checks_the_join_token(admin):
    run = await admin.create_run(make_run_create(join_token="s3cret-token"))
    assert run.spec.join_policy == "token"
    v = SimVolunteer(admin, run.run_id)
    with pytest.raises(TrackerError) as info:
        await v.join()
    assert (info.value.status, str(info.value)) == (
        401,
        f"run {run.run_id} is private; pass its join token (--token)",
    )
    with pytest.raises(TrackerError) as info:
        await v.join(token="guess")
    assert (info.value.status, str(info.value)) == (403, f"the join token for run {run.run_id} is wrong")
    assert (await v.join(token="s3cret-token")).peer_id


async def test_peer_requests_must_be_signed_by_the_credential_holder(tracker, admin, run_id):
    v = SimVolunteer(admin, run_id)
    await v.join()
    path = f"/api/v1/runs/{run_id}/heartbeat"
    body = encode(Heartbeat(peer_id=v.peer_id, step=0, samples=1, samples_per_s=1.0))
    digest = hashlib.sha256(body).hexdigest()

    status, reply = await raw(tracker, "POST", path, body)
    assert status == 401
    assert error_of(reply).startswith("request lacks the X-Crowdtrain-Credential, X-Crowdtrain-Time and")

    thief = SigningKey()  # a copied credential without its key
    status, reply = await raw(
        tracker, "POST", path, body, sign_headers(thief, v.joined.credential, "tracker", path, digest)
    )
    assert (status, error_of(reply)) == (401, "request carries an invalid signature")

    forged = replace(v.joined.credential, public_key=thief.public_hex)
    status, reply = await raw(
        tracker, "POST", path, body, sign_headers(thief, forged, "tracker", path, digest)
    )
    assert (status, error_of(reply)) == (401, "credential carries an invalid signature")

    tampered = encode(Heartbeat(peer_id=v.peer_id, step=0, samples=99, samples_per_s=1.0))
    status, reply = await raw(
        tracker, "POST", path, tampered, sign_headers(v.key, v.joined.credential, "tracker", path, digest)
    )
    assert (status, error_of(reply)) == (401, "request carries an invalid signature")

    other = (await admin.create_run(make_run_create("other"))).run_id
    other_path = f"/api/v1/runs/{other}/heartbeat"
    headers = sign_headers(v.key, v.joined.credential, "tracker", other_path, digest)
    status, reply = await raw(tracker, "POST", other_path, body, headers)
    assert (status, error_of(reply)) == (401, f"credential is for run {run_id!r}, not {other!r}")

    w = SimVolunteer(admin, run_id)
    await w.join()
    spoof = encode(Heartbeat(peer_id=w.peer_id, step=0, samples=1, samples_per_s=1.0))
    headers = sign_headers(v.key, v.joined.credential, "tracker", path, hashlib.sha256(spoof).hexdigest())
    status, reply = await raw(tracker, "POST", path, spoof, headers)
    assert (status, error_of(reply)) == (401, f"credential is for peer {v.peer_id}, not {w.peer_id}")


async def test_session_mac_from_join_authenticates_cheaply(tracker, admin, run_id):
    v = SimVolunteer(admin, run_id)
    joined = await v.join()
    assert joined.session_key is not None and len(joined.session_key) == 64
    assert (await v.heartbeat(0, 3)).samples == 3  # the client uses the session key it got at join
    path = f"/api/v1/runs/{run_id}/heartbeat"
    body = encode(Heartbeat(peer_id=v.peer_id, step=0, samples=5, samples_per_s=1.0))
    digest = hashlib.sha256(body).hexdigest()
    cred = base64.urlsafe_b64encode(encode(joined.credential)).decode()
    good = sign_session_headers(joined.session_key, cred, path, digest)
    status, _ = await raw(tracker, "POST", path, body, good)
    assert status == 200
    wrong = sign_session_headers("00" * 32, cred, path, digest)
    status, reply = await raw(tracker, "POST", path, body, wrong)
    assert (status, error_of(reply)) == (401, "request carries an invalid session MAC")
    # another peer's session key does not work with this credential
    w = SimVolunteer(admin, run_id)
    other = await w.join()
    stolen = sign_session_headers(other.session_key, cred, path, digest)
    status, reply = await raw(tracker, "POST", path, body, stolen)
    assert (status, error_of(reply)) == (401, "request carries an invalid session MAC")


async def test_malformed_heartbeat_names_the_field(tracker, admin, run_id):
    v = SimVolunteer(admin, run_id)
    await v.join()
    path = f"/api/v1/runs/{run_id}/heartbeat"
    for body, message in [
        (b'{"peer_id": "x"', "Heartbeat is not valid JSON"),
        (
            json.dumps(
                {"peer_id": v.peer_id, "step": 0, "samples": 1, "samples_per_s": 1.0, "gpu": 1}
            ).encode(),
            "Heartbeat: Object contains unknown field `gpu`",
        ),
        (
            json.dumps({"peer_id": v.peer_id, "step": "0", "samples": 1, "samples_per_s": 1.0}).encode(),
            "Heartbeat: Expected `int`, got `str` - at `$.step`",
        ),
        (
            json.dumps({"peer_id": v.peer_id, "step": -1, "samples": 1, "samples_per_s": 1.0}).encode(),
            "Heartbeat: Expected `int` >= 0 - at `$.step`",
        ),
        (
            json.dumps(
                {"peer_id": v.peer_id, "step": 0, "samples": 1, "samples_per_s": 1.0, "bt_port": 0}
            ).encode(),
            "Heartbeat: Expected `int` >= 1 - at `$.bt_port`",
        ),
    ]:
        headers = sign_headers(v.key, v.joined.credential, "tracker", path, hashlib.sha256(body).hexdigest())
        status, reply = await raw(tracker, "POST", path, body, headers)
        assert status == 400
        assert error_of(reply).startswith(message), (error_of(reply), message)


async def test_a_ready_calls_wait_is_read_like_every_query_number(tracker, admin, run_id):
    """``POST /ready?wait_s=`` is parsed as every other number of a query is (issue 26): a sentence for
    what is not a number of seconds from 0 to 3600, and a wait capped by the tracker's ``long_poll_s``."""
    v = SimVolunteer(admin, run_id)
    await v.join()
    path = f"/api/v1/runs/{run_id}/ready"
    body = encode(ReadyRequest(peer_id=v.peer_id, step=0, weight=0))
    headers = sign_headers(v.key, v.joined.credential, "tracker", path, hashlib.sha256(body).hexdigest())
    for query, message in [
        ("abc", "wait_s must be a number, not 'abc'"),
        ("-1", "wait_s must be a number from 0 to 3600"),
        ("nan", "wait_s must be a number from 0 to 3600"),
        ("1e9", "wait_s must be a number from 0 to 3600"),
    ]:
        status, reply = await raw(tracker, "POST", f"{path}?wait_s={query}", body, headers)
        assert (status, error_of(reply)) == (400, message)
    status, reply = await raw(tracker, "POST", f"{path}?wait_s=0", body, headers)
    assert status == 200 and json.loads(reply)["status"] == "wait"


async def test_reachable_address_is_verified_and_owns_state(admin, run_id):
    async with PingServer() as ps:
        # (the peer server learns its id after join; the next heartbeat re-checks)
        (v,) = await reachable_volunteers(admin, run_id, (ps,))
        status = await admin.status(run_id)
        assert [p.client_mode for p in status.peers] == [False]
        await v.declare_state(0, "cd" * 32, 1234)
        donors = await admin.donors(run_id)
        assert donors.state is not None and (donors.state.step, donors.state.size) == (0, 1234)
        assert [(d.peer_id, d.address, d.public_key) for d in donors.donors] == [
            (v.peer_id, ps.address, v.key.public_hex)
        ]


async def test_wrong_ping_answer_is_client_mode_and_cannot_donate(admin, run_id):
    async with PingServer() as ps:
        ps.peer_id = "somebody-else"
        v = SimVolunteer(admin, run_id)
        await v.join(address=ps.address)
        for _ in range(5):
            assert (await v.heartbeat(0, 1)).reachable is False
        await v.declare_state(0, "ab" * 32, 10)
        assert (await admin.donors(run_id)).donors == []


async def reachable_volunteers(admin, run_id, servers) -> list[SimVolunteer]:
    vols = [SimVolunteer(admin, run_id) for _ in servers]
    for v, server in zip(vols, servers, strict=True):
        await v.join(address=server.address)
        server.peer_id = v.peer_id
    for v in vols:
        await v.wait_reachable(samples=1)
    return vols


async def test_donors_are_of_the_newest_version_two_peers_back_with_no_rival(admin, run_id):
    async with PingServer() as a, PingServer() as b, PingServer() as c:
        va, vb, vc = vols = await reachable_volunteers(admin, run_id, (a, b, c))
        # the run is at step 0: a state declared for a later step is refused
        with pytest.raises(TrackerError, match="state step 5 is beyond the run's step 0"):
            await va.declare_state(5, "aa" * 32, 10)
        assert (await admin.donors(run_id)).state is None
        # two steps close (every peer's share in; the target is 100)
        for step in range(2):
            for v in vols:
                await v.heartbeat(step, 40)
            await asyncio.gather(*(v.ready(step, 40) for v in vols))
        await va.declare_state(1, "aa" * 32, 10)
        await vb.declare_state(2, "bb" * 32, 11)
        donors = await admin.donors(run_id)
        # two peers serve state, but no version is backed by both: none is listed, and the reason says so
        assert donors.state is None and donors.serving == 2 and donors.donors == []
        assert "agree on none yet" in donors.reason
        # ... and what each step's snapshots are held by: here snapshots on different steps
        assert "held: step 2: 1 peer, step 1: 1 peer" in donors.reason
        # ... and the run's status says its donors disagree (newcomers wait: issue 47)
        notice = (await admin.status(run_id)).notice
        assert notice is not None and "the 2 peers serving the run's state disagree on it" in notice
        await vc.declare_state(1, "aa" * 32, 10)
        assert (await admin.status(run_id)).notice is None
        donors = await admin.donors(run_id)
        assert (donors.state.step, donors.state.content_hash) == (1, "aa" * 32)
        assert sorted(d.peer_id for d in donors.donors) == sorted([va.peer_id, vc.peer_id])
        # the other peers serving state are listed beside them (asked for the averages of missed steps)
        assert [d.peer_id for d in donors.peers] == [vb.peer_id]
        # a peer's older snapshot backs a version too
        await vb.declare_state(2, "bb" * 32, 11, older=((1, "aa" * 32, 10),))
        donors = await admin.donors(run_id)
        assert donors.state.step == 1 and len(donors.donors) == 3 and donors.peers == []
        # two hashes for step 2, one backer each: a tie is no choice, the older agreed version stays
        await va.declare_state(2, "cc" * 32, 11, older=((1, "aa" * 32, 10),))
        assert (await admin.donors(run_id)).state.step == 1
        # a second backer of bb outvotes cc
        await vc.declare_state(2, "bb" * 32, 11)
        donors = await admin.donors(run_id)
        assert (donors.state.step, donors.state.content_hash) == (2, "bb" * 32)
        assert sorted(d.peer_id for d in donors.donors) == sorted([vb.peer_id, vc.peer_id])
        # a peer that fell behind asks without its own snapshots: b and c still agree on step 2 without a
        donors = await admin.donors(run_id, without=va.peer_id)
        assert (donors.state.step, donors.serving) == (2, 2) and vb.peer_id in {
            d.peer_id for d in donors.donors
        }
        with pytest.raises(TrackerError, match=r"without= names one peer id \(1 to 64 characters\)"):
            await admin.donors(run_id, without="x" * 65)
        # two peers, one fell behind: they agree on no state, but the one behind asks without its own
        await va.leave()
        await vb.declare_state(2, "bb" * 32, 11)
        await vc.declare_state(1, "aa" * 32, 10)
        assert (await admin.donors(run_id)).state is None
        donors = await admin.donors(run_id, without=vc.peer_id)
        assert donors.state.step == 2 and [d.peer_id for d in donors.donors] == [vb.peer_id]
        # with one peer serving state, its own is listed (there is nobody to agree with)
        await vc.leave()
        donors = await admin.donors(run_id)
        assert donors.state.step == 2 and [d.peer_id for d in donors.donors] == [vb.peer_id]


async def test_a_peer_catching_up_with_an_older_state_does_not_hold_back_the_training_peers_state(
    admin, run_id
):
    """Issue 47's churn soak: the one training peer served the run's state beside a rejoined peer's kept one (of
    an older step, held by no one else); two serving peers needed two backers, so nothing was listed for
    minutes. Only peers that train (a weight in the newest steps) count toward how many must agree."""
    async with PingServer() as a, PingServer() as b, PingServer() as c:
        va, vb, vc = vols = await reachable_volunteers(admin, run_id, (a, b, c))
        for step in range(3):  # a and b train; c takes part with weight 0 (it is catching up)
            for v, samples in zip(vols, (60, 60, 0), strict=True):
                await v.heartbeat(step, samples)
            await asyncio.gather(*(v.ready(step, w) for v, w in zip(vols, (60, 60, 0), strict=True)))
        await vc.declare_state(1, "ee" * 32, 10)  # the state c kept (it took part in step 0)
        await va.declare_state(3, "dd" * 32, 10)
        donors = await admin.donors(run_id)
        assert donors.serving == 1 and (donors.state.step, donors.state.content_hash) == (3, "dd" * 32)
        assert [d.peer_id for d in donors.donors] == [va.peer_id]
        # a second training peer serving state: two must agree again
        await vb.declare_state(3, "ff" * 32, 10)
        donors = await admin.donors(run_id)
        assert donors.serving == 2 and donors.state is None and "held: step 3: 1+1 peers" in donors.reason
        await vb.declare_state(3, "dd" * 32, 10)
        donors = await admin.donors(run_id)
        assert donors.state.content_hash == "dd" * 32
        assert sorted(d.peer_id for d in donors.donors) == sorted([va.peer_id, vb.peer_id])


async def test_state_of_a_step_a_peer_skipped_is_refused_and_repeated_refusals_drop_the_donor(admin, run_id):
    async with PingServer() as a, PingServer() as b:
        (va,) = await reachable_volunteers(admin, run_id, (a,))
        await va.heartbeat(0, 100)
        await va.ready(0, 100)
        # vb joined after step 0 formed: it cannot vouch for the state after it
        (vb,) = await reachable_volunteers(admin, run_id, (b,))
        with pytest.raises(
            TrackerError, match="took no part in step 0, so it cannot vouch for the state of step 1"
        ):
            await vb.declare_state(1, "aa" * 32, 10)
        with pytest.raises(TrackerError, match="beyond the run's step 1"):
            await vb.declare_state(9, "aa" * 32, 10)
        with pytest.raises(TrackerError, match="3 declarations refused, no longer a donor"):
            await vb.declare_state(9, "aa" * 32, 10)
        # dropped for good: even a state it may hold (the initial one) is refused, and it is never listed
        with pytest.raises(TrackerError, match="is no longer a state donor"):
            await vb.declare_state(0, "aa" * 32, 10)
        await va.declare_state(1, "dd" * 32, 10)
        donors = await admin.donors(run_id)
        assert donors.serving == 1 and [d.peer_id for d in donors.donors] == [va.peer_id]


async def test_the_state_a_leaving_peer_kept_is_vouched_for_and_served_when_it_joins_again(admin, run_id):
    async with PingServer() as a, PingServer() as b, PingServer() as c:
        va, vb = await reachable_volunteers(admin, run_id, (a, b))
        await va.heartbeat(0, 50)
        await vb.heartbeat(0, 50)
        await asyncio.gather(va.ready(0, 50), vb.ready(0, 50))
        # both took part in step 0 and leave with the state of step 1 kept; vb also tells one of step 1 with a
        # hash of its own, and a step the run never reached: each vouched for only as far as its part allows
        await va.leave(kept=(1, "aa" * 32, 10))
        await vb.leave(kept=(5, "bb" * 32, 10))
        assert (await admin.status(run_id)).peers_online == 0
        # va joins again under a new identity (it took part in no step as that one): it serves its kept state
        (again,) = await reachable_volunteers(admin, run_id, (c,))
        await again.declare_state(1, "aa" * 32, 10)
        donors = await admin.donors(run_id)
        assert (donors.state.step, donors.state.content_hash) == (1, "aa" * 32)
        assert [d.peer_id for d in donors.donors] == [again.peer_id]
        # a hash nobody who took part vouched for is still refused
        with pytest.raises(
            TrackerError, match="took no part in step 0, so it cannot vouch for the state of step 1"
        ):
            await again.declare_state(1, "bb" * 32, 10)
        with pytest.raises(TrackerError, match="beyond the run's step 1"):
            await again.declare_state(5, "bb" * 32, 10)


async def test_state_declare_validates(admin, run_id):
    v = SimVolunteer(admin, run_id)
    await v.join()
    with pytest.raises(
        TrackerError,
        match=r"^StateDeclare: Expected `str` of 64 lowercase hex characters - at `\$\.state\.content_hash`$",
    ):
        await v.declare_state(1, "nothex", 10)
    with pytest.raises(TrackerError, match="only a peer with a reachable address can serve state"):
        await v.declare_state(1, "ab" * 32, 10)


async def test_leave_removes_the_peer(admin, run_id):
    v = SimVolunteer(admin, run_id)
    await v.join()
    await v.heartbeat(0, 5)
    assert (await admin.status(run_id)).peers_online == 1
    await v.leave()
    status = await admin.status(run_id)
    assert (status.peers_online, status.samples) == (0, 0)
    with pytest.raises(TrackerError, match=f"peer {v.peer_id} is not registered in run {run_id}"):
        await v.leave()


@pytest.mark.tracker_config(peer_ttl_s=0.3, heartbeat_interval_s=0.1)
async def test_silent_peers_expire(admin):
    run_id = (await admin.create_run(make_run_create())).run_id
    v = SimVolunteer(admin, run_id)
    await v.join()
    await v.heartbeat(0, 3)

    async def expired() -> bool:
        return (await admin.status(run_id)).peers_online == 0

    await until(expired, 10, "the silent peer's expiry", every_s=0.02)
    assert (await admin.status(run_id)).samples == 0
    # its next heartbeat (credential still valid) registers it again
    assert (await v.heartbeat(0, 3)).peers_online == 1


@pytest.mark.tracker_config(join_rate_per_s=0.001, join_burst=2)
async def test_join_rate_limit_per_address(admin):
    run_id = (await admin.create_run(make_run_create())).run_id
    await SimVolunteer(admin, run_id).join()
    await SimVolunteer(admin, run_id).join()
    with pytest.raises(TrackerError) as info:
        await SimVolunteer(admin, run_id).join()
    assert (info.value.status, str(info.value)) == (
        429,
        "too many joins from your address; wait a few seconds and try again",
    )


async def test_register_dataset_validates(admin):
    with pytest.raises(
        TrackerError,
        match=r"^DatasetRegistration: Expected `str` of 40 lowercase hex characters - at `\$\.infohash`$",
    ):
        await admin.register_dataset("XYZ", "x")
    with pytest.raises(
        TrackerError, match=r"^DatasetRegistration: Expected `str` of length >= 1 - at `\$\.name`$"
    ):
        await admin.register_dataset("ab" * 20, "")
    reg = await admin.register_dataset("ab" * 20, "my set")
    assert (reg.infohash, reg.name) == ("ab" * 20, "my set")


async def test_unreachable_tracker_says_to_check_the_url():
    url = f"http://127.0.0.1:{closed_port()}"
    async with TrackerClient(url, timeout_s=2.0) as c:
        with pytest.raises(TrackerUnreachable) as info:
            await c.list_runs()
    assert str(info.value).startswith(f"Tracker at {url} cannot be reached (")
    assert str(info.value).endswith("check --tracker or your network.")


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("host:0", "address 'host:0' must be host:port with a port between 1 and 65535"),
        ("host:http", "address 'host:http' must be host:port with a port between 1 and 65535"),
        ("a/b:80", "address 'a/b:80' has an invalid host"),
        ("::1:8000", "address '::1:8000': write an IPv6 host in brackets, e.g. [::1]:8000"),
    ],
)
async def test_declared_addresses_are_validated(admin, run_id, address, message):
    with pytest.raises(TrackerError) as info:
        await admin.join(
            run_id, JoinRequest(public_key="ab" * 32, address=address, peer_protocol=PEER_PROTOCOL)
        )
    assert (info.value.status, str(info.value)) == (400, message)


async def test_unspecified_host_means_the_address_the_request_came_from(admin, run_id):
    async with PingServer() as ps:
        port = ps.address.rsplit(":", 1)[1]
        v = SimVolunteer(admin, run_id)
        await v.join(address=f"0.0.0.0:{port}")
        ps.peer_id = v.peer_id
        await v.wait_reachable(samples=1)  # the tracker reaches 127.0.0.1 for a declared 0.0.0.0 address
        reply = await v.heartbeat(0, 1)
        assert (reply.reachable, reply.address) == (True, f"127.0.0.1:{port}"), reply


def _with(path: str, value):
    """A RunCreate as JSON with one field (``a.b.c``, list indices as numbers) set to ``value``."""

    def mutate(doc: dict) -> dict:
        node = doc
        *parents, last = path.split(".")
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[int(last) if last.isdigit() else last] = value
        return doc

    return mutate


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_with("micro_batch_size", 10**12), "micro_batch_size"),
        (_with("seed", 2**64), "seed"),
        (_with("averaging.clip_multiple", -1), "averaging.clip_multiple"),
        (_with("averaging.subframe_elements", 0), "averaging.subframe_elements"),
        (_with("averaging.zstd_level", 1000), "averaging.zstd_level"),
        (_with("averaging.group_size", 10**9), "averaging.group_size"),
        (_with("averaging.delay", 2), "averaging.delay"),
        (_with("optimizer.beta1", 1.5), "optimizer.beta1"),
        (_with("schedule.min_lr_ratio", 2.0), "schedule.min_lr_ratio"),
        (_with("dataset.web_seed", "file:///etc/passwd"), "dataset.web_seed"),
        (_with("dataset.manifest.chunks.0.name", "../../../etc/passwd"), "dataset.manifest.chunks[0].name"),
        (_with("dataset.manifest.chunks.0.samples", -5), "dataset.manifest.chunks[0].samples"),
        (_with("averaging.max_peer_share", 0.0), "averaging.max_peer_share"),
        (_with("model.recipe", "../../etc/passwd"), "model.recipe"),
        (_with("model.args.hidden", 10**12), "model.args.hidden"),
        # names a log line or a terminal shows: no NUL, ESC, CR/LF or right-to-left override
        (_with("name", "run\x00"), "name"),
        (_with("name", "run\r\n2026-11-23 INFO peer admitted"), "name"),
        (_with("name", "\x1b[2Jrun"), "name"),
        (_with("name", "run\u202egnp.exe"), "name"),
        (_with("model.recipe", "mlp\n"), "model.recipe"),
        (_with("dataset.manifest.name", "set\x07"), "dataset.manifest.name"),
        (_with("dataset.manifest.chunks.0.name", "chunk-00000.bin\n"), "dataset.manifest.chunks[0].name"),
        (_with("optimizer.lr", 1e300), "optimizer.lr"),
        (_with("averaging.step_timeout_s", 1e-300), "averaging.step_timeout_s"),
        (_with("averaging.gather_s", 1e-300), "averaging.gather_s"),
    ],
)
async def test_create_refuses_a_run_no_volunteer_could_run_naming_the_field(tracker, mutate, field):
    """The tracker makes the check `run create` and every volunteer make (protocol/runcheck.py): each field
    out of range is refused with a sentence that names it (issue 16)."""
    doc = mutate(json.loads(encode(make_run_create(target_batch_size=100))))
    got, reply = await raw(
        tracker,
        "POST",
        "/api/v1/runs",
        json.dumps(doc).encode(),
        {"Authorization": f"Bearer {tracker.admin_token}"},
    )
    assert got == 400, (got, reply[:300])
    assert error_of(reply).startswith(f"RunCreate: {field} "), error_of(reply)


async def test_a_malformed_http_request_is_refused_with_one_log_line_not_a_traceback(tracker, caplog):
    """Issue 16: an over-long request line got aiohttp's 400 and a full parser traceback in the log per
    request; now it is one line saying who sent what."""
    host, port = tracker.url.removeprefix("http://").rsplit(":", 1)
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        for request in (
            b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            b"BR0KEN\x00 / HTTP/1.1\r\n\r\n",
        ):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(4096), 10)
            writer.close()
            await writer.wait_closed()
            assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request"), answer[:200]
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records, "aiohttp logged nothing for two malformed requests"
    for r in records:
        assert r.exc_info is None and r.exc_text is None
        assert r.getMessage().startswith("refused a malformed HTTP request from 127.0.0.1: ")
        assert "\n" not in r.getMessage()


def test_the_join_limiter_forgets_the_longest_silent_client_not_everyone():
    """Issue 29: at 100,000 addresses it forgot every client at once, so a flood from many addresses reset
    the limit of the one hammering it. Now the least recently heard goes first; an address asking stays."""
    from crowdtrain.tracker.server import TokenBucket

    bucket = TokenBucket(rate=0.001, burst=2, capacity=3)
    assert bucket.allow("hammer") and bucket.allow("hammer") and not bucket.allow("hammer")
    for i in range(10):  # a flood of other addresses, the hammer asking between them
        assert bucket.allow(f"10.0.0.{i}")
        assert not bucket.allow("hammer")
    assert len(bucket.state) == 3 and "hammer" in bucket.state
