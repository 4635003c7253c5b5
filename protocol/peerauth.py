"""Authentication of peer-to-peer requests (all-reduce parts, state ranges).

A request carries three headers:

* ``X-Crowdtrain-Credential``: the sender's :class:`Credential` (JSON, base64url), signed by the tracker;
* ``X-Crowdtrain-Time``: unix seconds when the request was signed;
* ``X-Crowdtrain-Signature``: the sender's own Ed25519 signature over the purpose, the time and the
  request's fields (round id, part, state hash, range…).

The receiver checks the credential against the tracker's public key from the run spec, the signature
against the key the credential vouches for, and the time against a skew window. Binding to a round (the
receiver also checks the sender is a member of that round's signed group) stops replay into other
rounds; within a round a receiver accepts one contribution per sender and part.

Requests to the tracker use the same headers with purpose ``"tracker"``, or, instead of the signature,
``X-Crowdtrain-Session-Mac``: an HMAC with the session key the tracker gave at join
(:func:`sign_session_headers`; the tracker's side is ``crowdtrain.tracker.auth``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import time
from collections.abc import Mapping

from crowdtrain.protocol.credentials import SigningKey, request_bytes, verify, verify_credential
from crowdtrain.protocol.errors import AuthError, ProtocolError
from crowdtrain.protocol.messages import Credential, decode, encode

HEADER_CREDENTIAL = "X-Crowdtrain-Credential"
HEADER_TIME = "X-Crowdtrain-Time"
HEADER_SIGNATURE = "X-Crowdtrain-Signature"
HEADER_SESSION_MAC = "X-Crowdtrain-Session-Mac"
TRACKER_PURPOSE = "tracker"
MAX_SKEW_S = 120.0
_MAX_HEADER = 4096


def session_mac(key: bytes, stamp: str, path: str, body_sha256: str) -> str:
    """The HMAC of a tracker request under a session key."""
    return hmac.new(key, request_bytes(TRACKER_PURPOSE, stamp, path, body_sha256), hashlib.sha256).hexdigest()


def sign_session_headers(
    session_key_hex: str, credential_header: str, path: str, body_sha256: str
) -> dict[str, str]:
    """Headers of a tracker request authenticated with the session key (``credential_header``: base64url
    JSON)."""
    stamp = f"{time.time():.3f}"
    return {
        HEADER_CREDENTIAL: credential_header,
        HEADER_TIME: stamp,
        HEADER_SESSION_MAC: session_mac(bytes.fromhex(session_key_hex), stamp, path, body_sha256),
    }


def sign_headers(key: SigningKey, credential: Credential, purpose: str, *fields: str | int) -> dict[str, str]:
    now = f"{time.time():.3f}"
    return {
        HEADER_CREDENTIAL: base64.urlsafe_b64encode(encode(credential)).decode(),
        HEADER_TIME: now,
        HEADER_SIGNATURE: key.sign(request_bytes(purpose, now, *fields)),
    }


def check_headers(
    headers: Mapping[str, str],
    tracker_public_key: str,
    run_id: str,
    purpose: str,
    *fields: str | int,
    now: float | None = None,
) -> Credential:
    """Return the sender's verified credential, or raise :class:`AuthError` saying what is wrong."""
    raw_cred = headers.get(HEADER_CREDENTIAL)
    stamp = headers.get(HEADER_TIME)
    signature = headers.get(HEADER_SIGNATURE)
    if not raw_cred or not stamp or not signature:
        raise AuthError(
            f"request lacks the {HEADER_CREDENTIAL}, {HEADER_TIME} and {HEADER_SIGNATURE} headers of a run member"
        )
    if len(raw_cred) > _MAX_HEADER or len(signature) > 256 or len(stamp) > 32:
        raise AuthError("request authentication headers are longer than allowed")
    try:
        credential = decode(base64.urlsafe_b64decode(raw_cred.encode()), Credential)
    except (ValueError, ProtocolError) as exc:
        raise AuthError(f"{HEADER_CREDENTIAL} is not a valid credential ({exc})") from None
    now = time.time() if now is None else now
    verify_credential(credential, tracker_public_key, run_id, now)
    try:
        signed_at = float(stamp)
    except ValueError:
        raise AuthError(f"{HEADER_TIME} is not a number of seconds") from None
    if not math.isfinite(signed_at):  # "nan" would pass the skew test below and never expire
        raise AuthError(f"{HEADER_TIME} is not a finite number of seconds")
    if abs(now - signed_at) > MAX_SKEW_S:
        raise AuthError(
            f"request was signed {now - signed_at:.0f} s away from this peer's clock; check your clock"
        )
    verify(credential.public_key, signature, request_bytes(purpose, stamp, *fields), "request")
    return credential
