"""The compute rate a volunteer reports (the tracker shares each step out by it): its own micro-batches'
throughput, where a pause of the process is not taken for the peer's speed (issue 27)."""

from __future__ import annotations

import pytest

from crowdtrain.volunteer.meter import RATE_WINDOW, STALL_FACTOR, Meter


def fed(batches: list[tuple[int, float]]) -> Meter:
    meter, t = Meter(), 100.0
    for samples, seconds in batches:
        meter.start(t)
        meter.computed(samples, 1.0, t, t + seconds)
        t += seconds
    return meter


def test_the_rate_is_the_samples_over_the_compute_seconds_of_the_window():
    assert fed([]).samples_per_s == 0.0
    assert fed([(16, 0.2)] * 4).samples_per_s == pytest.approx(80.0)
    # peers sharing cores compute some micro-batches faster than others: all of them count
    assert fed([(16, 0.2), (16, 0.3), (16, 0.1), (16, 0.2)]).samples_per_s == pytest.approx(64 / 0.8)
    # only the last RATE_WINDOW micro-batches
    assert fed([(16, 1.6)] * 3 + [(16, 0.2)] * RATE_WINDOW).samples_per_s == pytest.approx(80.0)


def test_a_micro_batch_stalled_10x_does_not_lower_the_rate():
    """A volunteer stopped for 1.8 s inside one of its 0.2 s micro-batches (a lid closed, SIGSTOP, another
    program took the machine): with the stall counted its rate would read 36 % lower for the next 16
    micro-batches, and the tracker would allot it less of the next steps while the others wait for it."""
    steady = [(16, 0.2)] * 15
    assert fed([*steady, (16, 2.0)]).samples_per_s == pytest.approx(80.0)
    assert fed([(16, 2.0), *steady, (16, 2.0)][-RATE_WINDOW:]).samples_per_s == pytest.approx(80.0)
    # a slower stretch short of a stall still counts
    slower = STALL_FACTOR * 0.2 * 0.9
    assert fed([*steady, (16, slower)]).samples_per_s == pytest.approx(16 * 16 / (15 * 0.2 + slower))


def test_a_peer_that_became_slower_for_good_reports_its_new_rate():
    """Once most of the window is slow, slow is the peer's rate (a game started and stays): every
    micro-batch counts then."""
    meter = fed([(16, 0.2)] * 7 + [(16, 2.0)] * 9)
    assert meter.samples_per_s == pytest.approx(16 * 16 / (7 * 0.2 + 9 * 2.0))
    # a short last micro-batch (the rest of an allotment) is judged per sample
    assert fed([(16, 0.2)] * 15 + [(4, 0.05)]).samples_per_s == pytest.approx(80.0)
