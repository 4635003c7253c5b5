"""The tracker process SIGKILLed during a run and restarted on the same database and port: the volunteers
keep accumulating while it is down, then resume averaging; no global step is lost or counted twice, and no
sample a volunteer trained on goes missing.

The tracker is a real ``crowdtrain tracker serve`` process; the volunteers run in this process so that their
parameters and every sample they drew can be checked.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time

import numpy as np
import pytest

from crowdtrain.datasets.make import make_dataset
from crowdtrain.datasets.session import SessionConfig, TorrentSession
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.publisher import build_run_create
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from tests.faults import TrackerProcess, losses_on_a_fixed_batch, record_outcome
from tests.harness import TINY_GPT, Recorder, until
from tests.sim import SimVolunteer, make_run_create

KILL_AT_STEP = 2
DOWN_S = 4.0
STEPS_AFTER_RESTART = 3
# Large enough that a step takes seconds: the kill lands while the volunteers accumulate toward it, far from
# the moment the tracker forms groups (see "A step formed just before the kill" in docs/reliability.md).
TARGET = 6000
TRACKER_OPTIONS = ("--heartbeat-interval", "0.2", "--peer-ttl", "30", "--join-rate", "0")


def samples_drawn(rec: Recorder) -> int:
    """Every sample a volunteer computed a gradient on (its recorder keeps each micro-batch's provenance)."""
    return sum(len(batch) for batches in rec.batches.values() for batch in batches)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_tracker_sigkilled_and_restarted_loses_no_step_and_no_sample(tmp_path):
    db = tmp_path / "tracker.sqlite3"
    tracker = await TrackerProcess.start(db, options=TRACKER_OPTIONS)
    second: TrackerProcess | None = None
    seen: list[list[ev.Event]] = [[], []]
    recs = [Recorder() for _ in range(2)]
    try:
        data = tmp_path / "dataset"
        manifest = await asyncio.to_thread(
            make_dataset,
            "builtin:stdlib",
            data,
            chunk_bytes=64 * 1024,
            name="stdlib-restart",
            announce_url=f"{tracker.url}/announce",
            max_bytes=512 * 1024,
        )
        create = await asyncio.to_thread(
            build_run_create,
            data,
            name="restart",
            model={"recipe": "tiny-gpt", "args": TINY_GPT},
            target_batch_size=TARGET,
            micro_batch_size=8,
            optimizer={"name": "adamw", "lr": 3e-3},
            schedule={"kind": "constant", "warmup_steps": 0, "total_steps": 1000},
            averaging={
                "group_size": 4,
                "codec": "none",
                "gather_s": 1.0,
                "round_timeout_s": 5.0,
                "step_timeout_s": 30.0,
                "average_state_every": 0,
                "clip_multiple": 0.0,
            },
        )
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
            spec = (await client.create_run(create)).spec
        seeder = TorrentSession(SessionConfig())
        await seeder.start()
        try:
            await seeder.seed(data, (data / f"{manifest.name}.torrent").read_bytes(), manifest=manifest)
            vols = []
            for i in range(2):
                v = Volunteer(
                    VolunteerConfig(
                        run_id=spec.run_id,
                        tracker_url=tracker.url,
                        data_dir=tmp_path / f"volunteer-{i}",
                        seed=200 + i,
                        tracker_timeout_s=3.0,
                    ),
                    emit=seen[i].append,
                    record=recs[i],
                )
                vols.append(v)
            tasks = [asyncio.create_task(v.run()) for v in vols]
            try:
                # (any step from KILL_AT_STEP on: with both volunteers' compute threads in this process, this
                # loop's polls can miss the first third of one step; it was once missed at step 2 exactly, and
                # the test waited out its 90 s while the run went on to step 48)
                await until(
                    lambda: (
                        min(v.step for v in vols) >= KILL_AT_STEP
                        and min(v.step for v in vols) == max(v.step for v in vols)
                        and sum(v.trainer.samples for v in vols) < TARGET // 3
                        # (each holds samples: its round of the last step is over; in a round it holds
                        # none, and that round, formed before the kill, ends without the tracker: a CI
                        # run killed it mid-round and saw one volunteer step while it was down)
                        and all(v.trainer.samples > 0 for v in vols)
                    ),
                    90,
                    f"the volunteers starting to accumulate for a step from step {KILL_AT_STEP} on",
                )
                tracker.kill()
                assert await asyncio.wait_for(tracker.proc.wait(), 30) < 0
                killed_at = time.time()
                steps_at_kill = [v.step for v in vols]
                drawn_at_kill = [samples_drawn(rec) for rec in recs]
                await asyncio.sleep(DOWN_S)
                # While it was down they kept accumulating, and no step was taken.
                assert [v.step for v in vols] == steps_at_kill
                assert all(samples_drawn(rec) > n for rec, n in zip(recs, drawn_at_kill, strict=True))
                down_samples = sum(samples_drawn(rec) - n for rec, n in zip(recs, drawn_at_kill, strict=True))
                second = await TrackerProcess.start(db, port=tracker.port, options=TRACKER_OPTIONS)
                assert second.url == tracker.url
                restarted_at = time.time()
                target = max(steps_at_kill) + STEPS_AFTER_RESTART
                await until(
                    lambda: min(v.step for v in vols) >= target, 120, f"step {target} after the restart"
                )
            finally:
                for v in vols:
                    v.stop()
                summaries = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            await seeder.close()
        async with TrackerClient(second.url) as client:
            status = await client.status(spec.run_id)
    finally:
        tracker.kill()
        await tracker.close()
        if second is not None:
            await second.close()

    # The tracker's durable step history: every step once, none skipped.
    with sqlite3.connect(db) as conn:
        history = [
            row[0]
            for row in conn.execute("SELECT step FROM steps WHERE run_id = ? ORDER BY step", (spec.run_id,))
        ]
    assert history == list(range(len(history))), history
    assert status.global_step == len(history)
    assert [r.step for r in status.recent_steps] == sorted(history, reverse=True)[: len(status.recent_steps)]
    # Each volunteer took every step exactly once, in order, and they hold equal, finite parameters.
    for events in seen:
        done = [e.step for e in events if isinstance(e, ev.StepDone)]
        assert done == list(range(done[0], done[0] + len(done))), done
        assert set(done) <= set(history)
    common = sorted(set(recs[0].params) & set(recs[1].params))
    assert common and common[-1] > max(steps_at_kill)
    for step in common:
        a, b = recs[0].params[step], recs[1].params[step]
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b, err_msg=f"volunteers differ after step {step}")
    # No sample lost: what each one drew went into a step or is still accumulated for the next.
    lost = 0
    for events, v, rec in zip(seen, vols, recs, strict=True):
        contributed = sum(e.contributed_samples for e in events if isinstance(e, ev.StepDone))
        lost += samples_drawn(rec) - contributed - v.trainer.samples
    assert lost == 0
    # The first step after the restart carried what was accumulated during the outage.
    resumed = [
        next(e for e in events if isinstance(e, ev.StepDone) and e.t > restarted_at) for events in seen
    ]
    assert sum(e.contributed_samples for e in resumed) >= down_samples
    # And the loss still falls (on a fixed batch, after the first and the last step).
    first, last = losses_on_a_fixed_batch(vols[0], recs[0].params, manifest, [common[0], common[-1]])
    assert last < first
    record_outcome(
        "tracker SIGKILLed and restarted",
        rounds_completed=min(s.steps_done for s in summaries),
        steps_lost=0,
        steps_double_counted=0,
        samples_lost=lost,
        samples_accumulated_while_down=down_samples,
        down_s=round(restarted_at - killed_at, 2),
        time_to_recover_s=round(min(e.t for e in resumed) - restarted_at, 2),
        params_equal=True,
        loss_first=round(first, 3),
        loss_last=round(last, 3),
    )


