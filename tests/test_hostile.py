"""Issue 48 with real volunteers: one modified client among four (tests/hostile.py) steers nothing.

Each case is a real run (tracker, seeder, four volunteers over HTTP, the default codec int8, groups of 4) in
every-step or local-steps mode; the honest volunteers' loss (mean of their last 5 steps) is compared with the
same run where the fourth volunteer is honest, same seeds. Single runs of this size spread by about 5 % (a clean local-steps run: 2.50 to 2.67), and the
member's pull costs about 5 % by itself, so the suite allows 15 % (bench/hostile.py measures the mean of 3
runs against the issue's 5 %); unchecked, these attacks multiplied the loss by 1.3 to 230. A hostile part owner
must also be barred (on its own receipt, or by two accusers), a member that pulls by the owners' receipts, and the
honest volunteers must never be accused or reported.
"""

from __future__ import annotations

import pytest

from tests.hostile import hostile_run

CASES = [
    ("every-step", "owner x-10"),
    ("every-step", "member x-4.9"),
    ("local-steps", "owner x-10"),
    ("local-steps", "owner crafted"),
    ("local-steps", "backbone owner x-10"),
    ("local-steps", "member x-4.9"),
]
_clean: dict[str, dict] = {}


async def clean(tmp_path_factory, mode: str) -> dict:
    if mode not in _clean:
        _clean[mode] = await hostile_run(tmp_path_factory.mktemp(f"clean-{mode}"), "clean", mode, seed=1)
    return _clean[mode]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("mode", "role"), CASES)
async def test_one_hostile_volunteer_in_four_steers_nothing(tmp_path_factory, mode, role):
    base = await clean(tmp_path_factory, mode)
    got = await hostile_run(tmp_path_factory.mktemp("hostile"), role, mode, seed=1)
    story = f"{role} in {mode}: {got}\nclean: {base}"
    assert base["pulls_reported"] == 0 and not base["accused_honest"], story
    assert got["honest_steps"] == base["honest_steps"], story
    assert got["honest_loss"] <= 1.15 * base["honest_loss"], story
    assert not got["accused_honest"], story
    # whoever saw through a forged answer, no honest volunteer applied it (tracker/verdicts.py)
    assert got["honest_identical"], story
    if "owner" in role:
        assert got["refused_answers"] >= 1 and got["hostile_barred"], story
        if role != "owner crafted":  # (a receipt that holds by itself is no proof: accusations bar it)
            assert got["refused_proven"] == got["refused_answers"], story
    else:  # its copies are clipped to the median copy's norm; the owners' receipts show its pull, which bars it
        assert got["hostile_barred"], story
        assert got["pulls_reported"] >= 1 or mode == "every-step", story  # (spot-checks may bar it first)
    assert not got["pulls_of_honest"], story
