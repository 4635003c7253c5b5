"""Poisoned contributions in a real run: one hostile volunteer among three honest ones, through a real
tracker, a real seeder and real peer servers (in one process).

The hostile volunteer is an ordinary :class:`Volunteer` with seams set once it has joined (its trainer's
``take_grad`` and its averager's calls are wrapped); each step it misbehaves in another way:

====  ==========================================  =====================================================
step  what it sends                               what the honest part owners do
====  ==========================================  =====================================================
0     NaN in every part                           reject (422), listed in ``RoundDone.rejected``
1     its gradient × 1e6                          clip to 5 × the median norm (≤ the owner's), ``.clipped``
2     a weight 50 × above the one it reported     reject (422), ``RoundDone.rejected``
3     a vector one value short (wrong lengths)    reject (422) the parts whose length differs
4     every part twice                            count the first copy, refuse the second (409),
                                                  ``RoundDone.duplicates``
====  ==========================================  =====================================================

It is in client mode (owns no part): hostile *part owners* are tests/test_receipts.py's. Outcome asserted: every hostile step is visible in the honest owners'
events, the honest volunteers' parameters stay finite and identical after every step, and their loss falls.
"""

from __future__ import annotations

import asyncio
import math
import secrets

import numpy as np
import pytest

from crowdtrain.datasets.sampler import Sampler
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import TrackerError
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.averaging import AveragingConfig
from crowdtrain.volunteer.averaging.exchange import part_bounds
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from crowdtrain.volunteer.state.config import StateConfig
from crowdtrain.volunteer.state.snapshot import Snapshot
from tests.harness import Recorder, published_run, until
from tests.oracles import mean_loss
from tests.sim import SimVolunteer
from tests.test_allreduce import assign, run_round, start_peers, weighted_mean

STEPS = 16
MODES = ("nan", "scale", "weight", "length", "twice")


