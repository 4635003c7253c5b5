"""The trainer's arithmetic: LR schedule, sample-weighted accumulation, apply, state, and the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from crowdtrain.protocol.errors import AveragingError, ConfigError, RecipeError, StateSyncError
from crowdtrain.protocol.messages import OptimizerSpec, ScheduleSpec
from crowdtrain.volunteer.models import MLP, TINY_GPT
from crowdtrain.volunteer.schedule import learning_rate
from crowdtrain.volunteer.trainer import Trainer
from tests.oracles import mean_gradient, mean_loss, replay_reference, weighted_mean

GPT_ARGS = {"d_model": 32, "n_layer": 2, "n_head": 4, "seq_len": 16}
ADAMW = OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1, grad_clip=1.0)
SGD = OptimizerSpec(name="sgd", lr=5e-2, momentum=0.9, weight_decay=0.01, grad_clip=0.5)
COSINE = ScheduleSpec(kind="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)


# ------------------------------------------------------------------ schedule


def test_constant_schedule_with_warmup():
    spec, sched = OptimizerSpec(lr=1.0), ScheduleSpec(kind="constant", warmup_steps=4, total_steps=10)
    assert [learning_rate(s, spec, sched) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert learning_rate(10_000, spec, sched) == 1.0


def test_cosine_schedule_at_key_steps():
    spec = OptimizerSpec(lr=2.0)
    sched = ScheduleSpec(kind="cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert learning_rate(0, spec, sched) == pytest.approx(0.2)
    assert learning_rate(9, spec, sched) == pytest.approx(2.0)
    assert learning_rate(10, spec, sched) == pytest.approx(2.0)  # warm-up done: the peak
    assert learning_rate(60, spec, sched) == pytest.approx(1.1)  # half-way: (lr + min_lr) / 2
    assert learning_rate(35, spec, sched) == pytest.approx(0.2 + 0.5 * (1 + math.cos(math.pi / 4)) * 1.8)
    assert learning_rate(110, spec, sched) == pytest.approx(0.2)
    assert learning_rate(5000, spec, sched) == pytest.approx(0.2)


def test_linear_schedule_at_key_steps():
    spec = OptimizerSpec(lr=1.0)
    sched = ScheduleSpec(kind="linear", warmup_steps=0, total_steps=100, min_lr_ratio=0.0)
    assert learning_rate(0, spec, sched) == 1.0
    assert learning_rate(25, spec, sched) == pytest.approx(0.75)
    assert learning_rate(100, spec, sched) == 0.0
    assert learning_rate(101, spec, sched) == 0.0


def test_warmup_longer_than_total_ends_at_min_lr():
    spec = OptimizerSpec(lr=1.0)
    sched = ScheduleSpec(kind="cosine", warmup_steps=20, total_steps=10, min_lr_ratio=0.5)
    assert learning_rate(19, spec, sched) == 1.0
    assert learning_rate(20, spec, sched) == 0.5


@pytest.mark.parametrize(
    ("spec", "sched", "field"),
    [
        (OptimizerSpec(lr=0.0), ScheduleSpec(), "optimizer.lr"),
        (OptimizerSpec(lr=float("nan")), ScheduleSpec(), "optimizer.lr"),
        (OptimizerSpec(), ScheduleSpec(warmup_steps=-1), "schedule.warmup_steps"),
        (OptimizerSpec(), ScheduleSpec(total_steps=0), "schedule.total_steps"),
        (OptimizerSpec(), ScheduleSpec(min_lr_ratio=1.5), "schedule.min_lr_ratio"),
    ],
)
def test_bad_schedule_names_the_field(spec, sched, field):
    with pytest.raises(ConfigError) as info:
        learning_rate(0, spec, sched)
    assert info.value.field == field


def test_negative_step_is_refused():
    with pytest.raises(ValueError, match="global step"):
        learning_rate(-1, OptimizerSpec(), ScheduleSpec())


# ------------------------------------------------------------------ accumulation


def token_batches(sizes: list[int], seed: int = 0, seq_len: int = 16) -> list[tuple[np.ndarray, np.ndarray]]:
    """Micro-batches shaped like the sampler's: windows of seq_len + 1 byte tokens split into x and y."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        w = rng.integers(0, 256, size=(n, seq_len + 1), dtype=np.uint8)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def gpt_trainer(opt: OptimizerSpec = ADAMW, sched: ScheduleSpec = COSINE) -> Trainer:
    return Trainer(TINY_GPT, TINY_GPT.build(GPT_ARGS), opt, sched)


