"""The tracker's step policy (tracker/policy.py): its constants are checked when made, and its rules read them."""

from __future__ import annotations

import dataclasses
import math

import pytest

from crowdtrain.protocol.errors import ConfigError
from crowdtrain.tracker import policy
from crowdtrain.tracker.peers import Share
from crowdtrain.tracker.policy import StepPolicy, late


def test_the_default_policy_is_valid_and_says_when_a_silent_peer_is_a_straggler():
    p = StepPolicy()
    assert p.silent_s(3, 1.0) == 3.0
    assert p.silent_s(1, 0.5) == p.straggle_floor_s  # (a heartbeat interval below the floor: the floor)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("late_factor", 0.9),
        ("answer_growth", 0.5),
        ("spare_fraction", 0.0),
        ("steal_fraction", 1.5),
        ("answer_decay", 1.2),
        ("straggle_check_s", 0.0),
        ("late_grace_s", -0.1),
        ("spare_wait_s", math.nan),
        ("answer_floor_s", math.inf),
    ],
)
def test_a_policy_with_a_value_out_of_range_is_refused_naming_it(field, value):
    with pytest.raises(ConfigError) as caught:
        StepPolicy(**{field: value})
    assert field in str(caught.value) or "factor" in str(caught.value)


def _share(peer_id: str, *, allotted: int, samples: int, rate: float, done_at: float = -1.0) -> Share:
    return Share(
        peer_id=peer_id, step=1, allotted=allotted, samples=samples, samples_per_s=rate, done_at=done_at
    )  # (its step and its last report at t = 0)


def test_the_late_rule_reads_the_policy_in_force(monkeypatch):
    """One peer done after 2 s; another owes 40 samples at 10/s since t=0 (4 s of rest): late past 1.5 × 4 + 0.5
    = 6.5 s with the defaults, past 4.5 s with a factor of 1 (and the done peer's wait at its grace)."""
    done = _share("done", allotted=40, samples=40, rate=20.0, done_at=2.0)
    slow = _share("slow", allotted=40, samples=0, rate=10.0)
    assert late([done, slow], 6.0) == []
    assert late([done, slow], 6.6) == ["slow"]
    monkeypatch.setattr(policy, "POLICY", dataclasses.replace(policy.POLICY, late_factor=1.0))
    assert late([done, slow], 4.6) == ["slow"]


# ------------------------------------------------------------ a round's inner steps (tracker/horizon.py)


def _rule(h, averaging_s, rate=1000.0, target=64, computes_ahead=True, bounds=(4, 100)):
    from crowdtrain.tracker.horizon import next_inner_steps

    return next_inner_steps(h, bounds, target, rate, averaging_s, computes_ahead)


def test_auto_inner_steps_hide_the_averaging_behind_the_next_rounds_compute():
    # 1,000 samples/s over the run, target 64: an inner step's worth of compute takes 0.064 s
    assert _rule(4, 0.05) == 4  # a LAN: 0.05 s of averaging hides behind the smallest round
    # a home line: 3 s of averaging needs 2 × 3 s of compute = 6 s = 93.75 inner steps' worth, reached by
    # doubling a round at most
    assert policy.POLICY.auto_hide_margin == 2.0
    assert _rule(60, 3.0) == math.ceil(2 * 3.0 * 1000 / 64) == 94
    assert _rule(4, 3.0) == 8 and _rule(8, 3.0) == 16
    assert _rule(80, 60.0) == 100  # (never past the bound)
    # delay 0: the averaging stops the compute, so H buys a compute share of 0.9 (9 × the averaging)
    assert _rule(40, 0.5, computes_ahead=False) == math.ceil(9 * 0.5 * 1000 / 64) == 71
    # one fast round shrinks H by half at most; nothing measured (or no rate) keeps it; nor does a choice
    # within 1.25 × of it (69 against 60)
    assert _rule(80, 0.05) == 40
    assert _rule(60, 2.2) == 60 and _rule(60, 2.8) == math.ceil(2 * 2.8 * 1000 / 64) == 88
    assert _rule(30, None) == 30 and _rule(30, 1.0, rate=0.0) == 30 and _rule(30, math.nan) == 30


def test_the_horizon_counts_the_inner_steps_before_each_step_and_a_restarted_tracker_keeps_them():
    from crowdtrain.protocol.messages import AveragingSpec
    from crowdtrain.tracker.horizon import Horizon
    from crowdtrain.tracker.peers import Peer

    def peer(averaging_s):
        return Peer(
            peer_id="p", public_key="k", share=Share(counted_at=0.0, peer_id="p"), averaging_s=averaging_s
        )

    auto = AveragingSpec(inner_steps="auto", inner_steps_min=4, inner_steps_max=50, delay=1)
    h = Horizon(auto, 0)  # (the first rounds: 16, within the bounds)
    assert (h.h, h.before, h.previous) == (16, 0, 0)
    h.advance(1, 64, 1000.0, [])  # no member reported an averaging time yet
    h.advance(2, 64, 1000.0, [peer(1.2)])  # 1.2 s wants 38 inner steps: doubled at most a round
    assert (h.inner.step, h.inner.h, h.inner.before, h.inner.previous) == (2, 32, 32, 16)
    h.advance(3, 64, 1000.0, [peer(1.2)])  # (38 is within 1.25 × 32: it stays)
    assert (h.h, h.before) == (32, 64)
    h.advance(4, 64, 1000.0, [peer(0.1)])  # a fast link: halved at most, then down to the bound
    h.advance(5, 64, 1000.0, [peer(0.1)])
    h.advance(6, 64, 1000.0, [peer(0.1)])
    assert (h.h, h.previous) == (4, 8)
    # the median of the members' reports: one stranger's 10,000 s moves nothing (38, not the bound)
    at60 = Horizon(AveragingSpec(inner_steps="auto", delay=1), 9, (200, 60))
    at60.advance(10, 64, 1000.0, [peer(1.0), peer(1.2), peer(10_000.0)])
    assert at60.h == math.ceil(2 * 1.2 * 1000 / 64) == 38
    # restarted at step 2 with the history's (sum, last H): the open step keeps the last H
    restarted = Horizon(auto, 2, (8, 4))
    assert (restarted.h, restarted.before, restarted.previous) == (4, 8, 4)
    # a fixed H: step × H before, whatever the history says
    fixed = Horizon(AveragingSpec(inner_steps=30), 5, (999, 7))
    assert (fixed.h, fixed.before, fixed.previous) == (30, 150, 30)
    fixed.advance(6, 64, 1000.0, [peer(100.0)])
    assert (fixed.h, fixed.before) == (30, 180)


def test_the_auto_constants_are_checked():
    for field, value in [
        ("auto_hide_margin", 0.5),
        ("auto_share", 1.0),
        ("auto_shrink", 0.0),
        ("auto_growth", 0.5),
        ("auto_dead_band", 0.9),
    ]:
        with pytest.raises(ConfigError, match=field):
            StepPolicy(**{field: value})