class Hostile(Volunteer):
    """A volunteer that poisons its gradient contributions, one way per step (``MODES`` in turn)."""

    def __init__(self, config: VolunteerConfig) -> None:
        super().__init__(config, emit=self._event)
        self.sent: dict[int, str] = {}  # step -> mode used
        self.part_norms: dict[int, list[float]] = {}  # step -> norm of each part of the gradient it sent

    def mode(self) -> str:
        return MODES[self.step % len(MODES)]

    def _event(self, event: ev.Event) -> None:
        if isinstance(event, ev.Joined):  # (the joined run's trainer and averager exist from here on)
            self._arm()

    def _arm(self) -> None:
        assert self._run is not None
        trainer, averager = self._run.trainer, self._run.averager
        take_grad, apply, allreduce = trainer.take_grad, trainer.apply, averager.allreduce
        prepare, exchange = averager._prepare, averager.sender.exchange
        size = {}

        def bad_grad(into=None) -> np.ndarray:
            g = take_grad(into)
            size["n"] = g.size
            mode = self.mode()
            if mode == "nan":
                g[::97] = np.nan
            elif mode == "scale":
                g *= 1e6
            elif mode == "length":
                g = g[:-1].copy()
            return g

        def bad_apply(values: np.ndarray, step: int) -> float:
            if values.size != size["n"]:  # its own wrong-length round: keep its shape, it is the attacker
                values = np.resize(values, size["n"])
            return apply(np.nan_to_num(values), step)

        async def bad_allreduce(assignment, vector, weight, *, tag="grad", **kw):
            if tag == "grad" and self.mode() == "weight" and weight > 0:
                weight *= 50
            if tag == "grad" and weight > 0:
                # what it sends this step (with weight 0 it sends no values: its share of the step was 0,
                # or it is catching up after a step it was left out of)
                self.sent[self.step] = self.mode()
            if tag == "grad":
                bounds = part_bounds(vector.size, assignment.parts, assignment.part_weights)
                self.part_norms[self.step] = [float(np.linalg.norm(vector[a:b])) for a, b in bounds]
            return await allreduce(assignment, vector, weight, tag=tag, **kw)

        def lenient_prepare(a, vector, weight, tag, out=None):  # let the inflated weight past its own check
            me = next(m for m in a.members if m.peer_id == self.peer_id)
            return prepare(a, vector, min(weight, float(me.weight)), tag, out)

        async def twice(rnd, owner, vector, weight, tag, output, failed):
            if tag == "grad" and self.mode() == "twice":
                await asyncio.gather(
                    exchange(rnd, owner, vector, weight, tag, output, failed),
                    exchange(rnd, owner, vector, weight, tag, output, failed),
                )
            else:
                await exchange(rnd, owner, vector, weight, tag, output, failed)

        trainer.take_grad = bad_grad
        trainer.apply = bad_apply
        averager.allreduce = bad_allreduce
        averager._prepare = lenient_prepare
        averager.sender.exchange = twice


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_hostile_volunteer_is_rejected_or_clipped_and_honest_ones_agree_and_learn(tmp_path):
    async with published_run(
        tmp_path,
        averaging={"codec": "none", "group_size": 4, "clip_multiple": 5.0, "gather_s": 3.0},
        target_batch_size=64,
    ) as run:
        logs: dict[int, list[ev.Event]] = {i: [] for i in range(3)}
        recs = [Recorder() for _ in range(3)]
        honest = []
        for i in range(3):
            v = Volunteer(
                VolunteerConfig(
                    run_id=run.spec.run_id,
                    tracker_url=run.tracker.url,
                    data_dir=tmp_path / f"honest-{i}",
                    seed=100 + i,
                    max_steps=STEPS,
                ),
                emit=logs[i].append,
                record=recs[i],
            )
            honest.append(v)
        hostile = Hostile(
            VolunteerConfig(
                run_id=run.spec.run_id,
                tracker_url=run.tracker.url,
                data_dir=tmp_path / "hostile",
                seed=7,
                max_steps=STEPS,
                client_mode=True,
            )
        )
        results = await asyncio.wait_for(
            asyncio.gather(*(v.run() for v in honest), hostile.run(), return_exceptions=True), 280
        )
    for r in results[:3]:
        assert not isinstance(r, BaseException), repr(r)
    summaries = results[:3]
    assert all(s.steps_done == STEPS for s in summaries), [s.steps_done for s in summaries]
    # the hostile one ran as a volunteer does (its bad copies refused or clipped, never a crash of ours): it
    # took steps, and reached max_steps or ended when the tracker barred its key (it may have caught up on the
    # way, as the comment below allows: left out of a step on a loaded machine, it replays the others' average)
    assert not isinstance(results[3], BaseException), repr(results[3])
    assert results[3].steps_done > 0 and (results[3].last_step == STEPS or results[3].ended), results[3]

    # every poisoned step the hostile took part in is visible in the honest owners' RoundDone events
    rounds: dict[int, list[ev.RoundDone]] = {}
    for i in range(3):
        for e in logs[i]:
            if isinstance(e, ev.RoundDone) and e.kind == "grad" and e.my_part >= 0:
                rounds.setdefault(e.step, []).append(e)
    bad = hostile.peer_id
    seen = {mode: 0 for mode in MODES}
    for step, mode in hostile.sent.items():
        # the owners its copy reached in time (it may miss a step's group: it joined late, the step closed
        # early, or on a loaded machine its copies came after the owners' deadline)
        owners = [e for e in rounds.get(step, []) if bad in e.members and bad not in e.dropped]
        if not owners:
            continue
        seen[mode] += 1
        rejected = [bad in e.rejected for e in owners]
        clipped = [bad in e.clipped for e in owners]
        if mode in ("nan", "weight"):
            assert all(rejected), (step, mode, owners)
        elif mode == "scale":
            # an owner clips it unless its part of the hostile's gradient is all zeros (a part of the
            # embedding table for bytes its samples did not hold: parts follow upload rates and can be
            # that small), which no scale makes larger
            norms = hostile.part_norms[step]
            must = [norms[e.my_part] > 0 for e in owners]
            assert any(must) and not any(rejected), (step, mode, owners, norms)
            assert all(c for c, m in zip(clipped, must, strict=True) if m), (step, mode, owners, norms)
        elif mode == "length":
            assert any(rejected), (step, mode, owners)  # at least the parts whose bounds moved
        else:  # twice: the first copy counts, the second is refused (409) and listed as a duplicate
            assert not any(rejected) and not any(clipped), (step, mode, owners)
            assert any(bad in e.duplicates for e in owners), (step, mode, owners)
        for e in owners:  # an honest owner never rejects another honest volunteer
            assert set(e.rejected) <= {bad} and set(e.clipped) <= {bad}, e
    assert all(seen[m] >= 1 for m in MODES), f"the hostile took part in too few steps: {seen}"

    # the honest volunteers hold identical, finite parameters after every step
    for step in range(1, STEPS + 1):
        first = recs[0].params[step]
        assert np.isfinite(first).all(), f"step {step}"
        for rec in recs[1:]:
            np.testing.assert_array_equal(rec.params[step], first, err_msg=f"after step {step}")

    # and they still learn: on the same batches, the loss after the last step is below that after the first
    v, rec = honest[0], recs[0]
    seq_len = run.spec.model.args["seq_len"]
    # (its first micro-batches: at step 0 its share of the target may have been 0)
    batches = [
        Sampler.take(p, run.manifest, v.config.data_dir, seq_len) for p in rec.batches[min(rec.batches)][:4]
    ]

    def loss_at(step: int) -> float:
        v.trainer.set_flat_params(rec.params[step])
        return float(np.mean([mean_loss(v.trainer, b.x, b.y) for b in batches]))

    first, last = loss_at(1), loss_at(STEPS)
    assert math.isfinite(last) and last < first - 0.1, (first, last)


