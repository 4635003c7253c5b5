"""The tracker as a process: it imports no torch, prints its URL, survives SIGKILL on the same --db with runs,
tokens and history intact, and a volunteer's next heartbeat re-registers it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import TrackerError
from tests.faults import TrackerProcess
from tests.sim import SimVolunteer, make_run_create

HEAVY = ("torch", "libtorrent", "rich")


def test_importing_and_starting_the_tracker_imports_no_torch(tmp_path):
    code = (
        "import asyncio, sys\n"
        "import crowdtrain.tracker.server as s\n"
        "from crowdtrain.tracker.config import TrackerConfig\n"
        "async def main():\n"
        "    async with s.serve(TrackerConfig()) as t:\n"
        "        from crowdtrain.protocol.client import TrackerClient\n"
        "        async with TrackerClient(t.url) as c:\n"
        "            await c.list_runs()\n"
        "asyncio.run(main())\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    modules = {name.split(".")[0] for name in out.stdout.split()}
    assert "aiohttp" in modules  # it did start a server
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


@pytest.mark.slow
async def test_sigkill_and_restart_keeps_runs_tokens_history_and_heartbeat_reregisters(tmp_path):
    db = tmp_path / "tracker.sqlite3"
    first = await TrackerProcess.start(db)
    try:
        async with TrackerClient(first.url, admin_token=first.admin_token) as c:
            created = await c.create_run(
                make_run_create("durable", target_batch_size=10, join_token="join-me-please")
            )
            run_id = created.run_id
            v = SimVolunteer(c, run_id)
            await v.serve()  # a reachable peer: a round needs a part owner
            await v.join(token="join-me-please")
            await v.wait_reachable()
            await v.heartbeat(0, 10)
            assert (await v.ready(0, 10)).status == "group"
            before = await c.status(run_id)
            history = before.recent_steps
            assert [r.step for r in history] == [0]
            # the credit ledger: its key's 10 samples entered step 0's average
            assert [(x.public_key, x.samples, x.steps) for x in before.credits] == [(v.key.public_hex, 10, 1)]
    finally:
        await v.close()
        first.kill()
        await first.child.wait(30)
    assert first.proc.returncode == -signal.SIGKILL

    second = await TrackerProcess.start(db)
    try:
        assert second.admin_token == first.admin_token
        async with TrackerClient(second.url, admin_token=second.admin_token) as c:
            spec = await c.get_spec(run_id)
            assert spec == created.spec  # same tracker key too: old credentials still verify
            status = await c.status(run_id)
            assert (status.global_step, status.peers_online) == (1, 0)
            assert status.recent_steps == history
            assert status.credits == before.credits  # the credit ledger survives the SIGKILL
            # the private run still wants its token
            with pytest.raises(TrackerError, match="is private"):
                await SimVolunteer(c, run_id).join()
            # the volunteer talks to the new process with its old credential (Ed25519-signed: this client
            # did not see the join)
            v.client = c
            reply = await v.heartbeat(1, 4)
            assert (reply.global_step, reply.peers_online, reply.samples) == (1, 1, 4)
            assert [p.peer_id for p in (await c.status(run_id)).peers] == [v.peer_id]
            # and its session key from before the restart still works (the tracker's secret is durable)
            c.remember_session(v.joined.credential, v.joined.session_key)
            assert (await v.heartbeat(1, 6)).samples == 6
            # and the admin token still works
            assert (await c.create_run(make_run_create("second"))).run_id
    finally:
        second.proc.send_signal(signal.SIGTERM)
        code = await second.child.wait(30)
    assert code == 0, second.lines
    assert "tracker stopped" in second.lines


@pytest.mark.slow
async def test_sigint_stops_gracefully():
    p = await TrackerProcess.start(":memory:")
    p.proc.send_signal(signal.SIGINT)
    assert await p.child.wait(30) == 0, p.lines
    assert p.lines[-1] == "tracker stopped"
