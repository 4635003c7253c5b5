"""Spot-checks in a real run (issue 29): a volunteer whose well-formed gradients are computed on other data
than the samples it names is caught by other volunteers recomputing them, barred, and its weight goes to 0;
honest volunteers are verified and never rejected. A real tracker, a real seeder, real peer servers (one
process, so every volunteer is "this machine": an accuser is a checker's key, tracker/spotchecks.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import TrackerError
from crowdtrain.tracker.spotchecks import REJECTIONS_TO_BAR
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from tests.harness import published_run

STEPS = 14
GROUP = 4


class OtherData(Volunteer):
    """Names the run's samples it drew, but computes its gradients on other tokens (the same shapes, so every
    copy it sends is well-formed, finite and of a plausible norm)."""

    def __init__(self, config: VolunteerConfig, emit: ev.Emit) -> None:
        def event(e: ev.Event) -> None:
            if isinstance(e, ev.Joined):
                self._arm()
            emit(e)

        super().__init__(config, emit=event)

    def _arm(self) -> None:
        assert self._run is not None
        trainer = self._run.trainer
        accumulate = trainer.accumulate
        rng = np.random.default_rng(5)

        def elsewhere(x, y):
            other = rng.integers(0, 256, size=(x.shape[0], x.shape[1] + 1), dtype=np.int64)
            return accumulate(other[:, :-1], other[:, 1:])

        trainer.accumulate = elsewhere


def config(run, tmp_path, name: str, seed: int, max_steps: int | None = STEPS) -> VolunteerConfig:
    return VolunteerConfig(
        run_id=run.spec.run_id,
        tracker_url=run.tracker.url,
        data_dir=tmp_path / name,
        seed=seed,
        max_steps=max_steps,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_volunteer_computing_on_other_data_is_caught_barred_and_honest_ones_are_verified(tmp_path):
    async with published_run(
        tmp_path, averaging={"codec": "int8", "group_size": GROUP, "spot_checks": 1.0}, target_batch_size=64
    ) as run:
        logs: dict[str, list[ev.Event]] = {}
        honest = []
        for i in range(GROUP - 1):
            logs[f"honest-{i}"] = []
            honest.append(
                Volunteer(config(run, tmp_path, f"honest-{i}", 100 + i), emit=logs[f"honest-{i}"].append)
            )
        logs["hostile"] = []
        hostile = OtherData(config(run, tmp_path, "hostile", 7, max_steps=None), emit=logs["hostile"].append)
        results = await asyncio.wait_for(
            asyncio.gather(*(v.run() for v in honest), hostile.run(), return_exceptions=True), 280
        )
        for r in results:
            assert not isinstance(r, BaseException), repr(r)
        async with TrackerClient(run.tracker.url) as client:
            status = await client.status(run.spec.run_id)

        # the hostile was barred: it left on the tracker's sentence, long before the honest ones' last step
        barred = results[-1]
        assert "spot-checks" in (barred.ended or ""), barred.ended
        assert barred.steps_done < STEPS - 2, barred.steps_done
        # and its key cannot come back: a new join with its data folder's key is refused with the sentence
        again = OtherData(config(run, tmp_path, "hostile", 7), emit=lambda e: None)
        with pytest.raises(TrackerError, match="spot-checks"):
            await asyncio.wait_for(again.run(), 60)

    credits = {c.public_key: c for c in status.credits}
    keys = {name: v._me.key.public_hex for name, v in zip(logs, [*honest, hostile], strict=True)}
    bad = credits[keys["hostile"]]
    assert bad.rejected >= REJECTIONS_TO_BAR, bad
    assert bad.verified == 0, bad  # its gradients never matched the samples it named
    for name in ("honest-0", "honest-1", "honest-2"):
        mine = credits[keys[name]]
        assert mine.rejected == 0, (name, mine)  # never flagged
    assert sum(credits[keys[n]].verified for n in ("honest-0", "honest-1", "honest-2")) >= 2
    # after it was barred its weight is 0: no later step credited it, and the honest ones went on to the end
    last = max(s.step for s in status.recent_steps)
    assert bad.last_step < last - 1, (bad, last)
    assert all(r.steps_done == STEPS for r in results[:-1]), [r.steps_done for r in results]
    # the checkers said so in their logs, with the figures behind each verdict
    found = [
        e
        for name in logs
        if name != "hostile"
        for e in logs[name]
        if isinstance(e, ev.LogLine) and "spot-check" in e.message and "mismatch" in e.message
    ]
    assert len(found) >= REJECTIONS_TO_BAR, found
