"""An async client of the tracker's JSON API (aiohttp; no torch), for the CLI, volunteers and tests.

Errors: :class:`TrackerUnreachable` when the tracker does not answer (its message names the URL and says
to check ``--tracker``), :class:`TrackerError` with the server's sentence and HTTP status otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import time
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote, quote_from_bytes, urlsplit

import aiohttp
import msgspec

from crowdtrain.protocol import bencode
from crowdtrain.protocol.aio import BodyTooLong, read_body
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import ProtocolError, TrackerError, TrackerUnreachable
from crowdtrain.protocol.limits import MAX_TOKENIZER_BYTES, MAX_TORRENT_BYTES, Limits
from crowdtrain.protocol.messages import (
    Complaint,
    ComplaintReply,
    Credential,
    CutCall,
    CutVerdict,
    DatasetRegistration,
    DonorList,
    ErrorBody,
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    JoinResponse,
    LeaveRequest,
    Message,
    PullReply,
    PullReport,
    ReadyReply,
    ReadyRequest,
    RoundVerdict,
    RoundVerdicts,
    RunCreate,
    RunCreated,
    RunList,
    RunSpec,
    RunStatus,
    SpotCheckVerdict,
    StateDeclare,
    StepWatch,
    decode,
    encode,
)
from crowdtrain.protocol.peerauth import sign_headers, sign_session_headers

M = TypeVar("M", bound=Message)
API = "/api/v1"
_STREAM_ABOVE = 1 << 20
# a later phase's verdicts are waited for up to the round's deadline (plus a margin), never longer than this
MAX_VERDICT_WAIT_S = 300.0


class TrackerClient:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        admin_token: str | None = None,
        limits: Limits | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise TrackerError(f"{url!r} is not a tracker URL; pass --tracker http://HOST:PORT")
        self.url = url.rstrip("/")
        if self.url.endswith("/announce"):
            self.url = self.url[: -len("/announce")]
        self.timeout_s = timeout_s
        self.admin_token = admin_token
        self.limits = limits or Limits(max_json_bytes=16 << 20)
        self._session: aiohttp.ClientSession | None = None
        # session keys from join, by credential signature: requests of a peer this client joined are
        # authenticated with a cheap HMAC instead of an Ed25519 signature
        self._session_keys: dict[str, tuple[str, str]] = {}

    async def __aenter__(self) -> TrackerClient:
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------ transport

    async def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        max_bytes: int | None = None,
    ) -> tuple[int, bytes]:
        if self._session is None:
            raise TrackerError("TrackerClient is not open; use it as 'async with TrackerClient(url) as c'")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        limit = self.limits.max_json_bytes if max_bytes is None else max_bytes
        all_headers = dict(headers or {})
        if body is not None:
            all_headers["Content-Type"] = "application/json"
        try:
            async with asyncio.timeout(timeout):
                # a body over 1 MiB (a run with a large torrent) is streamed from a file-like object, which
                # aiohttp reads off the event loop; raw bytes that large make it warn that the loop may stall
                data = io.BytesIO(body) if body is not None and len(body) > _STREAM_ABOVE else body
                async with self._session.request(
                    method, self.url + path, data=data, headers=all_headers, allow_redirects=False
                ) as resp:
                    try:
                        data = await read_body(resp.content, limit, resp.content_length)
                    except BodyTooLong as too_long:
                        raise TrackerError(
                            f"the tracker at {self.url} sent more than {limit} bytes for {path}", resp.status
                        ) from too_long
                    status = resp.status
        except TimeoutError:
            raise TrackerUnreachable(
                f"Tracker at {self.url} did not answer within {timeout:g} s; check --tracker or your network."
            ) from None
        except aiohttp.ClientError as exc:
            raise TrackerUnreachable(
                f"Tracker at {self.url} cannot be reached ({exc}); check --tracker or your network."
            ) from None
        if status >= 400:
            try:
                message = decode(data, ErrorBody).error
            except ProtocolError:
                message = f"the tracker at {self.url} answered {status} to {method} {path}"
            raise TrackerError(message, status)
        return status, data

    def _admin(self) -> dict[str, str]:
        if not self.admin_token:
            raise TrackerError("this needs the tracker's admin token; pass --admin-token")
        return {"Authorization": f"Bearer {self.admin_token}"}

    async def _get(self, path: str, kind: type[M]) -> M:
        _, data = await self._request("GET", path)
        return self._decode(data, kind)

    def _decode(self, data: bytes, kind: type[M]) -> M:
        try:
            return decode(data, kind, self.limits)
        except ProtocolError as exc:
            raise TrackerError(f"the tracker at {self.url} sent a malformed answer: {exc}") from None

    async def _signed(
        self,
        run_id: str,
        action: str,
        msg: Message,
        key: SigningKey,
        credential: Credential,
        timeout_s: float | None = None,
        query: str = "",
    ) -> bytes:
        path = f"{API}/runs/{run_id}/{action}"
        body = encode(msg)
        digest = hashlib.sha256(body).hexdigest()
        session = self._session_keys.get(credential.signature)
        if session is not None:
            headers = sign_session_headers(session[0], session[1], path, digest)
        else:
            headers = sign_headers(key, credential, "tracker", path, digest)
        _, data = await self._request("POST", path + query, body, headers, timeout_s)
        return data

    # ------------------------------------------------------------ admin

    async def create_run(self, create: RunCreate) -> RunCreated:
        _, data = await self._request("POST", f"{API}/runs", encode(create), self._admin())
        return self._decode(data, RunCreated)

    async def close_run(self, run_id: str) -> None:
        """Admin: the run takes no more steps; its volunteers are told (410) and leave."""
        await self._request("POST", f"{API}/runs/{run_id}/close", b"", self._admin())

    async def delete_run(self, run_id: str) -> None:
        """Admin: the run and its step history are deleted; its volunteers are told (410) and leave."""
        await self._request("DELETE", f"{API}/runs/{run_id}", None, self._admin())

    async def register_dataset(self, infohash_hex: str, name: str) -> DatasetRegistration:
        msg = DatasetRegistration(infohash=infohash_hex, name=name)
        _, data = await self._request("POST", f"{API}/datasets", encode(msg), self._admin())
        return self._decode(data, DatasetRegistration)

    # ------------------------------------------------------------ public

    async def healthz(self) -> dict[str, Any]:
        _, data = await self._request("GET", "/healthz")
        return msgspec.json.decode(data)

    async def serves_infohash(self, infohash_hex: str) -> bool:
        """Whether this tracker's /announce serves the swarm of ``infohash_hex`` (asked with a BEP 48 scrape)."""
        raw = bytes.fromhex(infohash_hex)
        _, data = await self._request("GET", f"/scrape?info_hash={quote_from_bytes(raw)}")
        try:
            answer = bencode.decode(data)
        except ProtocolError as exc:
            raise TrackerError(f"the tracker at {self.url} sent a malformed scrape answer: {exc}") from None
        files = answer.get(b"files") if isinstance(answer, dict) else None
        return isinstance(files, dict) and raw in files

    async def list_runs(self) -> RunList:
        return await self._get(f"{API}/runs", RunList)

    async def get_spec(self, run_id: str) -> RunSpec:
        return await self._get(f"{API}/runs/{run_id}", RunSpec)

    async def get_torrent(self, run_id: str) -> bytes:
        _, data = await self._request("GET", f"{API}/runs/{run_id}/torrent", max_bytes=MAX_TORRENT_BYTES)
        return data

    async def get_tokenizer(self, run_id: str) -> bytes | None:
        """The run's tokenizer.json, read whole (at most MAX_TOKENIZER_BYTES); None when the run has none.
        The caller checks its sha256 against the spec's ``dataset.manifest.tokenizer``."""
        try:
            _, data = await self._request(
                "GET", f"{API}/runs/{run_id}/tokenizer", max_bytes=MAX_TOKENIZER_BYTES
            )
        except TrackerError as exc:
            if exc.status == 404 and "has no tokenizer" in str(exc):  # (not: no such run)
                return None
            raise
        return data

    async def status(self, run_id: str) -> RunStatus:
        return await self._get(f"{API}/runs/{run_id}/status", RunStatus)

    async def watch_step(self, run_id: str, step: int, wait_s: float) -> StepWatch:
        """Wait (up to ``wait_s``, as the tracker allows) until ``step`` closed or the run passed it."""
        _, data = await self._request(
            "GET",
            f"{API}/runs/{run_id}/step?step={step}&wait_s={wait_s:g}",
            timeout_s=wait_s + self.timeout_s,
        )
        return self._decode(data, StepWatch)

    async def donors(self, run_id: str, without: str | None = None) -> DonorList:
        """The run's state donors; ``without``: a peer whose snapshots are not counted (the asking peer
        itself, whose own state is not the run's)."""
        query = "" if without is None else f"?without={quote(without, safe='')}"
        return await self._get(f"{API}/runs/{run_id}/state/donors{query}", DonorList)

    async def join(self, run_id: str, request: JoinRequest) -> JoinResponse:
        _, data = await self._request("POST", f"{API}/runs/{run_id}/join", encode(request))
        joined = self._decode(data, JoinResponse)
        if joined.session_key is not None:
            self.remember_session(joined.credential, joined.session_key)
        return joined

    def remember_session(self, credential: Credential, session_key: str) -> None:
        """Authenticate this credential's tracker requests with ``session_key`` (from its JoinResponse)."""
        header = base64.urlsafe_b64encode(encode(credential)).decode()
        self._session_keys[credential.signature] = (session_key, header)

    # ------------------------------------------------------------ a joined volunteer

    async def heartbeat(
        self, run_id: str, heartbeat: Heartbeat, key: SigningKey, credential: Credential
    ) -> HeartbeatReply:
        data = await self._signed(run_id, "heartbeat", heartbeat, key, credential)
        return self._decode(data, HeartbeatReply)

    async def ready(
        self,
        run_id: str,
        request: ReadyRequest,
        key: SigningKey,
        credential: Credential,
        wait_s: float = 20.0,
    ) -> ReadyReply:
        """Long-poll until the step's group is formed, or ``wait_s`` (capped by the tracker) passed."""
        data = await self._signed(
            run_id,
            "ready",
            request,
            key,
            credential,
            timeout_s=wait_s + self.timeout_s,
            query=f"?wait_s={wait_s:g}",
        )
        return self._decode(data, ReadyReply)

    async def leave(
        self, run_id: str, request: LeaveRequest, key: SigningKey, credential: Credential
    ) -> None:
        await self._signed(run_id, "leave", request, key, credential)

    async def declare_state(
        self, run_id: str, declare: StateDeclare, key: SigningKey, credential: Credential
    ) -> None:
        await self._signed(run_id, "state", declare, key, credential)

    async def cut(
        self, run_id: str, call: CutCall, key: SigningKey, credential: Credential, wait_s: float
    ) -> CutVerdict:
        """Vote to cut a part owner asleep in a round, or claim one's own part (tracker/cuts.py); a vote
        waits for the decision (at most the round's deadline, which ``wait_s`` should reach)."""
        data = await self._signed(run_id, "cut", call, key, credential, timeout_s=wait_s + self.timeout_s)
        return self._decode(data, CutVerdict)

    async def complain(
        self, run_id: str, complaint: Complaint, key: SigningKey, credential: Credential
    ) -> ComplaintReply:
        """Report a part owner whose answer's receipt did not hold (protocol/receipts.py)."""
        return self._decode(
            await self._signed(run_id, "complaint", complaint, key, credential), ComplaintReply
        )

    async def report_pull(
        self, run_id: str, report: PullReport, key: SigningKey, credential: Credential
    ) -> PullReply:
        """Report a member whose copy pointed against the others', with the receipts that show it
        (tracker/pulls.py)."""
        return self._decode(await self._signed(run_id, "pull", report, key, credential), PullReply)

    async def verdicts(
        self, run_id: str, verdict: RoundVerdict, key: SigningKey, credential: Credential
    ) -> RoundVerdicts:
        """Report the parts of a round this peer could not apply; every member's, once they reported (the
        tracker answers within 2 s: a slower answer is not waited for past 5 s, the round goes on without; in
        a later phase it waits for the cluster's columns up to the round's deadline, and 2 s more)."""
        timeout_s = min(self.timeout_s, 5.0)
        if verdict.assignment.phase > 0:
            timeout_s = min(
                max(timeout_s, verdict.assignment.deadline - time.time() + 5.0), MAX_VERDICT_WAIT_S
            )
        data = await self._signed(run_id, "verdicts", verdict, key, credential, timeout_s=timeout_s)
        return self._decode(data, RoundVerdicts)

    async def spot_check(
        self, run_id: str, verdict: SpotCheckVerdict, key: SigningKey, credential: Credential
    ) -> None:
        """Report the verdict of a spot-check the tracker drew this peer for."""
        await self._signed(run_id, "spotcheck", verdict, key, credential)
