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
