"""Credentials, group assignments and peer request signatures: the good case passes, every defect is an
AuthError that says what is wrong."""

from __future__ import annotations

import base64
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crowdtrain.protocol.credentials import (
    SigningKey,
    issue_credential,
    request_bytes,
    sign_assignment,
    sign_assignments,
    verify,
    verify_assignment,
    verify_credential,
)
from crowdtrain.protocol.errors import AuthError
from crowdtrain.protocol.messages import GroupAssignment, GroupMember, encode, replace
from crowdtrain.protocol.peerauth import (
    HEADER_CREDENTIAL,
    HEADER_SIGNATURE,
    HEADER_TIME,
    MAX_SKEW_S,
    check_headers,
    sign_headers,
)

RUN = "run-1"


@pytest.fixture(scope="module")
def tracker_key() -> SigningKey:
    return SigningKey()


@pytest.fixture(scope="module")
def peer() -> SigningKey:
    return SigningKey()


@pytest.fixture(scope="module")
def credential(tracker_key, peer):
    return issue_credential(tracker_key, RUN, "peer-a", peer.public_hex, ttl_s=600)


def _flip_hex(h: str, i: int = 0) -> str:
    return h[:i] + ("0" if h[i] != "0" else "1") + h[i + 1 :]


def test_signing_key_round_trips_through_its_private_bytes(tracker_key):
    again = SigningKey.from_bytes(tracker_key.private_bytes())
    assert again.public_hex == tracker_key.public_hex and len(tracker_key.public_hex) == 64
    verify(tracker_key.public_hex, again.sign(b"data"), b"data", "test")


def test_valid_credential_passes(tracker_key, credential):
    verify_credential(credential, tracker_key.public_hex, RUN)


@pytest.mark.parametrize(
    ("field", "value"),
    [("peer_id", "peer-b"), ("public_key", "ab" * 32), ("expires_at", 4e9)],
)
def test_credential_with_a_changed_field_fails(tracker_key, credential, field, value):
    with pytest.raises(AuthError, match="credential carries an invalid signature"):
        verify_credential(replace(credential, **{field: value}), tracker_key.public_hex, RUN)


def test_credential_for_another_run_fails(tracker_key, credential):
    with pytest.raises(AuthError, match="credential is for run 'run-1', not 'run-2'"):
        verify_credential(credential, tracker_key.public_hex, "run-2")
    moved = replace(credential, run_id="run-2")
    with pytest.raises(AuthError, match="credential carries an invalid signature"):
        verify_credential(moved, tracker_key.public_hex, "run-2")


@settings(max_examples=30, deadline=None)
@given(position=st.integers(min_value=0, max_value=127))
def test_tampered_credential_signature_fails(tracker_key, credential, position):
    tampered = replace(credential, signature=_flip_hex(credential.signature, position))
    with pytest.raises(AuthError, match="credential carries an invalid signature"):
        verify_credential(tampered, tracker_key.public_hex, RUN)


@pytest.mark.parametrize("signature", ["", "zz", "00" * 63, "00" * 64, "ab" * 65])
def test_malformed_signatures_fail(tracker_key, credential, signature):
    with pytest.raises(AuthError, match="invalid signature"):
        verify_credential(replace(credential, signature=signature), tracker_key.public_hex, RUN)


def test_wrong_tracker_key_fails(credential):
    with pytest.raises(AuthError, match="credential carries an invalid signature"):
        verify_credential(credential, SigningKey().public_hex, RUN)
    with pytest.raises(AuthError, match="credential carries an invalid signature"):
        verify_credential(credential, "not hex", RUN)
    with pytest.raises(AuthError, match="credential carries an invalid signature"):
        verify_credential(credential, "00" * 31, RUN)


def test_expired_credential_fails(tracker_key, credential):
    verify_credential(credential, tracker_key.public_hex, RUN, now=credential.expires_at)
    with pytest.raises(AuthError, match="credential of peer peer-a has expired; the peer must join again"):
        verify_credential(credential, tracker_key.public_hex, RUN, now=credential.expires_at + 0.01)


def _assignment(tracker_key: SigningKey, peer: SigningKey) -> GroupAssignment:
    members = [
        GroupMember(peer_id="peer-a", address="127.0.0.1:1", public_key=peer.public_hex, weight=8, part=0),
        GroupMember(peer_id="peer-b", address=None, public_key=SigningKey().public_hex, weight=0, part=-1),
    ]
    unsigned = GroupAssignment(
        run_id=RUN,
        round_id="r1",
        step=3,
        members=members,
        parts=1,
        average_params=False,
        deadline=time.time() + 30,
        seed=42,
        signature="",
    )
    return sign_assignment(tracker_key, unsigned)


