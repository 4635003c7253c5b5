"""Shared fixtures. Real servers bind 127.0.0.1:0 and read back their port; nothing here mocks the network."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

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
