"""The run's state outlives its volunteers (issue 25): every volunteer leaves, and the run goes on from where
it was when they come back, never from the recipe's initial parameters; with no volunteer left that kept the
state, a newcomer waits (computing nothing, saying why) until the publisher restores a checkpoint."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sys

import numpy as np
import pytest
from safetensors.torch import load_file

from crowdtrain.commands.export import export_state
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.models import get_recipe
from crowdtrain.volunteer.trainer import Trainer
from tests.faults import subprocess_env
from tests.harness import Recorder, published_run, until, volunteers

pytestmark = pytest.mark.timeout(300)


class Events(list):
    def __call__(self, event: ev.Event) -> None:
        self.append(event)

    def of(self, kind: type) -> list:
        return [e for e in self if isinstance(e, kind)]

    def said(self, words: str) -> list[str]:
        return [e.message for e in self.of(ev.LogLine) if words in e.message]


def initial_params(spec) -> np.ndarray:
    recipe = get_recipe(spec.model.recipe)
    return Trainer(recipe, recipe.build(dict(spec.model.args)), spec.optimizer, spec.schedule).flat_params()


async def run_all(vols, within_s: float = 120) -> list:
    return await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), within_s)


@pytest.mark.parametrize("staggered", [False, True], ids=["together", "one-after-the-other"])
async def test_two_volunteers_leave_and_rejoin_and_the_run_goes_on_from_where_it_was(tmp_path, staggered):
    async with published_run(tmp_path) as run:
        first_recs, first_events = [Recorder(), Recorder()], [Events(), Events()]
        first = volunteers(run, tmp_path, 2, max_steps=6, record=first_recs, emit=first_events)
        await run_all(first)
        left_at = first[0].step
        assert left_at == first[1].step == 6
        for events in first_events:
            assert events.said("kept the run's state of step 6"), [e.message for e in events.of(ev.LogLine)]

        # nobody is online: the run's status says its state is served by no one, and how it comes back
        async with TrackerClient(run.tracker.url) as client:
            status = await client.status(run.spec.run_id)
        assert status.global_step == 6 and "no volunteer online serves the run's state" in (
            status.notice or ""
        )

        # both come back (their data folders as they left them), started together; which one the tracker
        # hears first, and how far the run moved before the other got in, is up to the machine: they train
        # until both have taken three steps together
        recs, events = [Recorder(), Recorder()], [Events(), Events()]
        again = volunteers(run, tmp_path, 2, record=recs, emit=events)
        tasks = [asyncio.create_task(again[0].run())]
        if staggered:  # the second comes back once the first has gone on from step 6 alone
            await until(lambda: again[0].step >= 8, 120, "two steps of the first to come back")
        tasks.append(asyncio.create_task(again[1].run()))

        def together() -> list[int]:
            return sorted(set(recs[0].params) & set(recs[1].params))

        await until(lambda: len(together()) >= 4, 120, "three steps the two took together")
        for v in again:
            v.stop()
        summaries = await asyncio.wait_for(asyncio.gather(*tasks), 60)

    resumed = [bool(events[i].said("resumed from this volunteer's own state of step 6")) for i in range(2)]
    # the first the tracker hears resumes from its own state; one that comes back after the run went on catches up
    assert resumed == [True, False] if staggered else any(resumed), [events[i].said("") for i in range(2)]
    for i in range(2):
        said = events[i].said("")
        assert summaries[i].first_step >= 6 and summaries[i].steps_done >= 3, summaries[i]
        assert not events[i].said("initial parameters"), said
        # a returner serves the state it kept: the tracker vouched for it when it left
        assert not events[i].said("could not declare state"), said
        if resumed[i]:
            # it went on from the very parameters it left with, not from the recipe's initial ones
            np.testing.assert_array_equal(recs[i].params[6], first_recs[i].params[6])
            assert not np.allclose(recs[i].params[6], initial_params(run.spec))
        else:
            # it came back after the other had gone on: it caught up from the state the other serves
            assert summaries[i].caught_up_to is not None and events[i].said("loaded the state of step"), said
    # and on together: the same parameters after every step both took
    for step in together():
        np.testing.assert_array_equal(recs[1].params[step], recs[0].params[step])
    # the loss goes on from where it was, it does not jump back to the start's
    start = np.mean([first[i].summary.losses[0] for i in range(2)])
    before = np.mean([first[i].summary.losses[-1] for i in range(2)])
    after = np.mean([s.losses[0] for s in summaries])
    assert after < start - 0.5 * (start - before), (start, before, after)


async def test_a_run_that_lost_every_volunteer_waits_for_a_checkpoint_and_is_restored_from_it(tmp_path):
    async with published_run(tmp_path) as run:
        [lost] = volunteers(run, tmp_path, 1, name="lost", record=[Recorder()])
        task = asyncio.create_task(lost.run())
        await until(lambda: lost.step >= 4, 120, "step 4 of the first volunteer", every_s=0.05)
        out = tmp_path / "keep" / "model.safetensors"
        kept = await export_state(run.spec.run_id, run.tracker.url, out, None, 10.0)  # the publisher's copy
        await until(lambda: lost.step >= kept["step"] + 2, 120, "two more steps", every_s=0.05)
        lost.stop()
        await asyncio.wait_for(task, 60)
        run_step = lost.step  # its machine is gone, with its data folder: only the checkpoint is left

        # a newcomer finds no state served: it waits, computes nothing, and says why
        waiting_events, waiting_rec = Events(), Recorder()
        [newcomer] = volunteers(
            run, tmp_path, 1, name="newcomer", emit=[waiting_events], record=[waiting_rec]
        )
        waiting = asyncio.create_task(newcomer.run())
        await until(lambda: waiting_events.said("no peer serves its state"), 60, "the waiting sentence")
        await asyncio.sleep(3)
        assert not waiting_events.of(ev.LocalTraining) and not waiting_rec.batches
        assert newcomer.step == run_step and not waiting_events.of(ev.StepDone)
        assert [e.phase for e in waiting_events.of(ev.PhaseChanged)][-1] == "waiting-for-state"

        # the publisher restores the run from its checkpoint: the step gap is told, and the newcomer catches up
        restorer_events, restorer_rec = Events(), Recorder()
        [restorer] = volunteers(
            run, tmp_path, 1, name="restorer", init_from=out, emit=[restorer_events], record=[restorer_rec]
        )
        restoring = asyncio.create_task(restorer.run())
        await until(
            lambda: len(set(waiting_rec.params) & set(restorer_rec.params)) >= 3,
            120,
            "the newcomer's steps after the restore",
        )
        newcomer.stop()
        restorer.stop()
        await asyncio.wait_for(asyncio.gather(waiting, restoring), 60)

    gap = run_step - kept["step"]
    told = restorer_events.said(f"resuming from the checkpoint {out} of step {kept['step']}")
    assert told and f"the {gap} steps since are lost" in told[0], told
    assert waiting_events.said("loaded the state of step"), waiting_events.said("")
    assert not waiting_events.said("initial parameters")
    # the newcomer holds what the restorer holds, step after step
    common = sorted(set(waiting_rec.params) & set(restorer_rec.params))
    assert len(common) >= 2, common
    for step in common:
        np.testing.assert_array_equal(waiting_rec.params[step], restorer_rec.params[step])


async def test_export_every_n_steps_keeps_the_newest_weights_until_interrupted(tmp_path):
    out = tmp_path / "keep" / "model.safetensors"
    async with published_run(tmp_path) as run:
        [v] = volunteers(run, tmp_path, 1)
        training = asyncio.create_task(v.run())
        keeper = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "crowdtrain", "export", run.spec.run_id, "--tracker", run.tracker.url,
            "--out", str(out), "--every", "3", "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=subprocess_env(),
        )  # fmt: skip
        written: list[dict] = []
        try:
            async with asyncio.timeout(120):
                while len(written) < 3:
                    line = json.loads(await keeper.stdout.readline())
                    if "step" in line:
                        written.append(line)
        finally:
            keeper.send_signal(signal.SIGINT)
            code = await asyncio.wait_for(keeper.wait(), 30)
            v.stop()
            await asyncio.wait_for(training, 60)
    assert code == 130
    steps = [w["step"] for w in written]
    assert all(b - a >= 3 for a, b in itertools.pairwise(steps)), steps
    # the file holds the last one written, whole, with its recipe and step
    assert json.loads(out.with_suffix(".json").read_text())["step"] == steps[-1]
    assert set(load_file(str(out))) == set(
        get_recipe("tiny-gpt").build(dict(run.spec.model.args)).state_dict()
    )
