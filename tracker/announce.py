"""BitTorrent ``/announce`` (BEP 3, 7, 23) and ``/scrape`` (BEP 48): parse the raw query, answer in bencode.

``info_hash`` and ``peer_id`` are binary; they are read from the raw query string with
``unquote_to_bytes`` (aiohttp's decoded ``request.query`` would replace non-UTF-8 bytes). Every defect
becomes an :class:`AnnounceError` whose sentence goes back as a bencoded ``failure reason``.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from crowdtrain.protocol import bencode
from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.tracker.swarm import SwarmPeer, Swarms

MAX_QUERY_BYTES = 8000  # aiohttp refuses request lines past 8190 bytes before we see them
MAX_PARAMS = 128
MAX_SCRAPE_HASHES = 100
EVENTS = {b"", b"started", b"stopped", b"completed", b"paused"}


class AnnounceError(ProtocolError):
    """An announce or scrape the tracker refuses; the text is sent as ``failure reason``."""


def failure(reason: str) -> bytes:
    return bencode.encode({b"failure reason": reason})


def parse_query(raw: str) -> list[tuple[bytes, bytes]]:
    if len(raw) > MAX_QUERY_BYTES:
        raise AnnounceError(f"the query string is longer than {MAX_QUERY_BYTES} bytes")
    pairs = []
    for part in raw.split("&"):
        if not part:
            continue
        key, _, value = part.partition("=")
        # most values are plain ASCII (digits, names); only percent-escapes need the slow path
        pairs.append(
            (
                unquote_to_bytes(key) if "%" in key or "+" in key else key.encode(),
                unquote_to_bytes(value) if "%" in value else value.encode(),
            )
        )
        if len(pairs) > MAX_PARAMS:
            raise AnnounceError(f"the query string has more than {MAX_PARAMS} parameters")
    return pairs


def _int(params: dict[bytes, bytes], name: str, default: int | None, lo: int, hi: int) -> int:
    raw = params.get(name.encode())
    if raw is None:
        if default is None:
            raise AnnounceError(f"the announce lacks the '{name}' parameter")
        return default
    if not raw.isdigit() or len(raw) > 20:
        raise AnnounceError(f"'{name}' must be a non-negative integer, got {raw[:32]!r}")
    value = int(raw)
    if not lo <= value <= hi:
        raise AnnounceError(f"'{name}' must be between {lo} and {hi}, got {value}")
    return value


def _hash20(value: bytes, name: str) -> bytes:
    if len(value) != 20:
        raise AnnounceError(f"{name} must be 20 bytes, got {len(value)}")
    return value


@dataclass(frozen=True, slots=True)
class Announce:
    info_hash: bytes
    peer_id: bytes
    port: int
    left: int | None
    compact: bool
    no_peer_id: bool
    numwant: int
    event: bytes


def parse_announce(raw_query: str, max_numwant: int) -> Announce:
    params = dict(parse_query(raw_query))
    if b"info_hash" not in params:
        raise AnnounceError("the announce lacks the 'info_hash' parameter")
    if b"peer_id" not in params:
        raise AnnounceError("the announce lacks the 'peer_id' parameter")
    event = params.get(b"event", b"")
    if event not in EVENTS:
        raise AnnounceError(f"'event' must be started, stopped, completed or empty, got {event[:32]!r}")
    left_raw = params.get(b"left")
    return Announce(
        info_hash=_hash20(params[b"info_hash"], "info_hash"),
        peer_id=_hash20(params[b"peer_id"], "peer_id"),
        port=_int(params, "port", None, 1, 65535),
        left=None if left_raw is None else _int(params, "left", None, 0, 2**63 - 1),
        compact=_int(params, "compact", 1, 0, 1) == 1,
        no_peer_id=_int(params, "no_peer_id", 0, 0, 1) == 1,
        numwant=min(_int(params, "numwant", 50, 0, 2**31), max_numwant),
        event=event,
    )


@functools.lru_cache(maxsize=65536)
def _packed(ip: str) -> bytes:
    return ipaddress.ip_address(ip).packed


def answer_announce(
    req: Announce, ip: str, swarms: Swarms, interval: int, min_interval: int, max_swarm_peers: int
) -> bytes:
    try:
        packed = _packed(ip)
    except ValueError:
        raise AnnounceError(f"cannot take a peer address from {ip!r}") from None
    swarm = swarms.get(req.info_hash)
    if req.event == b"stopped":
        swarm.remove(req.peer_id)
        peers: list[SwarmPeer] = []
    else:
        if req.event == b"completed":
            swarm.downloaded += 1
        if req.peer_id not in swarm.index and len(swarm.peers) >= max_swarm_peers:
            raise AnnounceError("this swarm is full; try again later")
        swarm.upsert(SwarmPeer(req.peer_id, ip, packed, req.port, req.left == 0, time.monotonic()))
        peers = swarm.sample(req.numwant, exclude=req.peer_id)
    reply: dict[bytes, object] = {  # non-compact answers go through the generic encoder
        b"interval": interval,
        b"min interval": min_interval,
        b"complete": swarm.seeders,
        b"incomplete": len(swarm.peers) - swarm.seeders,
    }
    if req.compact:
        v4 = b"".join([p.compact for p in peers if len(p.compact) == 6])
        v6 = b"".join([p.compact for p in peers if len(p.compact) == 18])
        # the common answer, written directly (keys in BEP 3 sorted order)
        return b"".join(
            (
                b"d8:completei%de10:incompletei%de8:intervali%de12:min intervali%de5:peers%d:"
                % (swarm.seeders, len(swarm.peers) - swarm.seeders, interval, min_interval, len(v4)),
                v4,
                b"6:peers6%d:%se" % (len(v6), v6) if v6 else b"e",
            )
        )
    else:
        listed = []
        for p in peers:
            entry: dict[bytes, object] = {b"ip": p.ip, b"port": p.port}
            if not req.no_peer_id:
                entry[b"peer id"] = p.peer_id
            listed.append(entry)
        reply[b"peers"] = listed
    return bencode.encode(reply)


def answer_scrape(raw_query: str, swarms: Swarms, allowed: set[bytes] | None) -> bytes:
    """BEP 48; ``allowed`` None serves any info-hash (an open tracker)."""
    hashes = [_hash20(v, "info_hash") for k, v in parse_query(raw_query) if k == b"info_hash"]
    if len(hashes) > MAX_SCRAPE_HASHES:
        raise AnnounceError(f"a scrape may ask for at most {MAX_SCRAPE_HASHES} info-hashes")
    if not hashes:
        hashes = sorted(swarms.by_hash if allowed is None else allowed)[:MAX_SCRAPE_HASHES]
    files: dict[bytes, object] = {}
    for h in hashes:
        if allowed is not None and h not in allowed:
            continue
        swarm = swarms.by_hash.get(h)
        seeders = swarm.seeders if swarm else 0
        total = len(swarm.peers) if swarm else 0
        files[h] = {
            b"complete": seeders,
            b"incomplete": total - seeders,
            b"downloaded": swarm.downloaded if swarm else 0,
        }
    return bencode.encode({b"files": files})
