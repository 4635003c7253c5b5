"""Churn (issue 47): five volunteers, real ``crowdtrain join`` processes, for 1.75 minutes while one at a
time is frozen (SIGSTOP 5–25 s), SIGKILLed and restarted on its data folder, or leaves (SIGINT) and joins
again, every 20–40 s. Every volunteer back takes a step of its own within 60 s, the run never stands still
for a minute, no process prints a traceback or exits with a code nobody asked for, and no honest volunteer
fails a spot-check.

The soak is ``bench/churn.py``'s; its speeds (steps per minute by third, the tracker's memory) are measured
there, for 12 minutes, not asserted here.
"""

from __future__ import annotations

import pytest

from bench.churn import RECOVERY_S, soak

MINUTES = 1.75
SEED = 1  # (its first three faults, one of each kind, all fit in MINUTES)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_volunteers_frozen_killed_and_leaving_all_step_again_within_a_minute(tmp_path):
    lines: list[str] = []
    # (each process's events and last lines end up in tmp_path / "logs", also when the soak fails)
    report = await soak(
        tmp_path, minutes=MINUTES, volunteers=5, seed=SEED, say=lines.append, logs_to=tmp_path / "logs"
    )
    story = "\n".join([*lines, f"logs: {tmp_path / 'logs'}"])

    # the run went on: never 60 s without a step, steps in every third
    assert report["longest_without_step_s"] < 60.0, "\n".join(
        [
            f"no step for {report['longest_without_step_s']} s from +{report['longest_without_step_at_s']} s;"
            " the volunteers' warnings then:",
            *report["warnings_around_it"],
            story,
        ]
    )
    assert all(x > 0 for x in report["steps_per_min_thirds"]), report["steps_per_min_thirds"]

    # the faults happened: every kind
    back = report["faults"]
    assert {"freeze", "kill", "leave"} <= {b["kind"] for b in back}, story
    # ...and each volunteer back took a step of its own (restarted, rejoined or woken) within RECOVERY_S
    late = [b for b in back if b["first_step_s"] is None or b["first_step_s"] > RECOVERY_S]
    assert not late, "\n".join([*map(str, late), story])

    # no traceback in any process's output, and every process ended as it was told to
    tracebacks = report["tracebacks"]
    assert tracebacks["count"] == 0, "\n".join([tracebacks["first_in"], *tracebacks["first"]])
    assert report["unexpected_exits"] == [], report["unexpected_exits"]
    kills = [e for e in report["exits"] if e["why"] == "killed"]
    assert kills and all(e["code"] == -9 for e in kills), report["exits"]

    # every volunteer is honest: spot-checks ran, and none found a mismatch, by the volunteers' verdicts and
    # by the tracker's credit ledger
    spot = report["spot_checks"]
    assert spot["outcomes"].get("match", 0) > 0, spot
    assert spot["mismatches"] == 0 and spot["tracker_rejected"] == 0, spot