async def test_restarted_tracker_does_not_group_the_first_peer_back_alone(tmp_path):
    """Regression: a tracker restarted mid-run closed the step on the first heartbeat back (that peer alone
    was above the target) and grouped that peer alone; the others, not re-registered yet, missed the step
    and their parameters parted from its. It now waits three heartbeat intervals for its peers."""
    config = TrackerConfig(db=str(tmp_path / "tracker.sqlite3"), heartbeat_interval_s=0.5, peer_ttl_s=10.0)
    async with serve(config) as first, TrackerClient(first.url, admin_token=first.admin_token) as client:
        run_id = (await client.create_run(make_run_create("restart", target_batch_size=10))).run_id
        a, b = SimVolunteer(client, run_id), SimVolunteer(client, run_id)
        for v in (a, b):
            await v.serve()  # reachable: a round needs a part owner
            await v.join()
    try:
        async with serve(config) as second, TrackerClient(second.url) as client:
            a.client = b.client = client
            assert not (await a.heartbeat(0, 20)).step_closed  # above the target alone, b is not back yet
            ready_a = asyncio.create_task(a.ready(0, 20))
            await b.heartbeat(0, 5)
            ready_b = asyncio.create_task(b.ready(0, 5))
            got_a, got_b = await asyncio.wait_for(asyncio.gather(ready_a, ready_b), 30)
    finally:
        await a.close()
        await b.close()
    assert got_a.status == got_b.status == "group"
    assert got_a.assignment == got_b.assignment
    assert {m.peer_id for m in got_a.assignment.members} == {a.peer_id, b.peer_id}
    record_outcome(
        "tracker restarted: the first peer back is not grouped alone (regression)",
        rounds_completed=1,
        group_members=len(got_a.assignment.members),
        samples_lost=0,
    )
