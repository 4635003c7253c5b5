"""The admin's routes (each needs the tracker's admin token): register a data set, create, close and delete
a run. A new run's request is checked here as ``run create`` and every volunteer check it."""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import time
from typing import TYPE_CHECKING

from aiohttp import web

from crowdtrain.protocol import bencode
from crowdtrain.protocol.aio import BodyTooLong, read_body
from crowdtrain.protocol.errors import ConfigError, ProtocolError
from crowdtrain.protocol.limits import MAX_TOKENIZER_BASE64, MAX_TORRENT_BYTES, Limits
from crowdtrain.protocol.messages import DatasetRegistration, RunCreate, RunCreated, RunSpec, decode
from crowdtrain.protocol.runcheck import check_run, tokenizer_bytes
from crowdtrain.tracker.auth import check_admin
from crowdtrain.tracker.replies import ApiError, json_reply

if TYPE_CHECKING:
    from crowdtrain.tracker.parts import TrackerParts


def _slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]
    return slug or "run"


def _bad(field: str, problem: str) -> ApiError:
    return ApiError(400, f"RunCreate: {field} {problem}")


def checked_torrent(msg: RunCreate) -> bytes:
    """The run's torrent, once the request passed the checks ``run create`` and every volunteer make and
    the torrent is the data set's; an :class:`ApiError` 400 naming the field otherwise."""
    try:
        check_run(msg)  # the same check `run create` and every volunteer make
    except ConfigError as exc:
        raise _bad(exc.field, exc.problem) from None
    if not msg.model.param_hash:  # (its form is the schema's)
        raise _bad(
            "model.param_hash", "must be the 64-hex-character parameter hash of the recipe with these args"
        )
    if msg.join_policy == "token" and not msg.join_token:
        raise _bad("join_token", "is required when join_policy is 'token'")
    try:
        torrent = base64.b64decode(msg.torrent, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("torrent", "is not valid base64") from None
    if len(torrent) > MAX_TORRENT_BYTES:
        raise _bad(
            "torrent",
            f"is {len(torrent)} bytes, more than the {MAX_TORRENT_BYTES} bytes a data set torrent may have",
        )
    try:
        infohash = bencode.infohash_v1(torrent)
    except ProtocolError as exc:
        raise _bad("torrent", f"is not a .torrent file ({exc})") from None
    if infohash != msg.dataset.infohash:
        raise _bad("dataset.infohash", f"is {msg.dataset.infohash} but the torrent's info-hash is {infohash}")
    return torrent


class Admin:
    """The admin's routes of one tracker."""

    def __init__(self, tracker: TrackerParts) -> None:
        self.tracker = tracker

    def _check(self, request: web.Request) -> None:
        check_admin(request.headers, self.tracker.admin_token)

    async def register_dataset(self, request: web.Request) -> web.Response:
        self._check(request)
        msg = decode(await self.tracker.body(request), DatasetRegistration, self.tracker.limits)
        self.tracker.store.add_dataset(msg.infohash, msg.name)
        self.tracker.registered.add(bytes.fromhex(msg.infohash))
        return json_reply(msg, 201)

    async def create_run(self, request: web.Request) -> web.Response:
        self._check(request)
        # a RunCreate may carry the data set's tokenizer on top of what max_body_bytes allows (admin only)
        limit = self.tracker.config.max_body_bytes + MAX_TOKENIZER_BASE64
        try:
            body = await read_body(request.content, limit, request.content_length)
        except BodyTooLong:
            raise ApiError(413, f"request body is larger than the tracker's limit of {limit} bytes") from None
        msg = decode(body, RunCreate, Limits(max_json_bytes=limit))
        torrent = checked_torrent(msg)
        try:
            tokenizer = tokenizer_bytes(msg)  # (its sha256 against the manifest's)
        except ConfigError as exc:
            raise _bad(exc.field, exc.problem) from None
        spec = RunSpec(
            run_id=f"{_slug(msg.name)}-{secrets.token_hex(3)}",
            name=msg.name,
            model=msg.model,
            dataset=msg.dataset,
            optimizer=msg.optimizer,
            schedule=msg.schedule,
            target_batch_size=msg.target_batch_size,
            micro_batch_size=msg.micro_batch_size,
            averaging=msg.averaging,
            eval=msg.eval,
            join_policy=msg.join_policy,
            tracker_public_key=self.tracker.public_key,
            seed=msg.seed,
            created_at=time.time(),
        )
        self.tracker.runs.create(spec, torrent, msg.join_token, tokenizer)
        self.tracker.registered.add(bytes.fromhex(spec.dataset.infohash))
        return json_reply(RunCreated(run_id=spec.run_id, spec=spec), 201)

    async def close_run(self, request: web.Request) -> web.Response:
        """The run takes no more steps; its volunteers are answered 410 and leave. Idempotent."""
        self._check(request)
        self.tracker.runs.close(self.tracker.run_of(request), time.time())
        return web.Response(status=204)

    async def delete_run(self, request: web.Request) -> web.Response:
        """The run and its history are deleted; its volunteers are answered 410 (while this tracker runs)
        and leave."""
        self._check(request)
        self.tracker.runs.delete(self.tracker.run_of(request), time.time())
        return web.Response(status=204)