def test_group_assignment_signature(tracker_key, peer):
    signed = _assignment(tracker_key, peer)
    verify_assignment(signed, tracker_key.public_hex)
    # signing an already-signed assignment gives the same statement
    verify_assignment(sign_assignment(tracker_key, signed), tracker_key.public_hex)
    for changes in ({"step": 4}, {"seed": 43}, {"members": signed.members[:1]}, {"average_params": True}):
        with pytest.raises(AuthError, match="group assignment carries an invalid signature"):
            verify_assignment(replace(signed, **changes), tracker_key.public_hex)
    with pytest.raises(AuthError, match="group assignment carries an invalid signature"):
        verify_assignment(signed, SigningKey().public_hex)


@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 33])
def test_a_round_is_signed_once_and_each_assignment_proves_itself_alone(tracker_key, peer, count):
    base = _assignment(tracker_key, peer)
    signed = sign_assignments(
        tracker_key, [replace(base, round_id=f"r{i}", signature="") for i in range(count)]
    )
    assert len({a.signature for a in signed}) == 1  # one signature for the whole round
    assert max(len(a.proof) for a in signed) == (count - 1).bit_length()  # log2 of the round, rounded up
    for a in signed:
        verify_assignment(a, tracker_key.public_hex)
        with pytest.raises(AuthError, match="group assignment carries an invalid signature"):
            verify_assignment(replace(a, round_id=a.round_id + "x"), tracker_key.public_hex)
    if count == 1:
        return
    first, second = signed[0], signed[1]
    bad = "r" + "0" * 64
    for forged in (
        replace(first, proof=second.proof),  # another assignment's path
        replace(first, proof=[bad, *first.proof[1:]]),  # a sibling changed
        replace(first, proof=[("l" if s[0] == "r" else "r") + s[1:] for s in first.proof]),  # sides swapped
        replace(first, proof=first.proof[:-1]),  # a level left out
        replace(first, proof=[]),
        replace(first, step=first.step + 1),
        replace(first, proof=["x" + "0" * 64, *first.proof[1:]]),  # (built in-process: no message bounds)
        replace(first, proof=["r" + "zz", *first.proof[1:]]),
        replace(first, proof=["l" + "00" * 31, *first.proof[1:]]),
    ):
        with pytest.raises(AuthError, match="group assignment carries an invalid signature"):
            verify_assignment(forged, tracker_key.public_hex)
    # another round's signature does not cover this round's assignments
    other = sign_assignments(tracker_key, [replace(base, round_id="z", signature="")] * count)
    with pytest.raises(AuthError, match="group assignment carries an invalid signature"):
        verify_assignment(replace(first, signature=other[0].signature), tracker_key.public_hex)


def test_an_assignment_path_is_bounded_and_well_formed():
    from crowdtrain.protocol.errors import ProtocolError
    from crowdtrain.protocol.messages import decode

    fields = {
        "run_id": RUN,
        "round_id": "r1",
        "step": 1,
        "members": [],
        "parts": 1,
        "average_params": False,
        "deadline": 1.0,
        "seed": 1,
        "signature": "",
    }
    decode(encode(GroupAssignment(**fields, proof=["l" + "a" * 64] * 32)), GroupAssignment)
    for proof, words in (
        (["l" + "a" * 64] * 33, "length <= 32"),
        (["x" + "a" * 64], "'l' or 'r' and 64 lowercase hex characters"),
        (["l" + "a" * 63], "'l' or 'r' and 64 lowercase hex characters"),
        (["l" + "A" * 64], "'l' or 'r' and 64 lowercase hex characters"),
    ):
        with pytest.raises(ProtocolError, match=words):
            decode(encode(GroupAssignment(**fields, proof=proof)), GroupAssignment)


def test_request_bytes_separate_purpose_and_fields():
    assert request_bytes("part", "r1", 0) != request_bytes("state", "r1", 0)
    assert request_bytes("part", "r1", 0) != request_bytes("part", "r1", 1)
    assert request_bytes("part", "r1", 0) == b"crowdtrain-part\x00r1\x000"


# ---------------------------------------------------------------- peer request headers


def test_signed_request_passes_and_returns_the_credential(tracker_key, peer, credential):
    headers = sign_headers(peer, credential, "part", "r1", 0)
    assert check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 0) == credential


def test_request_for_other_fields_or_purpose_fails(tracker_key, peer, credential):
    headers = sign_headers(peer, credential, "part", "r1", 0)
    with pytest.raises(AuthError, match="request carries an invalid signature"):
        check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 1)
    with pytest.raises(AuthError, match="request carries an invalid signature"):
        check_headers(headers, tracker_key.public_hex, RUN, "part", "r2", 0)
    with pytest.raises(AuthError, match="request carries an invalid signature"):
        check_headers(headers, tracker_key.public_hex, RUN, "state", "r1", 0)


