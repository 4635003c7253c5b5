"""One log line, not a traceback, for each malformed HTTP request aiohttp refuses on our servers.

aiohttp answers a request it cannot parse (an over-long request line or header, a bad method, a broken
chunk) with its own 400 and logs "Error handling request" with the parser's full traceback: on a server
open to the internet, scanners alone fill the log. :func:`quiet_parser_errors` keeps such a record but makes
it one line that says who sent what was wrong; every other error keeps its traceback.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

_LOGGER = "aiohttp.server"


class _OneLineParserErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            sender = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "refused a malformed HTTP request from %s: %s"
            record.args = (sender, " ".join(str(exc.message or exc).split())[:200])
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_parser_errors() -> None:
    """Install the filter (once per process)."""
    logger = logging.getLogger(_LOGGER)
    if not any(isinstance(f, _OneLineParserErrors) for f in logger.filters):
        logger.addFilter(_OneLineParserErrors())