def test_the_handed_out_gradient_is_the_mean_over_all_samples():
    batches = token_batches([3, 5, 1, 7])
    trainer = gpt_trainer()
    for x, y in batches:
        loss, n = trainer.accumulate(x, y)
        assert n == len(x)
        assert math.isfinite(loss)
    assert trainer.samples == 16
    # One backward over the concatenated batch: its mean loss is the mean over all 16 samples.
    model = TINY_GPT.build(GPT_ARGS)
    x = torch.from_numpy(np.concatenate([b[0] for b in batches]))
    y = torch.from_numpy(np.concatenate([b[1] for b in batches]))
    TINY_GPT.loss(model, x, y).backward()
    expected = torch.cat([p.grad.reshape(-1) for _, p in sorted(model.named_parameters())]).numpy()
    got = trainer.take_grad()
    assert got.dtype == np.float32
    assert got.shape == (trainer.numel,)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)


def test_gradient_lands_in_the_flat_buffer_without_copies():
    trainer = gpt_trainer()
    pointers = [p.grad.data_ptr() for p in trainer.params]
    for x, y in token_batches([2, 2]):
        trainer.accumulate(x, y)
    assert [p.grad.data_ptr() for p in trainer.params] == pointers
    trainer.model.zero_grad()  # someone drops the .grads: the trainer re-attaches its buffer
    trainer.accumulate(*token_batches([2])[0])
    assert [p.grad.data_ptr() for p in trainer.params] == pointers


def test_unlabelled_samples_are_refused_with_a_sentence():
    trainer = Trainer(MLP, MLP.build({}), ADAMW, COSINE)
    with pytest.raises(RecipeError, match="'mlp' needs labelled samples"):
        trainer.accumulate(np.zeros((2, 32), dtype=np.float32), None)
    assert trainer.samples == 0


def test_no_samples_gives_zeros():
    trainer = gpt_trainer()
    g = trainer.take_grad()
    assert g.dtype == np.float32
    assert not g.any()
    assert trainer.samples == 0


@pytest.mark.parametrize("opt", [ADAMW, SGD], ids=["adamw", "sgd"])
def test_two_halves_combined_by_weighted_mean_equal_one_trainer_that_saw_everything(opt):
    batches = token_batches([4, 1, 3, 6, 2], seed=1)
    whole, left, right, idle = gpt_trainer(opt), gpt_trainer(opt), gpt_trainer(opt), gpt_trainer(opt)
    for step in range(3):
        for x, y in batches:
            whole.accumulate(x, y)
        for x, y in batches[:2]:
            left.accumulate(x, y)
        for x, y in batches[2:]:
            right.accumulate(x, y)
        # The all-reduce's weighted mean, with a third peer that has no samples (weight 0).
        peers = [left, right, idle]
        weights = [float(t.samples) for t in peers]
        mean = weighted_mean([mean_gradient(t) for t in peers], weights)
        everything = whole.take_grad()  # in place: apply steps with the buffer itself, as the engine does
        np.testing.assert_allclose(mean, everything, rtol=1e-5, atol=1e-6 * np.abs(everything).max())
        lrs = {t.apply(mean, step) for t in peers}
        assert lrs == {whole.apply(everything, step)}
        for t in (whole, left, right, idle):
            assert t.samples == 0
        # Every peer of the group ends bit-identical, and equal to the single trainer up to rounding (AdamW
        # normalises coordinates with tiny gradients, so their rounding shows at ~1e-6).
        np.testing.assert_array_equal(left.flat_params(), right.flat_params())
        np.testing.assert_array_equal(left.flat_params(), idle.flat_params())
        atol = 2e-6 if opt.name == "adamw" else 1e-7
        np.testing.assert_allclose(left.flat_params(), whole.flat_params(), rtol=1e-5, atol=atol)
        batches = token_batches([4, 1, 3, 6, 2], seed=2 + step)


def test_apply_clips_to_the_global_norm():
    trainer = gpt_trainer(OptimizerSpec(name="sgd", lr=1.0, grad_clip=0.5), ScheduleSpec(kind="constant"))
    before = trainer.flat_params()
    g = np.zeros(trainer.numel, dtype=np.float32)
    g[:4] = [3.0, 4.0, 0.0, 0.0]  # norm 5 → scaled by 0.5 / 5
    assert trainer.apply(g, 0) == 1.0
    np.testing.assert_allclose(before - trainer.flat_params(), g * (0.5 / (5.0 + 1e-6)), atol=1e-7)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (np.zeros(7, dtype=np.float32), "has shape \\(7,\\)"),
        ("nan", "NaN or infinite"),
    ],
)
def test_apply_refuses_bad_gradients_and_leaves_the_model_alone(values, match):
    trainer = gpt_trainer()
    trainer.accumulate(*token_batches([2])[0])
    before = trainer.flat_params()
    if isinstance(values, str):
        values = np.zeros(trainer.numel, dtype=np.float32)
        values[5] = np.nan
    with pytest.raises(AveragingError, match=match):
        trainer.apply(values, 0)
    np.testing.assert_array_equal(trainer.flat_params(), before)
    assert trainer.samples == 2


