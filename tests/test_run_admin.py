"""An admin closes and deletes runs (issue 16): volunteers are told and leave cleanly, nobody joins a closed
run, its history stays readable, a closed run stays closed across a tracker restart, a deleted one is gone."""

from __future__ import annotations

import asyncio

import pytest

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import TrackerError
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from crowdtrain.volunteer import events as ev
from tests.harness import cli, published_run, until, volunteers
from tests.sim import SimVolunteer, make_run_create


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_closing_a_live_run_makes_its_volunteers_leave_and_refuses_joins(tmp_path, cli_env):
    left: list[ev.Left] = []

    def watch(e: ev.Event) -> None:
        if isinstance(e, ev.Left):
            left.append(e)

    async with published_run(tmp_path, target_batch_size=32) as run:
        run_id = run.spec.run_id
        vols = volunteers(run, tmp_path, 2, emit=watch)
        tasks = [asyncio.create_task(v.run()) for v in vols]
        await until(
            lambda: min(v.summary.steps_done for v in vols) >= 2, 120, "two steps taken", watching=tasks
        )
        out = await cli(
            cli_env,
            "run",
            "close",
            run_id,
            "--tracker",
            run.tracker.url,
            "--admin-token",
            run.tracker.admin_token,
        )
        assert out.returncode == 0 and out.stdout.strip() == f"run {run_id} closed", out
        # both leave on their own (no stop() from here), with the tracker's sentence
        summaries = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for s in summaries:
            assert s.ended is not None and f"run {run_id} was closed by its admin" in s.ended, s.ended
        assert len(left) == 2 and all(f"run {run_id} was closed by its admin" in e.reason for e in left), left
        async with TrackerClient(run.tracker.url, admin_token=run.tracker.admin_token) as client:
            status = await client.status(run_id)
            assert status.closed_at is not None and status.peers_online == 0
            assert "closed by its admin" in (status.notice or "")
            assert len(status.recent_steps) >= 2  # its history stays readable
            step = status.global_step
            newcomer = SimVolunteer(client, run_id)
            with pytest.raises(TrackerError, match="was closed by its admin") as refused:
                await newcomer.join()
            assert refused.value.status == 410
            await asyncio.sleep(1.0)
            assert (await client.status(run_id)).global_step == step  # no step closes any more
        # `crowdtrain join` says it in one sentence and exits 1
        out = await cli(
            cli_env,
            "join",
            run_id,
            "--tracker",
            run.tracker.url,
            "--plain",
            "--data-dir",
            str(tmp_path / "late"),
        )
        assert out.returncode == 1 and out.stderr.strip().startswith("error:"), out
        assert "was closed by its admin" in out.stderr and "Traceback" not in out.stderr


async def test_a_closed_run_stays_closed_after_a_restart_and_a_deleted_one_is_gone(tmp_path, cli_env):
    db = str(tmp_path / "tracker.db")
    async with serve(TrackerConfig(db=db)) as tracker:
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
            closed = (await client.create_run(make_run_create("closed one"))).run_id
            deleted = (await client.create_run(make_run_create("deleted one"))).run_id
            v = SimVolunteer(client, deleted)
            await v.join()
            await client.close_run(closed)
            await client.close_run(closed)  # idempotent
            out = await cli(
                cli_env,
                "run",
                "delete",
                deleted,
                "--yes",
                "--tracker",
                tracker.url,
                "--admin-token",
                tracker.admin_token,
            )
            assert out.returncode == 0, out
            # its volunteer is told, not left guessing
            with pytest.raises(TrackerError, match=f"run {deleted} was deleted by its admin") as gone:
                await v.heartbeat(0, 1)
            assert gone.value.status == 410
            listed = {r.run_id: r for r in (await client.list_runs()).runs}
            assert deleted not in listed and listed[closed].closed_at is not None
            without_token = await cli(cli_env, "run", "close", closed, "--tracker", tracker.url)
            assert without_token.returncode == 1 and "--admin-token" in without_token.stderr
    async with serve(TrackerConfig(db=db)) as tracker:
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
            listed = {r.run_id: r for r in (await client.list_runs()).runs}
            assert set(listed) == {closed} and listed[closed].closed_at is not None
            with pytest.raises(TrackerError, match="was closed by its admin"):
                await SimVolunteer(client, closed).join()
            with pytest.raises(TrackerError, match=f"there is no run '{deleted}'"):
                await client.status(deleted)
