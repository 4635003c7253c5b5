"""Small real things to drive a tracker with, for the tests and `bench/tracker_load.py` (not installed).

* :func:`make_torrent` writes a v1 .torrent for some bytes (pure bencode; no libtorrent);
* :func:`make_run_create` builds a :class:`RunCreate` around such a torrent;
* :class:`PingServer` is a minimal peer server answering ``GET /v1/ping`` (a reachable volunteer);
* :class:`SimVolunteer` joins a run and speaks for one peer with its own key; after :meth:`SimVolunteer.serve`
  it is reachable (its own :class:`PingServer`, declared as ``":PORT"`` like ``crowdtrain join`` does).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib

from aiohttp import web

from crowdtrain.protocol import bencode
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.messages import (
    PEER_PROTOCOL,
    AveragingSpec,
    ChunkInfo,
    DatasetManifest,
    DatasetRef,
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    JoinResponse,
    LeaveRequest,
    ModelSpec,
    ReadyReply,
    ReadyRequest,
    RunCreate,
    StateDeclare,
    StateVersion,
)


def make_torrent(
    name: str, data: bytes, announce: str = "http://127.0.0.1/announce", piece_length: int = 16384
) -> bytes:
    pieces = b"".join(
        hashlib.sha1(data[i : i + piece_length]).digest() for i in range(0, max(len(data), 1), piece_length)
    )
    info = {b"name": name, b"length": len(data), b"piece length": piece_length, b"pieces": pieces}
    return bencode.encode({b"announce": announce, b"info": info})


def make_run_create(
    name: str = "demo run",
    torrent: bytes | None = None,
    *,
    target_batch_size: int = 64,
    averaging: AveragingSpec | None = None,
    join_token: str | None = None,
) -> RunCreate:
    torrent = torrent if torrent is not None else make_torrent("demo", b"x" * 40000)
    manifest = DatasetManifest(
        name="demo",
        kind="tokens",
        dtype="uint8",
        chunk_bytes=40000,
        chunks=[
            ChunkInfo(
                name="demo", samples=40000, bytes=40000, sha256=hashlib.sha256(b"x" * 40000).hexdigest()
            )
        ],
        total_samples=40000,
    )
    return RunCreate(
        name=name,
        model=ModelSpec(recipe="mlp", args={"hidden": 32}, param_hash="ab" * 32),
        dataset=DatasetRef(infohash=bencode.infohash_v1(torrent), manifest=manifest),
        torrent=base64.b64encode(torrent).decode(),
        target_batch_size=target_batch_size,
        averaging=averaging or AveragingSpec(),
        join_policy="token" if join_token else "public",
        join_token=join_token,
    )


class PingServer:
    """A peer server that only answers ``GET /v1/ping`` with its peer id (set after join)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.peer_id = ""
        self.address = ""
        self._runner: web.AppRunner | None = None

    async def _ping(self, request: web.Request) -> web.Response:
        return web.json_response({"peer_id": self.peer_id})

    async def __aenter__(self) -> PingServer:
        app = web.Application()
        app.router.add_get("/v1/ping", self._ping)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, 0).start()
        self.address = f"{self.host}:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class SimVolunteer:
    """One joined peer: its key, credential and the signed calls it makes."""

    def __init__(self, client: TrackerClient, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.key = SigningKey()
        self.joined: JoinResponse | None = None
        self.address: str | None = None
        self._server: PingServer | None = None

    async def serve(self) -> None:
        """Answer the tracker's reachability check from now on (call before :meth:`join`)."""
        self._server = await PingServer().__aenter__()
        self.address = ":" + self._server.address.rpartition(":")[2]

    async def wait_reachable(self, within_s: float = 5.0, samples: int = 0) -> None:
        """Heartbeat (step 0, ``samples``) until the tracker says its check of this peer answered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while not (await self.heartbeat(0, samples)).reachable:
            if loop.time() > deadline:
                raise TimeoutError(f"the tracker did not reach peer {self.peer_id} at {self.address}")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.__aexit__(None, None, None)
            self._server = None

    @property
    def peer_id(self) -> str:
        assert self.joined is not None, "join first"
        return self.joined.peer_id

    async def join(self, address: str | None = None, token: str | None = None) -> JoinResponse:
        if address is not None or self._server is None:
            self.address = address
        self.joined = await self.client.join(
            self.run_id,
            JoinRequest(
                public_key=self.key.public_hex, address=self.address, token=token, peer_protocol=PEER_PROTOCOL
            ),
        )
        if self._server is not None:
            self._server.peer_id = self.joined.peer_id
        return self.joined

    async def heartbeat(
        self,
        step: int,
        samples: int,
        samples_per_s: float = 1e6,
        *,
        computing: bool = True,
        upload_bps: float | None = None,
    ) -> HeartbeatReply:
        assert self.joined is not None, "join first"
        hb = Heartbeat(
            peer_id=self.peer_id,
            step=step,
            samples=samples,
            samples_per_s=samples_per_s,
            address=self.address,
            computing=computing,
            upload_bps=upload_bps,
        )
        return await self.client.heartbeat(self.run_id, hb, self.key, self.joined.credential)

    async def ready(self, step: int, weight: int, wait_s: float = 20.0, *, ahead: int = 0) -> ReadyReply:
        assert self.joined is not None, "join first"
        req = ReadyRequest(peer_id=self.peer_id, step=step, weight=weight, ahead=ahead)
        return await self.client.ready(self.run_id, req, self.key, self.joined.credential, wait_s=wait_s)

    async def declare_state(
        self, step: int, content_hash: str, size: int, older: tuple[tuple[int, str, int], ...] = ()
    ) -> None:
        assert self.joined is not None, "join first"
        msg = StateDeclare(
            peer_id=self.peer_id,
            state=StateVersion(step=step, content_hash=content_hash, size=size),
            older=[StateVersion(step=s, content_hash=h, size=n) for s, h, n in older],
        )
        await self.client.declare_state(self.run_id, msg, self.key, self.joined.credential)

    async def leave(self, kept: tuple[int, str, int] | None = None) -> None:
        """Leave, telling the state kept (step, content hash, size) when ``kept`` is given."""
        assert self.joined is not None, "join first"
        version = None if kept is None else StateVersion(step=kept[0], content_hash=kept[1], size=kept[2])
        await self.client.leave(
            self.run_id, LeaveRequest(peer_id=self.peer_id, kept=version), self.key, self.joined.credential
        )
