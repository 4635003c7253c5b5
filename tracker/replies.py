"""How the tracker's routes answer: JSON messages, HTML pages, refusals (:class:`ApiError`, a status and a
sentence) and the numbers they read from a query string."""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.protocol.messages import ErrorBody, Message, encode

JSON = "application/json"


class ApiError(CrowdtrainError):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


def json_reply(msg: Message, status: int = 200) -> web.Response:
    return web.Response(body=encode(msg), status=status, content_type=JSON)


def html_reply(page: str) -> web.Response:
    return web.Response(
        text=page,
        content_type="text/html",
        headers={
            # inline style and script of its own, data from this origin only, no frames
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
            "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-store",
        },
    )


def error_reply(status: int, message: str) -> web.Response:
    return json_reply(ErrorBody(error=message), status)


def query_number(
    request: web.Request, name: str, kind: type, low: float, high: float, default: Any = None
) -> Any:
    """The query's ``name`` as a ``kind`` (int or float) from ``low`` to ``high``; ``default`` when it is
    absent (None: it is required). Anything else is an :class:`ApiError` 400 saying what was expected."""
    raw = request.query.get(name)
    if raw is None:
        if default is None:
            raise ApiError(400, f"the query needs {name}= (a number from {low:g} to {high:g})")
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ApiError(
            400, f"{name} must be a {'whole ' if kind is int else ''}number, not {raw[:40]!r}"
        ) from None
    if not (math.isfinite(value) and low <= value <= high):
        raise ApiError(400, f"{name} must be a number from {low:g} to {high:g}")
    return value