def test_request_signed_by_a_key_the_credential_does_not_vouch_for_fails(tracker_key, credential):
    thief = SigningKey()
    headers = sign_headers(thief, credential, "part", "r1", 0)
    with pytest.raises(AuthError, match="request carries an invalid signature"):
        check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 0)


def test_tampered_request_signature_fails(tracker_key, peer, credential):
    headers = sign_headers(peer, credential, "part", "r1", 0)
    headers[HEADER_SIGNATURE] = _flip_hex(headers[HEADER_SIGNATURE], 5)
    with pytest.raises(AuthError, match="request carries an invalid signature"):
        check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 0)


def test_request_checked_against_the_wrong_tracker_or_run_fails(tracker_key, peer, credential):
    headers = sign_headers(peer, credential, "part", "r1", 0)
    with pytest.raises(AuthError, match="credential carries an invalid signature"):
        check_headers(headers, SigningKey().public_hex, RUN, "part", "r1", 0)
    with pytest.raises(AuthError, match="credential is for run 'run-1', not 'run-9'"):
        check_headers(headers, tracker_key.public_hex, "run-9", "part", "r1", 0)


def test_request_with_an_expired_credential_fails(tracker_key, peer):
    old = issue_credential(tracker_key, RUN, "peer-a", peer.public_hex, ttl_s=-1)
    headers = sign_headers(peer, old, "part", "r1", 0)
    with pytest.raises(AuthError, match="has expired; the peer must join again"):
        check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 0)


@pytest.mark.parametrize("skew", [MAX_SKEW_S + 1, -(MAX_SKEW_S + 1), -1e6])
def test_request_from_a_skewed_clock_fails(tracker_key, peer, credential, skew):
    headers = sign_headers(peer, credential, "part", "r1", 0)
    signed_at = float(headers[HEADER_TIME])
    check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 0, now=signed_at + MAX_SKEW_S - 1)
    with pytest.raises(AuthError, match="away from this peer's clock; check your clock"):
        check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 0, now=signed_at + skew)


@pytest.mark.parametrize("stamp", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_request_with_a_non_finite_time_fails_even_when_signed(tracker_key, peer, credential, stamp):
    """Regression: a stamp of "nan" passed the skew window (nan comparisons are false), so a request
    signed once with it would have been valid for ever."""
    headers = {
        HEADER_CREDENTIAL: base64.urlsafe_b64encode(encode(credential)).decode(),
        HEADER_TIME: stamp,
        HEADER_SIGNATURE: peer.sign(request_bytes("part", stamp, "r1", 0)),
    }
    with pytest.raises(AuthError, match="X-Crowdtrain-Time is not a finite number of seconds"):
        check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 0)


@pytest.mark.parametrize(
    ("header", "value", "text"),
    [
        (HEADER_CREDENTIAL, None, "request lacks the"),
        (HEADER_TIME, "", "request lacks the"),
        (HEADER_SIGNATURE, None, "request lacks the"),
        (HEADER_CREDENTIAL, "A" * 5000, "longer than allowed"),
        (HEADER_SIGNATURE, "a" * 300, "longer than allowed"),
        (HEADER_TIME, "1" * 40, "longer than allowed"),
        (HEADER_CREDENTIAL, "!!!not base64", "X-Crowdtrain-Credential is not a valid credential"),
        (HEADER_CREDENTIAL, base64.urlsafe_b64encode(b'{"run_id": 1}').decode(), "is not a valid credential"),
        (HEADER_CREDENTIAL, base64.urlsafe_b64encode(b"\xff\xfe").decode(), "is not a valid credential"),
        (HEADER_TIME, "yesterday", "X-Crowdtrain-Time is not a number of seconds"),
    ],
)
def test_malformed_headers_fail(tracker_key, peer, credential, header, value, text):
    headers = sign_headers(peer, credential, "part", "r1", 0)
    if value is None:
        del headers[header]
    else:
        headers[header] = value
    with pytest.raises(AuthError, match=text):
        check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 0)


@settings(max_examples=100, deadline=None)
@given(
    cred=st.text(max_size=80),
    stamp=st.text(max_size=40),
    sig=st.text(max_size=140),
)
def test_random_headers_only_ever_raise_auth_error(tracker_key, cred, stamp, sig):
    headers = {HEADER_CREDENTIAL: cred, HEADER_TIME: stamp, HEADER_SIGNATURE: sig}
    with pytest.raises(AuthError):
        check_headers(headers, tracker_key.public_hex, RUN, "part", "r1", 0)
