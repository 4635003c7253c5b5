"""Shared fixtures. Real servers bind 127.0.0.1:0 and read back their port; nothing here mocks the network."""

from __future__ import annotations

import gc
import os
import sys

import hypothesis  # noqa: F401 - imported (and assertion-rewritten) at start-up, never late; see below
import pytest

# CPython 3.11.7 can leave its AST recursion counter off after a failed AST construction (gh-106905,
# fixed in 3.11.8); pytest's hypothesis plugin then parses hypothesis at the terminal summary and fails with
# "AST constructor recursion depth mismatch". Importing hypothesis here keeps every parse at start-up.


# `crowdtrain join` asks the home router for port mappings by default (UPnP SSDP multicast, NAT-PMP to the
# gateway). On this machine traffic may go only to loopback and to hosts in namespaces the suite made, so every
# volunteer the suite starts has it off (the join option's environment form), except those started on purpose
# behind a UPnP router in a namespace (tests/test_port_mapping.py), which unset it.
os.environ["CROWDTRAIN_PORT_MAPPING"] = "0"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "tracker_config(**fields): the TrackerConfig fields of the `tracker` fixture (test or module)",
    )


@pytest.fixture
async def tracker(request: pytest.FixtureRequest):
    """A real tracker serving on 127.0.0.1 (its database in memory) for the test; the closest
    ``@pytest.mark.tracker_config(**fields)`` (on the test, else its module's ``pytestmark``) sets its config."""
    from crowdtrain.tracker.config import TrackerConfig
    from crowdtrain.tracker.server import serve

    marker = request.node.get_closest_marker("tracker_config")
    async with serve(TrackerConfig(**(marker.kwargs if marker else {}))) as running:
        yield running


@pytest.fixture
async def admin(tracker):
    """A client of the ``tracker`` fixture that holds its admin token."""
    from crowdtrain.protocol.client import TrackerClient

    async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
        yield client


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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything the test modules imported (torch among them: ~200,000 objects) is moved out of the
    collector's reach once, so the collection after each test below scans only what the tests made: 0.2 s a
    test less, about four minutes over the suite."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test():
    """Leaked sockets and sessions surface as ResourceWarnings when collected; collect after every test so
    the report names the test that leaked, not whichever test the collector happened to run in."""
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Several volunteers share this 2-core machine in one test: one torch thread each is much faster
    than oversubscribed intra-op threads. A no-op for tests that never imported torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
