"""What the route handlers (:mod:`crowdtrain.tracker.admin`, :mod:`crowdtrain.tracker.volunteers`) use of the
tracker: its parts, as a :class:`typing.Protocol` the server's :class:`~crowdtrain.tracker.server.Tracker`
meets, so the handlers need not import the server that builds them (no import loop in ``tracker/``)."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.limits import Limits
from crowdtrain.tracker.auth import PeerAuth
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.reach import Checker
from crowdtrain.tracker.runs import Run, Runs
from crowdtrain.tracker.store import RunStore


class RateLimit(Protocol):
    def allow(self, key: str) -> bool:
        """Whether a request from ``key`` (a client address) is let through now."""
        ...


class TrackerParts(Protocol):
    config: TrackerConfig
    store: RunStore
    signer: SigningKey
    public_key: str
    admin_token: str
    limits: Limits
    auth: PeerAuth
    runs: Runs
    registered: set[bytes]
    checker: Checker

    @property
    def join_limit(self) -> RateLimit:
        """The per-address limit on joins."""
        ...

    async def body(self, request: web.Request) -> bytes:
        """The request's body, at most the tracker's ``max_body_bytes`` (413 beyond)."""
        ...

    def run_of(self, request: web.Request) -> Run:
        """The run the request's path names: 404 if there is none, 410 if its admin deleted it."""
        ...