class LyingDonor(Volunteer):
    """Trains honestly, but serves state snapshots with one byte flipped in every range, under the true
    manifest and content hash it declares to the tracker."""

    def __init__(self, config: VolunteerConfig, emit: ev.Emit = ev.no_emit, record=None) -> None:
        def event(e: ev.Event) -> None:
            if isinstance(e, ev.Joined):  # (the joined run's state server exists from here on)
                self._lie()
            emit(e)

        super().__init__(config, emit=event, record=record)

    def _lie(self) -> None:
        assert self._run is not None
        server = self._run.state_server
        publish = server.publish

        def lying_publish(snapshot: Snapshot) -> None:
            data = bytearray(snapshot.read(0, snapshot.size))
            rb = snapshot.manifest.range_bytes
            for offset in range(rb // 2, len(data), rb):
                data[offset] ^= 0x5A
            snapshot.path.write_bytes(data)  # the file it serves, under the true manifest
            publish(snapshot)

        server.publish = lying_publish


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_newcomer_bans_a_donor_serving_another_state_and_loads_the_true_one(tmp_path):
    # The run goes on until the newcomer has caught up and stepped twice with the others (bounded by time,
    # not by a step count: rounds got fast enough that 24 steps ended before a retried catch-up once).
    late_at, steps = 6, 400
    model = {"recipe": "tiny-gpt", "args": {"d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 32}}
    state = StateConfig(range_bytes=64 * 1024)
    seen: list[ev.Event] = []
    recs = {name: Recorder() for name in ("honest", "liar", "newcomer")}

    def make(cls: type[Volunteer], name: str, seed: int, emit=ev.no_emit) -> Volunteer:
        return cls(
            VolunteerConfig(
                run_id=run.spec.run_id,
                tracker_url=run.tracker.url,
                data_dir=tmp_path / name,
                seed=seed,
                max_steps=steps,
                state=state,
            ),
            emit=emit,
            record=recs[name],
        )

    async with published_run(tmp_path, model=model, target_batch_size=64) as run:
        reached = asyncio.Event()

        def watch(e: ev.Event) -> None:
            if isinstance(e, ev.StepDone) and e.step + 1 >= late_at:
                reached.set()

        early = [make(Volunteer, "honest", 0, emit=watch), make(LyingDonor, "liar", 1)]
        tasks = [asyncio.create_task(v.run()) for v in early]
        await asyncio.wait_for(reached.wait(), 120)
        late = make(Volunteer, "newcomer", 2, emit=seen.append)
        tasks.append(asyncio.create_task(late.run()))
        try:
            await until(
                lambda: (
                    late.summary.caught_up_to is not None
                    and min(early[0].step, late.step) >= late.summary.caught_up_to + 3
                ),
                200,
                "the newcomer catching up and stepping with the others",
            )
        finally:
            for v in (*early, late):
                v.stop()
        summaries = await asyncio.wait_for(asyncio.gather(*tasks), 60)

    honest, liar = early
    banned = [e for e in seen if isinstance(e, ev.DonorBanned)]
    assert banned and all(liar.peer_id in e.donor for e in banned), banned
    assert all(honest.peer_id not in e.donor for e in banned), banned
    assert any("sha256" in e.reason or "manifest" in e.reason for e in banned), banned
    loaded = [e for e in seen if isinstance(e, ev.StateLoaded)]
    assert loaded and all(any(honest.peer_id in d for d in e.donors_used) for e in loaded), loaded
    caught = summaries[2].caught_up_to
    assert caught is not None and caught >= late_at, summaries[2]
    compared = 0
    for step, params in recs["newcomer"].params.items():
        if step >= caught and step in recs["honest"].params:
            np.testing.assert_array_equal(params, recs["honest"].params[step], err_msg=f"step {step}")
            compared += 1
    assert compared >= 2


@pytest.mark.parametrize("answer", ["finite", "nan"])
async def test_a_hostile_part_owner_answer_is_refused_finite_or_not(answer):
    """A part owner that answers 123.0 everywhere (finite) or NaN: neither is applied. The finite one comes
    with the receipt an unmodified owner signs of what it sent (its terms against that answer), which breaks
    ``‖a‖² = Σ g``: proof against it; the NaN one is malformed. Each member keeps its own values for the part
    (the engine then zeroes it, as every member does), and the other parts are the exact mean.

    The hostile owner has weight 0, so it sends no copies and its coder only ever encodes its answers."""
    peers = await start_peers(3, AveragingConfig(clip_multiple=0.0), prefix=f"own-{answer}-")
    try:
        coder = peers[0].averager._coder
        encode_raw = coder.encode_raw

        def forged(values, residual=None, **kw):
            return encode_raw(np.full_like(values, 123.0 if answer == "finite" else np.nan), residual, **kw)

        coder.encode_raw = forged
        rng = np.random.default_rng(1)
        vectors = [rng.standard_normal(3000).astype(np.float32) for _ in peers]
        results = await run_round(peers, assign(peers, [0, 1, 1]), vectors, [0, 1, 1])
    finally:
        for p in peers:
            await p.stop()
    mean = weighted_mean(vectors, [0, 1, 1])
    for i in (1, 2):
        r = results[i]
        np.testing.assert_allclose(r.values[1000:], mean[1000:], rtol=1e-5, atol=1e-6)  # honest parts
        assert r.failed_parts == (0,), r.reasons
        why = r.reasons["part 0"]
        assert ("not the mean of the copies listed" if answer == "finite" else "malformed") in why, why
        np.testing.assert_array_equal(r.values[:1000], vectors[i][:1000])


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_fake_state_declarations_leave_a_newcomer_catching_up_from_honest_donors(tmp_path):
    """Issue 16, as it was tried from outside: a joined, reachable peer declares every 0.3 s a state 1000
    steps ahead of the run and one for the current step, with hashes of its choosing. The tracker refuses
    each (a step the run has not reached; a step it took no part in), drops it as a donor at the third, and a
    newcomer catches up from the honest volunteers and then holds their parameters."""
    model = {"recipe": "tiny-gpt", "args": {"d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 32}}
    seen: list[ev.Event] = []
    refusals: list[TrackerError] = []
    recs = {name: Recorder() for name in ("honest-a", "honest-b", "newcomer")}

    def make(name: str, seed: int, emit=ev.no_emit) -> Volunteer:
        return Volunteer(
            VolunteerConfig(
                run_id=run.spec.run_id, tracker_url=run.tracker.url, data_dir=tmp_path / name, seed=seed
            ),
            emit=emit,
            record=recs[name],
        )

    async with published_run(tmp_path, model=model, target_batch_size=64) as run:
        run_id = run.spec.run_id
        honest = [make("honest-a", 0), make("honest-b", 1)]
        tasks = [asyncio.create_task(v.run()) for v in honest]
        await until(lambda: min(v.summary.steps_done for v in honest) >= 2, 120, "two honest steps")
        async with TrackerClient(run.tracker.url) as client:
            liar = SimVolunteer(client, run_id)
            await liar.serve()  # it answers the tracker's ping: a reachable peer, allowed to declare state
            await liar.join()
            await liar.wait_reachable()

            async def lie() -> None:
                while True:
                    step = (await client.status(run_id)).global_step
                    await liar.heartbeat(step, 0, computing=False)
                    for claimed in (step + 1000, step):
                        try:
                            await liar.declare_state(claimed, secrets.token_hex(32), 1 << 20)
                        except TrackerError as exc:
                            refusals.append(exc)
                    await asyncio.sleep(0.3)

            lying = asyncio.create_task(lie())
            late = None
            try:
                await until(lambda: min(v.summary.steps_done for v in honest) >= 4, 120, "four honest steps")
                late = make("newcomer", 2, emit=seen.append)
                tasks.append(asyncio.create_task(late.run()))
                await until(
                    lambda: (
                        late.summary.caught_up_to is not None
                        and min(honest[0].step, late.step) >= late.summary.caught_up_to + 3
                    ),
                    200,
                    "the newcomer catching up and stepping with the others",
                )
            finally:
                lying.cancel()
                for v in (*honest, *([late] if late else [])):
                    v.stop()
                await liar.close()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)

    messages = [str(e) for e in refusals]
    assert any("beyond the run's step" in m for m in messages), messages[:5]
    assert any("took no part in step" in m for m in messages), messages[:5]
    assert any(e.status == 403 and "no longer a state donor" in str(e) for e in refusals), messages[-3:]
    loaded = [e for e in seen if isinstance(e, ev.StateLoaded)]
    honest_ids = {v.peer_id for v in honest}
    assert loaded and all(d.partition(" at ")[0] in honest_ids for e in loaded for d in e.donors_used), loaded
    caught = late.summary.caught_up_to
    compared = 0
    for step, params in recs["newcomer"].params.items():
        if step >= caught and step in recs["honest-a"].params:
            np.testing.assert_array_equal(params, recs["honest-a"].params[step], err_msg=f"step {step}")
            compared += 1
    assert compared >= 2
