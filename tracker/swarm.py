"""In-memory BitTorrent swarms: who announced which info-hash, and random samples of them.

Each swarm keeps its peers in a list plus an index. A new peer goes to a random position (the one there
moves to the end), so the list is always a random permutation, and a sample of ``numwant`` peers is a
window at a random offset: adding, removing and sampling cost O(1) per peer whatever the swarm's size.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class SwarmPeer:
    peer_id: bytes
    ip: str
    packed_ip: bytes  # 4 bytes (IPv4) or 16 bytes (IPv6)
    port: int
    seeding: bool
    last_seen: float
    compact: bytes = b""  # packed_ip + port, big-endian (BEP 23 / BEP 7)

    def __post_init__(self) -> None:
        self.compact = self.packed_ip + self.port.to_bytes(2, "big")


@dataclass(slots=True)
class Swarm:
    peers: list[SwarmPeer] = field(default_factory=list)
    index: dict[bytes, int] = field(default_factory=dict)
    downloaded: int = 0  # "completed" events seen
    seeders: int = 0

    def upsert(self, peer: SwarmPeer) -> None:
        i = self.index.get(peer.peer_id)
        if i is None:
            n = len(self.peers)
            j = int(random.random() * (n + 1))
            if j == n:
                self.peers.append(peer)
            else:
                moved = self.peers[j]
                self.peers.append(moved)
                self.index[moved.peer_id] = n
                self.peers[j] = peer
            self.index[peer.peer_id] = j
        else:
            self.seeders -= self.peers[i].seeding
            self.peers[i] = peer
        self.seeders += peer.seeding

    def remove(self, peer_id: bytes) -> None:
        i = self.index.pop(peer_id, None)
        if i is None:
            return
        gone = self.peers[i]
        last = self.peers.pop()
        if last is not gone:
            self.peers[i] = last
            self.index[last.peer_id] = i
        self.seeders -= gone.seeding

    def sample(self, count: int, exclude: bytes) -> list[SwarmPeer]:
        n = len(self.peers)
        if n == 0 or count <= 0:
            return []
        if n <= count + 1:
            window = self.peers
        else:
            start = int(random.random() * n)
            window = self.peers[start : start + count + 1]
            if len(window) < count + 1:
                window += self.peers[: count + 1 - len(window)]
        return [p for p in window if p.peer_id != exclude][:count]

    def expire(self, before: float) -> int:
        stale = [p.peer_id for p in self.peers if p.last_seen < before]
        for peer_id in stale:
            self.remove(peer_id)
        return len(stale)


class Swarms:
    def __init__(self, max_peers: int) -> None:
        self.max_peers = max_peers
        self.by_hash: dict[bytes, Swarm] = {}

    def get(self, info_hash: bytes) -> Swarm:
        swarm = self.by_hash.get(info_hash)
        if swarm is None:
            swarm = self.by_hash[info_hash] = Swarm()
        return swarm

    def expire(self, ttl_s: float) -> int:
        before = time.monotonic() - ttl_s
        removed = 0
        for info_hash, swarm in list(self.by_hash.items()):
            removed += swarm.expire(before)
            if not swarm.peers:
                del self.by_hash[info_hash]
        return removed

    def total_peers(self) -> int:
        return sum(len(s.peers) for s in self.by_hash.values())
