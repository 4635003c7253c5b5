"""A run's held-out split (issue 25): its chunks are never trained on; every `eval.every` steps each volunteer
evaluates the state on the same held-out samples and reports the loss and the recipe's metrics, which the
tracker averages per step and shows in `status` (plain and JSON) and on the run's page."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import ConfigError
from crowdtrain.protocol.runcheck import check_run
from crowdtrain.volunteer import events as ev
from tests.faults import subprocess_env
from tests.harness import Recorder, cli, published_run, until, volunteers
from tests.test_web_page import browse, field, points

pytestmark = pytest.mark.timeout(300)

ARGS = {"in_features": 16, "hidden": 32, "n_layer": 1, "out_features": 2}
EVAL = {"every": 2, "holdout_chunks": 1, "samples": 96}


def separable_npz(path, n: int = 6000) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    np.savez(path, x=x, y=y)


async def test_volunteers_evaluate_the_held_out_split_and_status_page_and_json_show_it(tmp_path):
    separable_npz(tmp_path / "data.npz")
    async with published_run(
        tmp_path,
        model={"recipe": "mlp", "args": ARGS},
        source=tmp_path / "data.npz",
        chunk_bytes=32 * 1024,  # about 7 chunks of 500 rows: the last one is held out
        target_batch_size=64,
        micro_batch_size=16,
        optimizer={"name": "adamw", "lr": 1e-2},
        eval=EVAL,
    ) as run:
        holdout = len(run.manifest.chunks) - 1
        events: list[list[ev.Event]] = [[], []]
        records = [Recorder(), Recorder()]
        vols = volunteers(run, tmp_path, 2, emit=[events[0].append, events[1].append], record=records)
        tasks = [asyncio.create_task(v.run()) for v in vols]
        try:
            async with TrackerClient(run.tracker.url) as client:

                async def evaluated(n: int) -> bool:
                    evals = (await client.status(run.spec.run_id)).evals
                    return len(evals) >= n and evals[0].reports == 2

                await until(
                    lambda: evaluated(3), 180, "three held-out evaluations by both volunteers", watching=tasks
                )
                status = await client.status(run.spec.run_id)
            newest = status.evals[0]
            assert [e.step for e in status.evals] == sorted({e.step for e in status.evals}, reverse=True)
            assert all(e.step % 2 == 0 and e.step > 0 for e in status.evals)
            assert set(newest.metrics) == {"accuracy"} and 0.0 <= newest.metrics["accuracy"] <= 1.0
            # the same samples, the same state: both volunteers' reports of a step agree
            mine = [
                {e.step: (e.loss, e.metrics["accuracy"]) for e in es if isinstance(e, ev.Evaluated)}
                for es in events
            ]
            both = sorted(set(mine[0]) & set(mine[1]))
            assert both, mine
            for step in both:
                assert mine[0][step] == pytest.approx(mine[1][step], rel=1e-5), step
            # it learns: the held-out loss falls from the first evaluation to the newest
            first = min(both)
            assert newest.loss < mine[0][first][0], (mine[0], newest)
            # the held-out chunk is never in a training batch
            trained = {i for r in records for step in r.batches.values() for b in step for i, _ in b}
            assert holdout not in trained and trained, trained
            # `crowdtrain status`: plain and --json
            plain = await cli(subprocess_env(), "status", run.spec.run_id, "--tracker", run.tracker.url)
            assert plain.returncode == 0, plain.stderr
            assert "held-out evaluations:" in plain.stdout and "accuracy" in plain.stdout
            assert "(2 volunteers)" in plain.stdout
            as_json = await cli(
                subprocess_env(), "status", run.spec.run_id, "--tracker", run.tracker.url, "--json"
            )
            assert json.loads(as_json.stdout)["evals"][0]["metrics"].keys() == {"accuracy"}
            # the run's page
            dom = await browse(
                f"{run.tracker.url}/runs/{run.spec.run_id}", tmp_path / "profile", "--dump-dom"
            )
            assert field(dom, "held-out").startswith("loss ") and "accuracy" in field(dom, "held-out")
            assert points(dom, "eval-line") >= 3
        finally:
            for v in vols:
                v.stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)


def test_a_held_out_split_must_leave_chunks_to_train_on():
    from msgspec.structs import replace

    from crowdtrain.protocol.messages import EvalSpec
    from tests.sim import make_run_create

    base = make_run_create()
    chunks = len(base.dataset.manifest.chunks)
    with pytest.raises(ConfigError, match=rf"eval\.holdout_chunks: must hold out 1 to {chunks - 1} of"):
        check_run(replace(base, eval=EvalSpec(every=5, holdout_chunks=chunks)))
    with pytest.raises(ConfigError, match=r"eval\.samples: must be between 1 and 65536, got 0"):
        check_run(replace(base, eval=EvalSpec(every=5, holdout_chunks=1, samples=0)))
    check_run(replace(base, eval=EvalSpec(every=0, holdout_chunks=chunks)))  # no evaluation: no split
