"""Who may call what: the admin token, and the signed headers of a joined volunteer.

Volunteer requests carry the headers of :mod:`crowdtrain.protocol.peerauth`, signed with purpose
``"tracker"`` over the request path and the SHA-256 (hex) of the body. A credential's tracker signature is
checked once and then remembered by its exact header text.

The request itself is authenticated in one of two ways:

* ``X-Crowdtrain-Signature``: the peer's Ed25519 signature (what ``peerauth.sign_headers`` makes); or
* ``X-Crowdtrain-Session-Mac``: HMAC-SHA256 over the same bytes with the *session key* the tracker
  gave the peer at join. The session key is derived from the tracker's durable secret and the
  credential's signature, so it survives a tracker restart and needs no table; it is ~100x cheaper to
  check than an Ed25519 signature, which is what lets one tracker core take thousands of heartbeats/s.
  Only the tracker and the peer know it (it is never sent to other peers, unlike the credential).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import time
from collections.abc import Mapping

from crowdtrain.protocol.credentials import request_bytes, verify, verify_credential
from crowdtrain.protocol.errors import AuthError, ProtocolError
from crowdtrain.protocol.messages import Credential, decode, encode
from crowdtrain.protocol.peerauth import (
    HEADER_CREDENTIAL,
    HEADER_SESSION_MAC,
    HEADER_SIGNATURE,
    HEADER_TIME,
    MAX_SKEW_S,
    session_mac,
)
from crowdtrain.protocol.peerauth import TRACKER_PURPOSE as PURPOSE

_MAX_CREDENTIAL_HEADER = 4096
_CACHE_LIMIT = 200_000


class AdminAuthError(AuthError):
    """The admin token is missing (``status`` 401) or wrong (403)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def check_admin(headers: Mapping[str, str], token: str) -> None:
    value = headers.get("Authorization", "")
    if not value:
        raise AdminAuthError(
            "this endpoint needs the tracker's admin token in an 'Authorization: Bearer <token>' header", 401
        )
    scheme, _, given = value.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise AdminAuthError(
            "the admin token is wrong; use the token the tracker printed when it started", 403
        )


def session_key(secret: bytes, credential: Credential) -> bytes:
    return hmac.new(
        secret, b"crowdtrain-session\x00" + credential.signature.encode(), hashlib.sha256
    ).digest()


class PeerAuth:
    def __init__(self, tracker_public_key: str, secret: bytes) -> None:
        self.tracker_public_key = tracker_public_key
        self.secret = secret
        self._known: dict[str, tuple[Credential, bytes]] = {}

    def session_key_for(self, credential: Credential) -> str:
        return session_key(self.secret, credential).hex()

    def remember(self, credential: Credential) -> None:
        """Cache a credential this tracker just issued under the header text clients send for it, so the
        peer's first requests need no check of the tracker's own signature."""
        header = base64.urlsafe_b64encode(encode(credential)).decode()
        if len(self._known) >= _CACHE_LIMIT:
            self._known.clear()
        self._known[header] = (credential, session_key(self.secret, credential))

    def check(self, headers: Mapping[str, str], run_id: str, path: str, body_sha256: str) -> Credential:
        raw = headers.get(HEADER_CREDENTIAL)
        stamp = headers.get(HEADER_TIME)
        signature = headers.get(HEADER_SIGNATURE)
        mac = headers.get(HEADER_SESSION_MAC)
        if not raw or not stamp or not (signature or mac):
            raise AuthError(
                f"request lacks the {HEADER_CREDENTIAL}, {HEADER_TIME} and {HEADER_SIGNATURE} headers;"
                " join the run first and sign requests with your credential"
            )
        if len(raw) > _MAX_CREDENTIAL_HEADER or len(signature or mac or "") > 256 or len(stamp) > 32:
            raise AuthError("request authentication headers are longer than allowed")
        now = time.time()
        known = self._known.get(raw)
        if known is None:
            try:
                credential = decode(base64.urlsafe_b64decode(raw.encode()), Credential)
            except (ValueError, ProtocolError) as exc:
                raise AuthError(f"{HEADER_CREDENTIAL} is not a valid credential ({exc})") from None
            verify_credential(credential, self.tracker_public_key, run_id, now)
            if len(self._known) >= _CACHE_LIMIT:
                self._known.clear()
            known = self._known[raw] = (credential, session_key(self.secret, credential))
        else:
            credential = known[0]
            if credential.run_id != run_id:
                raise AuthError(f"credential is for run {credential.run_id!r}, not {run_id!r}")
            if now > credential.expires_at:
                raise AuthError(f"credential of peer {credential.peer_id} has expired; join the run again")
        try:
            signed_at = float(stamp)
        except ValueError:
            raise AuthError(f"{HEADER_TIME} is not a number of seconds") from None
        if not math.isfinite(signed_at):
            raise AuthError(f"{HEADER_TIME} is not a number of seconds")
        if abs(now - signed_at) > MAX_SKEW_S:
            raise AuthError(
                f"request was signed {now - signed_at:.0f} s away from the tracker's clock; check your clock"
            )
        if mac is not None:
            if not hmac.compare_digest(
                mac.encode(), session_mac(known[1], stamp, path, body_sha256).encode()
            ):
                raise AuthError("request carries an invalid session MAC")
        else:
            assert signature is not None
            verify(
                credential.public_key, signature, request_bytes(PURPOSE, stamp, path, body_sha256), "request"
            )
        return credential
