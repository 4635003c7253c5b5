"""Shared fixtures. Real servers bind 127.0.0.1:0 and read back their port; nothing here mocks the network."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hypothesis  # noqa: F401 - imported (and assertion-rewritten) at start-up, never late; see below
import pytest

# CPython 3.11.7 can leave its AST recursion counter off after a failed AST construction (gh-106905,
# fixed in 3.11.8); pytest's hypothesis plugin then parses hypothesis at the terminal summary and fails with
# "AST constructor recursion depth mismatch". Importing hypothesis here keeps every parse at start-up.
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for running ``python -m crowdtrain`` in a subprocess."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("COLUMNS", "120")
    return env


@pytest.fixture
def python() -> str:
    return sys.executable
