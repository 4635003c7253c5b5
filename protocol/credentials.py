"""Ed25519 signatures: the tracker vouches for peers and groups; peers sign their requests.

* The tracker signs a :class:`Credential` (run, peer id, the peer's own public key, expiry) at join, and
  each :class:`GroupAssignment`. The run spec carries the tracker's public key, so peers check both
  without asking the tracker.
* A peer signs each peer-to-peer request with its own key over a purpose string, the round (or state
  hash) and its other parameters, so a credential copied off the network is useless without the key.
"""

from __future__ import annotations

import time

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from crowdtrain.protocol.errors import AuthError
from crowdtrain.protocol.messages import Credential, GroupAssignment, replace


class SigningKey:
    """An Ed25519 private key with hex helpers."""

    def __init__(self, key: Ed25519PrivateKey | None = None) -> None:
        self._key = key or Ed25519PrivateKey.generate()
        self.public_hex = (
            self._key.public_key()
            .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            .hex()
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> SigningKey:
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def sign(self, data: bytes) -> str:
        return self._key.sign(data).hex()


def verify(public_hex: str, signature_hex: str, data: bytes, what: str) -> None:
    """Raise :class:`AuthError` unless ``signature_hex`` is ``public_hex``'s signature of ``data``."""
    try:
        pub = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        pub.verify(bytes.fromhex(signature_hex), data)
    except (ValueError, InvalidSignature):
        raise AuthError(f"{what} carries an invalid signature") from None


def _credential_bytes(c: Credential) -> bytes:
    return b"crowdtrain-credential\x00" + msgspec.json.encode(replace(c, signature=""))


def issue_credential(
    tracker: SigningKey, run_id: str, peer_id: str, public_key: str, ttl_s: float
) -> Credential:
    unsigned = Credential(
        run_id=run_id, peer_id=peer_id, public_key=public_key, expires_at=time.time() + ttl_s, signature=""
    )
    return replace(unsigned, signature=tracker.sign(_credential_bytes(unsigned)))


def verify_credential(c: Credential, tracker_public_key: str, run_id: str, now: float | None = None) -> None:
    if c.run_id != run_id:
        raise AuthError(f"credential is for run {c.run_id!r}, not {run_id!r}")
    verify(tracker_public_key, c.signature, _credential_bytes(c), "credential")
    if (now if now is not None else time.time()) > c.expires_at:
        raise AuthError(f"credential of peer {c.peer_id} has expired; the peer must join again")


def _assignment_bytes(a: GroupAssignment) -> bytes:
    return b"crowdtrain-group\x00" + msgspec.json.encode(replace(a, signature=""))


def sign_assignment(tracker: SigningKey, a: GroupAssignment) -> GroupAssignment:
    return replace(a, signature=tracker.sign(_assignment_bytes(replace(a, signature=""))))


def verify_assignment(a: GroupAssignment, tracker_public_key: str) -> None:
    verify(tracker_public_key, a.signature, _assignment_bytes(a), "group assignment")


def request_bytes(purpose: str, *fields: str | int) -> bytes:
    """Canonical bytes a peer signs for one request: purpose, then each field, NUL-separated."""
    return "\x00".join([f"crowdtrain-{purpose}", *map(str, fields)]).encode()
