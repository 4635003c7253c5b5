"""A volunteer that joins late fetches the run's state from the others while it trains, then holds the
same step and parameters as they do and counts from the following step."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import AveragingError
from crowdtrain.volunteer import catchup
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.cadence import Cadence, Overlapped
from crowdtrain.volunteer.catchup import STATE_POLL_S
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from crowdtrain.volunteer.state.config import StateConfig
from tests.harness import Recorder, published_run, until, volunteers
from tests.sim import PingServer, SimVolunteer

KiB = 1024
LATE_AT = 10
AFTER = 4  # steps the late one takes after it caught up, before everyone is stopped


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [0, 1])
async def test_late_volunteer_catches_up_and_then_matches_the_others(tmp_path, delay):
    """With delay 1 too: the first two compute each step ahead while the newcomer catches up, and still
    leave it its share of the steps once it has."""
    model = {"recipe": "tiny-gpt", "args": {"d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 32}}
    # Donors upload slowly, so the download takes a few seconds (during which the newcomer computes nothing).
    state = StateConfig(range_bytes=64 * KiB, upload_rate=256 * KiB)
    seen: list[ev.Event] = []
    recs = {i: Recorder() for i in range(3)}

    def make(i: int, emit=ev.no_emit) -> Volunteer:
        return Volunteer(
            VolunteerConfig(
                run_id=run.spec.run_id,
                tracker_url=run.tracker.url,
                data_dir=tmp_path / f"volunteer-{i}",
                seed=i,
                state=state,
            ),
            emit=emit,
            record=recs[i],
        )

    async with published_run(tmp_path, model=model, target_batch_size=64, averaging={"delay": delay}) as run:
        early = [make(0), make(1)]
        tasks = [asyncio.create_task(v.run()) for v in early]
        await until(
            lambda: min(v.step for v in early) >= LATE_AT,
            120,
            f"step {LATE_AT} of the first two",
            watching=tasks,
        )
        late = make(2, emit=seen.append)
        tasks.append(asyncio.create_task(late.run()))
        # the run goes on (it has no last step) until the late one caught up and stepped with the others:
        # however fast the steps are, its download has to follow them
        await until(
            lambda: late.summary.caught_up_to is not None and late.summary.steps_done >= AFTER,
            200,
            f"the late one's catch-up and {AFTER} steps after it",
            watching=tasks,
        )
        for v in (*early, late):
            v.stop()
        summaries = await asyncio.wait_for(asyncio.gather(*tasks), 60)

    caught = summaries[2].caught_up_to
    assert caught is not None and caught >= LATE_AT, summaries[2]
    # During the download it computed one micro-batch (its own rate, for its first share) and no more: on
    # parameters that are not the run's, what it computes would only go to the rounds with weight 0.
    assert any(isinstance(e, ev.StateSyncStarted) for e in seen)
    loaded = next(i for i, e in enumerate(seen) if isinstance(e, ev.StateLoaded))
    before = [e.micro_batches for e in seen[:loaded] if isinstance(e, ev.LocalTraining)]
    assert max(before, default=0) <= 1, before
    # From the step it switched at, it holds exactly the others' parameters.
    compared = 0
    for step, params in recs[2].params.items():
        if step >= caught and step in recs[0].params:
            np.testing.assert_array_equal(params, recs[0].params[step], err_msg=f"step {step}")
            compared += 1
    assert compared >= 2
    # Its gradients count from the step after the switch, not before, and it has its share of those steps.
    assert min(recs[2].batches) >= caught
    assert len(recs[2].batches) >= AFTER - 1, sorted(recs[2].batches)
    assert summaries[2].steps_done >= AFTER and summaries[2].steps_missed == 0


def test_a_newcomer_accepts_a_state_no_larger_than_its_model_could_make():
    """Issue 29: it accepted 16 GiB whatever the model. The bound follows the model (8 × its bytes, for the
    optimizers' tensors, + 64 MiB of header), never above the configured ceiling; the catch-up tests (every
    step and local steps, tiny-gpt) load real states within it."""
    import torch

    from crowdtrain.volunteer.catchup import STATE_HEADER_BYTES, state_bound

    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.BatchNorm1d(100))
    own = (100 * 100 + 100 + 4 * 100) * 4 + 8  # fp32 weights, bias, BatchNorm's 4 vectors; its int64 count
    assert state_bound(model, 16 << 30) == 8 * own + STATE_HEADER_BYTES
    assert state_bound(model, 1 << 20) == 1 << 20


def test_a_peer_replaying_on_its_own_state_fetches_every_gap_in_the_averages_it_kept():
    """A volunteer slowed 10× (bench/stragglers.py ``slowed``) missed step 3, then, catching up as a member
    with weight 0, missed the round of step 4 and later of step 8. The averages fetched were only those
    before the first one kept (3 and 4); the replay then found step 8 missing, started the catch-up again,
    which fetched nothing, and so on for the rest of the run (55 s, no line logged). Every gap is fetched."""
    from crowdtrain.volunteer.catchup import steps_to_fetch

    kept = {5, 6, 7, 9}
    assert steps_to_fetch(3, 10, kept) == [3, 4, 8]
    assert steps_to_fetch(3, 10, kept | {3, 4}) == [8]  # (the pass after fetching those before the first)
    assert steps_to_fetch(3, 10, set(range(3, 10))) == []
    assert steps_to_fetch(7, 7, set()) == []


def test_with_delay_1_a_state_as_new_as_the_peers_step_waits_for_a_newer_one():
    """A snapshot of step k holds the averages below k; its writers had k's round under way and apply its
    average at the next close. A peer still at step k (it had not joined k's round) holds no copy of that
    average: switching to the state then would leave it one average short for good (its optimizer state
    never again the others'). With delay 0 a newer state is simply the step to move to."""
    # delay 1, the peer at step 36 took part in 34 and 35 as a member with weight 0
    late, now = Overlapped(), Cadence()
    assert list(late.averages_needed(34, 36)) == [34, 35]  # 34 replayed, 35 applied at the close of 36
    assert list(late.averages_needed(35, 36)) == [35]
    assert list(late.averages_needed(36, 36)) == [36]  # not kept (the peer was in no round 36): wait
    assert list(late.averages_needed(37, 36)) == [37]
    # delay 0: the steps up to the peer's own, none for a state of its step or newer
    assert list(now.averages_needed(34, 36)) == [34, 35]
    assert list(now.averages_needed(36, 36)) == [] and list(now.averages_needed(37, 36)) == []


@pytest.mark.timeout(120)
async def test_a_newcomer_waits_with_one_sentence_and_no_rounds_while_the_donors_disagree(tmp_path):
    """Issue 47: two peers serve different states of the run's step (a bug, or a modified client). The newcomer
    loads neither: it says so once (not a warning a second), computes nothing and takes no place in rounds,
    and the run's status says the donors disagree."""
    async with published_run(tmp_path, target_batch_size=32) as run:
        run_id = run.spec.run_id
        async with (
            TrackerClient(run.tracker.url, admin_token=run.tracker.admin_token) as admin,
            PingServer() as a,
            PingServer() as b,
        ):
            sims = [SimVolunteer(admin, run_id) for _ in range(2)]
            for v, server in zip(sims, (a, b), strict=True):
                await v.join(address=server.address)
                server.peer_id = v.peer_id
            for v in sims:
                await v.wait_reachable(samples=1)
            for step in range(2):
                for v in sims:
                    await v.heartbeat(step, 16)
                await asyncio.gather(*(v.ready(step, 16) for v in sims))
            await sims[0].declare_state(2, "aa" * 32, 10)
            await sims[1].declare_state(2, "bb" * 32, 10)

            async def alive() -> None:  # the two donors stay online meanwhile
                while True:
                    for v in sims:
                        await v.heartbeat(2, 0)
                    await asyncio.sleep(0.5)

            beat = asyncio.create_task(alive())
            events: list[ev.Event] = []
            [vol] = volunteers(run, tmp_path, 1, emit=events.append)
            task = asyncio.create_task(vol.run())

            def said() -> list[str]:
                return [e.message for e in events if isinstance(e, ev.LogLine) and "disagree" in e.message]

            try:
                await until(
                    lambda: bool(said()), 60, "the newcomer saying the donors disagree", watching=[task]
                )
                await asyncio.sleep(2 * STATE_POLL_S + 1)  # it asked the tracker again twice meanwhile
                assert len(said()) == 1, said()
                assert "waiting, computing nothing, until they agree" in said()[0]
                # no round (the steps below were the donors' alone) and no micro-batch computed
                assert not [e for e in events if isinstance(e, ev.RoundDone | ev.LocalTraining)]
                notice = (await admin.status(run_id)).notice
                assert notice is not None and "disagree" in notice
            finally:
                beat.cancel()
                vol.stop()
                await asyncio.wait_for(task, 30)


@pytest.mark.timeout(180)
async def test_volunteers_that_all_lost_one_round_resume_alike_from_the_newest_agreed_state(
    tmp_path, monkeypatch
):
    """Issue 47 (the churn soak): a member left during the later phase of a round; every other member lost
    that round and fetched the state, waiting for one newer than the round, which only a stepping peer would
    make: the run stood still for good. Now, the run's step unmoved for STALL_S, each takes the newest agreed
    state, skips the same averages and steps on, and they hold the same bytes again."""
    monkeypatch.setattr(catchup, "STALL_S", 3.0)
    lost = 5  # the round every volunteer loses
    async with published_run(tmp_path, target_batch_size=32) as run:
        recs = [Recorder(), Recorder()]
        events: list[list[ev.Event]] = [[], []]
        vols = volunteers(run, tmp_path, 2, record=recs, emit=[e.append for e in events], max_steps=lost + 5)
        tasks = [asyncio.create_task(v.run()) for v in vols]
        await until(lambda: all(v._run is not None for v in vols), 60, "both joined", watching=tasks)
        for v in vols:
            allreduce = v._run.averager.allreduce

            async def failing(assignment, vector, weight, *, tag="grad", _allreduce=allreduce, **kw):
                if assignment.step == lost:  # the fault: this round is lost by everyone
                    raise AveragingError(f"the test's fault: round {lost} lost by every member")
                return await _allreduce(assignment, vector, weight, tag=tag, **kw)

            v._run.averager.allreduce = failing
        summaries = await asyncio.wait_for(asyncio.gather(*tasks), 150)
    for seen in events:
        said = [e.message for e in seen if isinstance(e, ev.LogLine) and "has not stepped for" in e.message]
        assert len(said) == 1, said
    assert all(s.steps_done >= 3 for s in summaries), summaries
    after = [k for k in recs[0].params if k > lost + 1 and k in recs[1].params]
    assert after, (sorted(recs[0].params), sorted(recs[1].params))
    for k in after:
        np.testing.assert_array_equal(recs[0].params[k], recs[1].params[k], err_msg=f"step {k}")
