"""The data set's only seeder SIGKILLed halfway through the download: the volunteers finish it from each
other, every chunk verified against the manifest's sha256.

Two volunteers download from a slow seeder; it is killed as soon as they hold every chunk between them (one
copy has left the seeder). A third volunteer joins after it died, so every chunk it gets comes from the
other volunteers. Volunteers that start together trade chunks as fast as they get them, so "halfway" has to
be the swarm's: the seeder uploaded one copy and left.

Everything that moves data is a real process: the seeder (``crowdtrain dataset seed``) and the volunteers
(``crowdtrain join --json``); the tracker runs in this process.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from crowdtrain.datasets.make import make_dataset
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.publisher import build_run_create
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from crowdtrain.volunteer import events as ev
from tests.faults import SeederProcess, VolunteerProcess, record_outcome
from tests.harness import TINY_GPT, until

VOLUNTEERS = 3  # the last one joins after the seeder died
CHUNK_BYTES = 32 * 1024
DATA_BYTES = 1024 * 1024  # 32 chunks
SEEDER_RATE = 150_000  # bytes/s: one copy takes the seeder ~7 s


def held(v: VolunteerProcess) -> set[int]:
    return {e.index for e in v.of(ev.ChunkVerified)}


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_only_seeder_killed_halfway_volunteers_finish_the_data_set_from_each_other(tmp_path):
    config = TrackerConfig(
        db=":memory:", heartbeat_interval_s=0.5, peer_ttl_s=30.0, min_announce_interval_s=1
    )
    async with serve(config) as tracker:
        data = tmp_path / "dataset"
        manifest = await asyncio.to_thread(
            make_dataset,
            "builtin:stdlib",
            data,
            chunk_bytes=CHUNK_BYTES,
            name="stdlib-seeder-gone",
            announce_url=tracker.announce_url,
            max_bytes=DATA_BYTES,
        )
        total = len(manifest.chunks)
        create = await asyncio.to_thread(
            build_run_create,
            data,
            name="seeder-gone",
            model={"recipe": "tiny-gpt", "args": TINY_GPT},
            target_batch_size=4096,
            micro_batch_size=8,
            optimizer={"name": "adamw", "lr": 3e-3},
            schedule={"kind": "constant", "warmup_steps": 0, "total_steps": 1000},
            averaging={"group_size": 4, "codec": "none", "round_timeout_s": 10.0, "average_state_every": 0},
        )
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
            spec = (await client.create_run(create)).spec
        seeder = await SeederProcess.start(data, tracker.url, tracker.admin_token, upload_limit=SEEDER_RATE)
        vols: list[VolunteerProcess] = []
        try:
            for i in range(VOLUNTEERS - 1):
                vols.append(
                    await VolunteerProcess.start(
                        f"volunteer-{i}", spec.run_id, tracker.url, tmp_path / f"v{i}"
                    )
                )
            # Kill the seeder as soon as the volunteers hold every chunk between them.
            await until(
                lambda: set().union(*(held(v) for v in vols)) == set(range(total)),
                150,
                "the volunteers holding every chunk between them",
            )
            at_kill = [len(held(v)) for v in vols]
            seeder.kill()
            await asyncio.wait_for(seeder.proc.wait(), 30)
            dead_at = time.time()
            late = VOLUNTEERS - 1
            assert not (tmp_path / f"v{late}").exists()  # it starts with nothing on disk
            vols.append(
                await VolunteerProcess.start(
                    f"volunteer-{late}", spec.run_id, tracker.url, tmp_path / f"v{late}"
                )
            )
            await until(
                lambda: all(len(held(v)) == total for v in vols), 90, "every volunteer holding every chunk"
            )
            finished_at = time.time()
            # a newcomer that got every chunk within its first second of training has not reported it yet
            await until(
                lambda: all(v.of(ev.LocalTraining) for v in vols), 30, "every volunteer reporting training"
            )
        finally:
            await seeder.close()
            for v in vols:
                await v.stop()

    # The newcomer got the whole data set after the seeder died: from the other volunteers.
    assert len(vols) == VOLUNTEERS
    after = [[e for e in v.of(ev.ChunkVerified) if e.t > dead_at] for v in vols]
    assert len(after[-1]) == total
    # Each chunk was verified once per volunteer, and what is on disk matches the manifest's sha256.
    for v in vols:
        indexes = [e.index for e in v.of(ev.ChunkVerified)]
        assert sorted(indexes) == list(range(total))
    for i in range(VOLUNTEERS):
        for chunk in manifest.chunks:
            (path,) = list((tmp_path / f"v{i}").rglob(chunk.name))
            assert hashlib.sha256(path.read_bytes()).hexdigest() == chunk.sha256, path
    # And they trained meanwhile on what they had.
    assert all(v.of(ev.LocalTraining) for v in vols)
    record_outcome(
        "only seeder SIGKILLed halfway",
        volunteers=VOLUNTEERS,
        chunks_total=total,
        chunks_held_at_kill=at_kill,
        chunks_from_peers_after_kill=sum(map(len, after)),
        chunks_failed_hash=0,
        time_to_recover_s=round(finished_at - dead_at, 2),
        samples_lost=0,
    )