def test_reset_accumulation():
    trainer = gpt_trainer()
    trainer.accumulate(*token_batches([2])[0])
    trainer.reset_accumulation()
    assert trainer.samples == 0
    assert not mean_gradient(trainer).any()
    trainer.accumulate(*token_batches([2])[0])
    fresh = gpt_trainer()
    fresh.accumulate(*token_batches([2])[0])
    np.testing.assert_array_equal(mean_gradient(trainer), mean_gradient(fresh))


def test_evaluate_does_not_touch_the_accumulation():
    trainer, twin = gpt_trainer(), gpt_trainer()
    for t in (trainer, twin):
        t.accumulate(*token_batches([2])[0])
    mean_loss(trainer, *token_batches([4], seed=9)[0])
    assert trainer.samples == 2
    np.testing.assert_array_equal(mean_gradient(trainer), mean_gradient(twin))


# ------------------------------------------------------------------ parameters and state


def test_flat_params_round_trip():
    trainer = gpt_trainer()
    v = trainer.flat_params()
    assert v.dtype == np.float32
    trainer.set_flat_params(v * 2)
    np.testing.assert_array_equal(trainer.flat_params(), v * 2)
    with pytest.raises(AveragingError, match="do not fit"):
        trainer.set_flat_params(v[:-1])
    bad = v.copy()
    bad[0] = np.inf
    with pytest.raises(AveragingError, match="NaN or infinite"):
        trainer.set_flat_params(bad)


def test_flat_layout_is_sorted_parameter_names():
    trainer = Trainer(
        MLP, MLP.build({"in_features": 2, "hidden": 3, "n_layer": 1, "out_features": 2}), ADAMW, COSINE
    )
    v = trainer.flat_params()
    m = trainer.model
    expected = torch.cat(
        [m.head.bias, m.head.weight.reshape(-1), m.layers[0].bias, m.layers[0].weight.reshape(-1)]
    )
    np.testing.assert_array_equal(v, expected.detach().numpy())


def test_loaded_optimizer_state_is_not_shared_with_its_source():
    a = gpt_trainer()
    for step, (x, y) in enumerate(token_batches([3, 3, 3])):
        a.accumulate(x, y)
        a.apply(a.take_grad(), step)
    b = gpt_trainer()
    # the live optimizer state itself: loading must copy it, or b's steps would move a's moments too
    b.load_state({k: v.clone() for k, v in a.model.state_dict().items()}, a.optimizer.state_dict())
    np.testing.assert_array_equal(a.flat_params(), b.flat_params())
    for t in (a, b):
        t.accumulate(*token_batches([4], seed=5)[0])
        t.apply(t.take_grad(), 3)
    np.testing.assert_array_equal(a.flat_params(), b.flat_params())


def test_state_that_does_not_fit_is_a_state_sync_error():
    trainer = gpt_trainer()
    other = Trainer(TINY_GPT, TINY_GPT.build({**GPT_ARGS, "d_model": 16}), ADAMW, COSINE)
    with pytest.raises(StateSyncError, match="does not fit"):
        trainer.load_state(other.model.state_dict(), other.optimizer.state_dict())


def test_cuda_without_a_gpu_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError) as info:
        Trainer(TINY_GPT, TINY_GPT.build(GPT_ARGS), ADAMW, COSINE, device="cuda")
    assert info.value.field == "device"
    assert gpt_trainer().device.type == "cpu"
    assert Trainer(MLP, MLP.build({}), ADAMW, COSINE, device="auto").device.type == "cpu"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (OptimizerSpec(beta1=1.0), "optimizer.beta1"),
        (OptimizerSpec(momentum=-0.1), "optimizer.momentum"),
        (OptimizerSpec(grad_clip=float("inf")), "optimizer.grad_clip"),
    ],
)
def test_bad_optimizer_spec_names_the_field(spec, field):
    with pytest.raises(ConfigError) as info:
        Trainer(MLP, MLP.build({}), spec, COSINE)
    assert info.value.field == field


# ------------------------------------------------------------------ the reference


