"""Local-steps mode (``[averaging] inner_steps = H``): inner optimizer steps on each volunteer's own samples, the
pseudo-gradients all-reduced, one outer Nesterov step per global step: through a real tracker, a real seeder
and real peer servers, equal to the rule replayed in one process (``tests/local_oracle.py``)."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from crowdtrain.commands.status import format_status
from crowdtrain.datasets.sampler import Sampler
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import ConfigError
from crowdtrain.protocol.messages import AveragingSpec, RunSpec
from crowdtrain.protocol.runcheck import check_averaging
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from crowdtrain.volunteer.state.config import StateConfig
from tests.harness import Recorder, published_run, until, volunteers
from tests.local_oracle import local_replay_reference
from tests.oracles import assert_replayed

ROUNDS = 6
H = 4
LOCAL = {"codec": "none", "group_size": 4, "clip_multiple": 0.0, "inner_steps": H, "inner_batch_size": 16}


def inner_steps_of(status: str) -> list[int]:
    """Each recent step's H, oldest first, from ``crowdtrain status``'s table (its H column: "auto" runs)."""
    rows = re.findall(r"^\s+(\d+)\s+[\d.]+s\s+[\d,]+\s+\d+\s+\d+\s+(\d+)\s", status, re.M)
    return [h for _, h in sorted((int(s), int(h)) for s, h in rows)]


def replay_rounds(run, vols, recs, rounds: int) -> list[list[list[tuple]]]:
    """Each round's micro-batches, volunteer by volunteer (in peer-id order, the same in every round), read
    back from the data set by the provenance each volunteer recorded."""
    seq_len = run.spec.model.args["seq_len"]
    ordered = sorted(zip(vols, recs, strict=True), key=lambda vr: vr[0].peer_id)
    return [
        [
            [
                (b.x, b.y)
                for b in (
                    Sampler.take(p, run.manifest, v.config.data_dir, seq_len) for p in rec.batches.get(k, [])
                )
            ]
            for v, rec in ordered
        ]
        for k in range(rounds)
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [0, 1])
async def test_three_volunteers_in_local_steps_equal_a_single_process_replay_of_the_rule(tmp_path, delay):
    """A round is H × target samples shared out by rate; each volunteer takes its inner steps, and after every
    round all hold the same parameters, equal to the rule replayed on the very samples each drew."""
    async with published_run(
        tmp_path,
        target_batch_size=64,
        micro_batch_size=8,
        averaging={**LOCAL, "delay": delay},
        # the inner learning rate moves within a round and from round to round (keyed to anchor_step × H + j)
        schedule={"kind": "cosine", "warmup_steps": 3, "total_steps": 40},
    ) as run:
        recs = [Recorder() for _ in range(3)]
        events: list[list[ev.Event]] = [[], [], []]
        vols = volunteers(
            run, tmp_path, 3, seed=7, record=recs, emit=[e.append for e in events], max_steps=ROUNDS
        )
        summaries = await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 240)
        async with TrackerClient(run.tracker.url) as client:
            status = await client.status(run.spec.run_id)
    assert all(s.steps_done == ROUNDS and s.steps_missed == 0 for s in summaries), summaries
    # a round holds H × target samples (the tracker's target is the round's)
    round_samples = H * run.spec.target_batch_size
    assert status.target == round_samples
    # `crowdtrain status` names the mode
    assert (status.inner_steps, status.codec) == (H, "none")
    assert f"mode          local steps: a global step is an outer round of {H} × the target" in format_status(
        status
    )
    assert status.recent_steps and all(
        round_samples <= r.samples <= 1.25 * round_samples for r in status.recent_steps
    ), [r.samples for r in status.recent_steps]
    for k in range(1, ROUNDS + 1):
        for rec in recs[1:]:
            np.testing.assert_array_equal(rec.params[k], recs[0].params[k], err_msg=f"after round {k}")
    # every volunteer took several inner steps in a round (its samples of the round over the inner batch)
    inner_batch = run.spec.averaging.inner_batch_size
    for rec in recs:
        per_round = [sum(len(mb) for mb in rec.batches.get(k, [])) for k in range(ROUNDS)]
        assert max(per_round) > inner_batch, per_round

    rounds = replay_rounds(run, vols, recs, ROUNDS)
    reference = local_replay_reference(run.spec, rounds, delay=delay)
    assert len(reference) == ROUNDS
    for k, expected in enumerate(reference, start=1):
        assert_replayed(recs[0].params[k], expected, f"round {k}")
    # the outer steps moved the parameters, and the loss fell
    assert not np.allclose(recs[0].params[ROUNDS], recs[0].params[1])
    losses = summaries[0].losses
    assert losses[-1] < losses[0], losses
    # the rule differs from every-step training on the same samples: the replay would not match a plain mean
    steps_done = [e for e in events[0] if isinstance(e, ev.StepDone)]
    assert [e.lr for e in steps_done] == [run.spec.averaging.outer_lr] * ROUNDS


@pytest.mark.timeout(300)
async def test_with_inner_steps_auto_the_tracker_lengthens_rounds_it_cannot_hide_and_the_run_equals_a_replay_of_its_h(
    tmp_path,
):
    """``inner_steps = "auto"`` with a tiny target (8 samples): a round of the first 16 inner steps computes in
    a few hundredths of a second, far less than twice its averaging takes even on loopback, so the tracker
    lengthens the rounds (doubling, to the bound: 32). Every round's H is in the step history; the volunteers
    hold one state, equal to the rule replayed with that sequence of H (the inner learning rates start at the
    sum of the H before)."""
    rounds_n = 7
    async with published_run(
        tmp_path,
        target_batch_size=8,
        micro_batch_size=8,
        averaging={**LOCAL, "delay": 1, "inner_steps": "auto", "inner_steps_min": 2, "inner_steps_max": 32},
        schedule={"kind": "cosine", "warmup_steps": 3, "total_steps": 400},
    ) as run:
        recs = [Recorder() for _ in range(3)]
        vols = volunteers(run, tmp_path, 3, seed=11, record=recs, max_steps=rounds_n)
        summaries = await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 240)
        async with TrackerClient(run.tracker.url) as client:
            status = await client.status(
                run.spec.run_id
            )  # (its recent steps: the 10 newest, all of them here)
    assert all(s.steps_done == rounds_n and s.steps_missed == 0 for s in summaries), summaries
    hs = [r.inner_steps for r in sorted(status.recent_steps, key=lambda r: r.step)][:rounds_n]
    # nothing measured before the first rounds closed: they take 16; then the measured averaging lengthens
    # them (never past the bound)
    assert hs[0] == 16 and max(hs) > 16 and all(2 <= h <= 32 for h in hs), hs
    assert status.inner_auto and status.target == status.inner_steps * run.spec.target_batch_size
    text = format_status(status)
    assert "H chosen by the tracker each round" in text and inner_steps_of(text) == hs, text
    for k in range(1, rounds_n + 1):
        for rec in recs[1:]:
            np.testing.assert_array_equal(rec.params[k], recs[0].params[k], err_msg=f"after round {k}")
    rounds = replay_rounds(run, vols, recs, rounds_n)
    reference = local_replay_reference(run.spec, rounds, delay=1, inner_steps=hs)
    for k, expected in enumerate(reference, start=1):
        assert_replayed(recs[0].params[k], expected, f"round {k} (H {hs[k - 1]})")
    # (the sequence matters: replayed with every round at the first H, the inner learning rates differ)
    wrong = local_replay_reference(run.spec, rounds, delay=1, inner_steps=[16] * rounds_n)
    assert not np.array_equal(wrong[-1], reference[-1])


@pytest.mark.timeout(300)
async def test_a_late_volunteer_catches_up_to_the_outer_state_and_then_matches_the_others(tmp_path):
    """A newcomer fetches the anchor and the outer optimizer's state while it computes with weight 0, replays
    the rounds that passed meanwhile, and from then on holds exactly the others' parameters."""
    model = {"recipe": "tiny-gpt", "args": {"d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 32}}
    state = StateConfig(range_bytes=64 * 1024, upload_rate=256 * 1024)  # a download of a few seconds
    recs = {i: Recorder() for i in range(3)}
    async with published_run(
        tmp_path, model=model, target_batch_size=32, micro_batch_size=8, averaging={**LOCAL, "inner_steps": 3}
    ) as run:

        def make(i: int) -> Volunteer:
            config = VolunteerConfig(
                run_id=run.spec.run_id,
                tracker_url=run.tracker.url,
                data_dir=tmp_path / f"volunteer-{i}",
                seed=i,
                state=state,
            )
            return Volunteer(config, record=recs[i])

        early = [make(0), make(1)]
        tasks = [asyncio.create_task(v.run()) for v in early]
        await until(lambda: min(v.step for v in early) >= 5, 120, "round 5 of the first two", watching=tasks)
        late = make(2)
        tasks.append(asyncio.create_task(late.run()))
        await until(
            lambda: late.summary.caught_up_to is not None and late.summary.steps_done >= 3,
            200,
            "the late one's catch-up and three rounds after it",
            watching=tasks,
        )
        for v in (*early, late):
            v.stop()
        summaries = await asyncio.wait_for(asyncio.gather(*tasks), 60)

    caught = summaries[2].caught_up_to
    assert caught is not None and caught >= 5, summaries[2]
    compared = 0
    for k, params in recs[2].params.items():
        if k >= caught and k in recs[0].params:
            np.testing.assert_array_equal(params, recs[0].params[k], err_msg=f"round {k}")
            compared += 1
    assert compared >= 2
    assert summaries[2].steps_missed == 0 and min(recs[2].batches) >= caught


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("inner_steps", 0, "averaging.inner_steps: must be between 1 and 100000, got 0"),
        ("inner_batch_size", -1, "averaging.inner_batch_size: must be between 0 and 16777216, got -1"),
        ("outer_lr", 0.0, "averaging.outer_lr: must be above 0 and at most 10, got 0.0"),
        ("outer_lr", float("nan"), "averaging.outer_lr: must be above 0 and at most 10, got nan"),
        ("outer_momentum", 1.0, "averaging.outer_momentum: must be at least 0 and below 1, got 1.0"),
    ],
)
def test_local_steps_options_out_of_range_are_refused_with_their_name(field, value, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_averaging(AveragingSpec(**{field: value}))
    check_averaging(AveragingSpec(inner_steps=30, inner_batch_size=64, outer_lr=0.7, outer_momentum=0.9))


def test_a_run_file_that_sets_only_inner_steps_gets_the_home_link_defaults_and_auto_its_bounds():
    """``run create``'s reading of [averaging] (protocol.messages.with_mode_defaults): a number > 1 or "auto"
    alone brings int2 and delay 1 (the outer step is the class's 0.7 / 0.9); what the file sets stays; every-step
    runs keep theirs."""
    from crowdtrain.protocol.messages import LOCAL_DEFAULTS, with_mode_defaults

    ten = AveragingSpec(**with_mode_defaults({"inner_steps": 10}))
    assert (ten.codec, ten.delay, ten.outer_lr, ten.outer_momentum) == ("int2", 1, 0.7, 0.9)
    assert ten.step_timeout_s == 10 * AveragingSpec().step_timeout_s
    auto = AveragingSpec(**with_mode_defaults({"inner_steps": "auto", "inner_steps_max": 40}))
    assert (
        auto.local and auto.auto_inner_steps and auto.first_inner_steps == 16 and auto.inner_steps_min == 16
    )
    assert (
        auto.codec == LOCAL_DEFAULTS["codec"] and auto.step_timeout_s == 40 * AveragingSpec().step_timeout_s
    )
    assert with_mode_defaults({"inner_steps": 10, "codec": "int8"})["codec"] == "int8"
    assert with_mode_defaults({"codec": "int8"}) == {"codec": "int8"}
    check_averaging(auto)
    for bad, words in [
        ({"inner_steps_min": 1}, "averaging.inner_steps_min: must be between 2 and 100000, got 1"),
        (
            {"inner_steps_min": 8, "inner_steps_max": 6},
            "averaging.inner_steps_max: must be between 8 and 100000",
        ),
    ]:
        with pytest.raises(ConfigError, match=words):
            check_averaging(AveragingSpec(inner_steps="auto", **bad))


def test_with_delay_1_a_peer_starts_each_round_where_its_own_update_would_take_the_run_and_is_judged_on_the_runs_state():
    """Delay 1: the next round cannot start from the outer step of the round in flight, so it starts where
    that step would land with this peer's own pseudo-gradient as the mean (the run's momentum, then its own),
    and measures its next one from there; the anchor, what a snapshot holds and what the held-out loss is
    of, is the run's alone. Started from the stale anchor instead, two rounds in a row pushed from one point
    and the outer momentum 0.95 diverged (docs/benchmarks.md)."""
    import torch

    from crowdtrain.volunteer.local import LocalTrainer
    from crowdtrain.volunteer.models.registry import get_recipe
    from tests.sim import make_run_create

    averaging = AveragingSpec(
        inner_steps=2, inner_batch_size=8, delay=1, codec="none", outer_lr=0.7, outer_momentum=0.9
    )
    create = make_run_create(averaging=averaging)
    fields = {f: getattr(create, f) for f in ("name", "model", "dataset", "target_batch_size", "averaging")}
    spec = RunSpec(run_id="r", tracker_public_key="00" * 32, micro_batch_size=8, **fields)
    recipe = get_recipe(spec.model.recipe)
    torch.manual_seed(0)
    trainer = LocalTrainer(recipe, recipe.build(dict(spec.model.args)), spec)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    live = lambda: torch.cat([p.detach().reshape(-1) for p in trainer.params]).numpy()  # noqa: E731
    anchor0 = trainer.flat_params()

    def round_(k: int) -> np.ndarray:
        for _ in range(2):
            trainer.accumulate(x + k, y)
        return trainer.take_grad(np.empty(trainer.numel, np.float32)).copy()

    start0 = live()
    d0 = round_(0)
    np.testing.assert_array_equal(start0, anchor0)  # (no round in flight: the first starts at the anchor)
    # no average yet: the next round starts from the anchor moved by its own Δ at the outer lr (no momentum yet)
    np.testing.assert_allclose(live(), anchor0 - 0.7 * (d0 + 0.9 * d0), rtol=0, atol=1e-6)
    start1 = live()
    d1 = round_(1)
    np.testing.assert_array_equal(trainer.flat_params(), anchor0)  # the run's state did not move
    assert not np.array_equal(start1, anchor0)
    mean = (d0 + 3 * d0) / 4  # (the others' Δ of round 0: here the same)
    trainer.apply(mean, 0)
    anchor1 = trainer.flat_params()
    buf = mean  # (torch's first momentum buffer is the gradient itself)
    np.testing.assert_allclose(anchor1, anchor0 - 0.7 * (mean + 0.9 * buf), rtol=0, atol=1e-6)
    # the live parameters: the new anchor, moved by the round in flight (d1) with the momentum the run holds
    np.testing.assert_allclose(live(), anchor1 - 0.7 * (d1 + 0.9 * (0.9 * buf + d1)), rtol=0, atol=1e-6)
    # the held-out loss is the anchor's, and evaluating leaves the live parameters as they were
    before = live()
    got, _ = trainer.evaluate_with_metrics(x, y, 8)
    np.testing.assert_array_equal(live(), before)
    reference = LocalTrainer(recipe, recipe.build(dict(spec.model.args)), spec)
    reference.set_flat_params(anchor1)
    assert got == reference.evaluate_with_metrics(x, y, 8)[0]
    # a fetched state drops the round in flight: the next starts from its anchor (moved by the momentum only)
    trainer.load_state(trainer.live_state(), trainer.optimizer.state_dict(), step=1)
    np.testing.assert_allclose(live(), anchor1 - 0.7 * 0.9 * 0.9 * buf, rtol=0, atol=1e-6)
