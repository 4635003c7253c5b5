"""A volunteer whose peer server cannot be reached (it advertises a port nobody listens on, as a router's
forward that was never made would be, or it declares none with client mode): it owns no all-reduce part,
still contributes its samples and steps with the others, and the group's parameters stay equal.

All three volunteers run in this process (so their parameters can be compared) over real sockets: the
tracker's reachability check really connects to the advertised address and is refused. (The tracker checks a
volunteer only at the address its requests come from, so the advertised address is this host's, at a port
found free and closed again.)
"""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from tests.faults import VolunteerProcess, losses_on_a_fixed_batch, record_outcome
from tests.harness import Recorder, published_run, volunteers

STEPS = 8


def closed_port() -> int:
    """A port nothing listens on (the kernel's pick, released again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


UNREACHABLE = {
    "advertise": lambda: {"host": "127.0.0.1", "advertise": f":{closed_port()}"},
    "client-mode": lambda: {"client_mode": True},
}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", sorted(UNREACHABLE))
async def test_unreachable_volunteer_works_in_client_mode_and_steps_with_the_others(tmp_path, how):
    seen: list[list[ev.Event]] = [[], [], []]
    recs = [Recorder() for _ in range(3)]
    async with published_run(tmp_path, target_batch_size=96, averaging={"clip_multiple": 0.0}) as run:
        vols = []
        for i in range(3):
            extra = UNREACHABLE[how]() if i == 2 else {}
            v = Volunteer(
                VolunteerConfig(
                    run_id=run.spec.run_id,
                    tracker_url=run.tracker.url,
                    data_dir=tmp_path / f"volunteer-{i}",
                    seed=300 + i,
                    max_steps=STEPS,
                    **extra,
                ),
                emit=seen[i].append,
                record=recs[i],
            )
            vols.append(v)
        summaries = await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 150)

    hidden = vols[2].peer_id
    rounds = [[e for e in events if isinstance(e, ev.RoundDone) and e.kind == "grad"] for events in seen]
    # It never owned a part; the others did, and nobody waited on it.
    assert rounds[2] and all(r.my_part == -1 for r in rounds[2])
    assert all(r.my_part >= 0 for rs in rounds[:2] for r in rs)
    assert all(not r.dropped and not r.failed_parts for rs in rounds for r in rs)
    # The tracker saw that it cannot be reached.
    progress = [e for e in seen[2] if isinstance(e, ev.Progress)]
    assert progress and not any(e.reachable for e in progress)
    assert any(e.reachable for e in seen[0] if isinstance(e, ev.Progress))
    # It stepped with the others, with its own samples in the average.
    steps = [[e.step for e in events if isinstance(e, ev.StepDone)] for events in seen]
    assert steps[0] == steps[1] == steps[2] == list(range(STEPS)), steps
    in_group = [r for r in rounds[0] if hidden in r.members]
    assert len(in_group) == STEPS
    contributed = sum(e.contributed_samples for e in seen[2] if isinstance(e, ev.StepDone))
    assert contributed > 0
    # Equal, finite parameters after every step, and learning.
    for step in range(1, STEPS + 1):
        first = recs[0].params[step]
        assert np.isfinite(first).all()
        for rec in recs[1:]:
            np.testing.assert_array_equal(rec.params[step], first, err_msg=f"after step {step}")
    first, last = losses_on_a_fixed_batch(vols[2], recs[2].params, run.manifest, [1, STEPS])
    assert last < first
    record_outcome(
        f"peer server unreachable ({how})",
        rounds_completed=min(s.steps_done for s in summaries),
        rounds_with_it_as_sender_only=len(rounds[2]),
        its_samples_contributed=contributed,
        samples_lost=0,
        dropped_or_failed_parts=0,
        params_equal=True,
        loss_first=round(first, 3),
        loss_last=round(last, 3),
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_join_process_advertising_an_unreachable_address_steps_as_a_client(tmp_path):
    """The same through the CLI: ``crowdtrain join --advertise :PORT`` as a process of its own, PORT one
    nobody listens on (a forward that was never made), so the tracker's check is refused."""
    seen: list[list[ev.Event]] = [[], []]
    recs = [Recorder() for _ in range(2)]
    async with published_run(tmp_path, target_batch_size=96, averaging={"clip_multiple": 0.0}) as run:
        vols = volunteers(run, tmp_path, 2, seed=500, emit=[s.append for s in seen], record=recs)
        tasks = [asyncio.create_task(v.run()) for v in vols]
        hidden = await VolunteerProcess.start(
            "hidden",
            run.spec.run_id,
            run.tracker.url,
            tmp_path / "hidden",
            extra=["--host", "127.0.0.1", "--advertise", f":{closed_port()}"],
        )
        try:
            await hidden.wait_for(lambda e: len(hidden.of(ev.StepDone)) >= 4, 120)
        finally:
            await hidden.stop()
            for v in vols:
                v.stop()
            summaries = await asyncio.wait_for(asyncio.gather(*tasks), 60)

    hidden_id = hidden.of(ev.Joined)[0].peer_id
    assert hidden.of(ev.Joined)[0].address is not None  # it did declare an address: 127.0.0.1:<closed port>
    assert not any(e.reachable for e in hidden.of(ev.Progress))
    its_rounds = [e for e in hidden.of(ev.RoundDone) if e.kind == "grad"]
    assert len(its_rounds) >= 4 and all(r.my_part == -1 for r in its_rounds)
    its_steps = [e.step for e in hidden.of(ev.StepDone)]
    # Strictly increasing; a peer that joined late may miss a step right after it caught up (it keeps its
    # samples for the next one, as any peer that misses a step does).
    assert its_steps == sorted(set(its_steps))
    for events in seen:
        stepped = {e.step for e in events if isinstance(e, ev.StepDone)}
        assert set(its_steps) <= stepped
        together = [e for e in events if isinstance(e, ev.RoundDone) and hidden_id in e.members]
        assert len(together) >= len(its_steps) and all(not r.failed_parts and not r.dropped for r in together)
    common = sorted(set(recs[0].params) & set(recs[1].params))
    for step in common:
        np.testing.assert_array_equal(recs[0].params[step], recs[1].params[step])
        assert np.isfinite(recs[0].params[step]).all()
    record_outcome(
        "peer server unreachable (crowdtrain join --advertise :CLOSED_PORT, a process)",
        rounds_completed=len(its_steps),
        rounds_with_it_as_sender_only=len(its_rounds),
        its_samples_contributed=sum(e.contributed_samples for e in hidden.of(ev.StepDone)),
        samples_lost=0,
        dropped_or_failed_parts=0,
        params_equal=True,
        others_steps=min(s.steps_done for s in summaries),
    )