def manual_loop(opt: OptimizerSpec, sched: ScheduleSpec, steps) -> list[np.ndarray]:
    """The textbook loop in plain torch: sum of n·loss backward, divide by N, clip, AdamW/SGD, step.

    Clipping uses the norm of the whole gradient vector, as the trainer does (clip_grad_norm_ computes the
    same norm as a norm of per-tensor norms, which rounds differently)."""
    model = TINY_GPT.build(GPT_ARGS)
    named = sorted(model.named_parameters())
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    if opt.name == "adamw":
        optimizer = torch.optim.AdamW(
            groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, fused=True
        )
    else:
        optimizer = torch.optim.SGD(groups, lr=opt.lr, momentum=opt.momentum)
    out = []
    for step, batches in enumerate(steps):
        optimizer.zero_grad()
        total = 0
        for x, y in batches:
            n = len(x)
            loss = TINY_GPT.loss(model, torch.from_numpy(x), torch.from_numpy(y))
            (loss * n).backward()
            total += n
        for _, p in named:
            p.grad /= total
        norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for _, p in named]))
        for _, p in named:
            p.grad.mul_(torch.clamp(opt.grad_clip / (norm + 1e-6), max=1.0))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, opt, sched)
        optimizer.step()
        out.append(torch.cat([p.detach().reshape(-1) for _, p in named]).numpy().copy())
    return out


@pytest.mark.parametrize("opt", [ADAMW, SGD], ids=["adamw", "sgd"])
def test_replay_reference_matches_a_manual_loop(opt):
    steps = [token_batches([2, 3, 1], seed=10 + s) for s in range(6)]
    reference = replay_reference("tiny-gpt", GPT_ARGS, opt, COSINE, steps)
    manual = manual_loop(opt, COSINE, steps)
    assert len(reference) == len(manual) == 6
    assert not np.array_equal(reference[0], reference[-1])
    for r, m in zip(reference, manual, strict=True):
        np.testing.assert_allclose(r, m, rtol=1e-6, atol=1e-9)


def test_replay_by_volunteer_matches_flat_replay_and_the_trainers():
    per_volunteer = [
        [token_batches([2, 1], seed=20 + s), token_batches([3], seed=40 + s), []] for s in range(4)
    ]
    flat = [[b for v in step for b in v] for step in per_volunteer]
    grouped = replay_reference(TINY_GPT, GPT_ARGS, ADAMW, COSINE, per_volunteer, by_volunteer=True)
    plain = replay_reference(TINY_GPT, GPT_ARGS, ADAMW, COSINE, flat)
    # Three trainers doing what three volunteers do, with the all-reduce's weighted mean in between.
    peers = [gpt_trainer() for _ in range(3)]
    for step, volunteers in enumerate(per_volunteer):
        for t, batches in zip(peers, volunteers, strict=True):
            for x, y in batches:
                t.accumulate(x, y)
        weights = [t.samples for t in peers]
        mean = weighted_mean([mean_gradient(t) for t in peers], weights)
        for t in peers:
            t.apply(mean, step)
        np.testing.assert_array_equal(peers[0].flat_params(), grouped[step])
        np.testing.assert_allclose(grouped[step], plain[step], rtol=1e-5, atol=2e-6)


def test_replay_can_start_mid_run_from_given_parameters():
    steps = [token_batches([2], seed=s) for s in range(4)]
    # Plain SGD: no optimizer state, so parameters and the global step are the whole state to resume from.
    plain = OptimizerSpec(name="sgd", lr=0.05, grad_clip=0.5, weight_decay=0.01)
    a = replay_reference("tiny-gpt", GPT_ARGS, plain, COSINE, steps)
    b = replay_reference("tiny-gpt", GPT_ARGS, plain, COSINE, steps[2:], start_step=2, initial_params=a[1])
    assert len(b) == 2
    np.testing.assert_allclose(b[-1], a[-1], rtol=1e-6, atol=1e-7)
    assert not np.allclose(a[1], a[-1])


def test_member_order_of_the_mean_does_not_grow_into_parameter_differences():
    """Regression: with an attention key bias (true gradient 0, computed gradient = rounding noise), AdamW
    turned the order in which the group's mean was summed into ~1e-6 parameter differences."""
    per_volunteer = [
        [token_batches([2], seed=60 + s), token_batches([3], seed=80 + s), token_batches([1], seed=99 + s)]
        for s in range(8)
    ]
    forward = replay_reference(TINY_GPT, GPT_ARGS, ADAMW, COSINE, per_volunteer, by_volunteer=True)
    backward = replay_reference(
        TINY_GPT,
        GPT_ARGS,
        ADAMW,
        COSINE,
        per_volunteer,
        by_volunteer=True,
        combine=lambda grads, weights: weighted_mean(grads[::-1], weights[::-1]),
    )
    # A reordered fp32 sum may differ by an ulp (~1.2e-7 here with one torch thread); the regression was ~1e-6.
    for a, b in zip(forward, backward, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-7)
