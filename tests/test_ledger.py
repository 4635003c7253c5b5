"""The share ledger on its own (issue 26): credit, share cap, allotments by rate, the share a peer may compute
ahead, the re-allotment of a new step, and the invariants kept over any sequence of honest reports (its
tally is the sum over its shares; allotments never sum above the target). No server, no clock: time is an
argument, as in ``tracker/ledger.py`` itself."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crowdtrain.tracker.ledger import SAMPLES_SLACK, Ledger, Tally

MICRO = 8  # micro_batch_size, as in tests/sim.py's runs


def ledger(target: int = 120, *, delay: bool = False, max_peer_share: float = 0.5, step: int = 0) -> Ledger:
    return Ledger("run-test", target, MICRO, max_peer_share, step=step, delay=delay)


def joined(book: Ledger, *names: str, now: float = 0.0) -> None:
    for name in names:
        book.add(name, now)


def beat(book: Ledger, name: str, samples: int, rate: float = 1e6, *, computing: bool = True, now: float = 1.0,
         step: int | None = None, step_open: bool = True):  # fmt: skip
    return book.report(
        name,
        step=book.step if step is None else step,
        samples=samples,
        samples_per_s=rate,
        computing=computing,
        now=now,
        step_open=step_open,
    )


def assert_tally_is_the_sum(book: Ledger) -> None:
    kept, summed = book.tally, book.recount()
    for name in Tally.__slots__:
        a, b = getattr(kept, name), getattr(summed, name)
        if isinstance(a, float):
            assert math.isclose(a, b, abs_tol=1e-6), (name, a, b)
        else:
            assert a == b, (name, a, b)


# ------------------------------------------------------------ allotments


def test_what_is_left_of_the_step_is_shared_by_rate_and_the_allotments_sum_to_the_target():
    book = ledger(120, max_peer_share=1.0)
    joined(book, "a", "b", "c")
    for name, rate in (("a", 10.0), ("b", 20.0), ("c", 30.0)):
        beat(book, name, 0, rate, step_open=False)  # rates known, nothing allotted yet
    assert book.tally.reserved == 0
    # each heartbeat allots the one that sent it its share by rate: a's is 120 × 10/60
    assert [beat(book, n, 0, r).allotted for n, r in (("a", 10.0), ("b", 20.0), ("c", 30.0))] == [20, 40, 60]
    assert book.tally.reserved == 120
    assert_tally_is_the_sum(book)


def test_an_allotment_stands_and_bounds_what_the_peers_after_it_are_allotted():
    book = ledger(120, max_peer_share=1.0)
    joined(book, "a", "b", "c")
    # a reports first, while b's and c's rates are unknown (counted at the mean, its own): a third
    assert beat(book, "a", 0, 10.0).allotted == 40
    assert beat(book, "b", 0, 20.0).allotted == math.ceil(120 * 20 / 45)  # c still counted at the mean
    assert beat(book, "c", 0, 30.0).allotted == 120 - 40 - 54  # what the others were not allotted
    assert beat(book, "a", 0, 10.0).allotted == 40  # never cut back, though its share by rate is 20 now
    assert book.tally.reserved == 120


def test_an_allotment_is_never_below_what_the_peer_holds_and_none_while_the_step_is_closed():
    book = ledger(100, max_peer_share=1.0)
    joined(book, "a", "b")
    beat(book, "a", 0, 10.0)
    assert beat(book, "b", 0, 10.0).allotted == 50
    assert beat(book, "a", 30, 10.0).allotted >= 30
    assert book.allotment("a", step_open=True) == book.share("a").allotted
    share = beat(book, "a", 30, 10.0, step_open=False)  # the step closed: nothing more to compute for it
    assert share.allotted == 0 and book.allotment("a", step_open=False) is None
    assert book.tally.samples == 30  # what it holds still counts toward the step


def test_a_peer_that_computes_nothing_is_allotted_what_it_holds():
    book = ledger(100)
    joined(book, "a", "b")
    beat(book, "b", 0, 10.0)
    assert beat(book, "a", 0, 0.0, computing=False).allotted == 0  # downloading: nothing for it
    assert beat(book, "a", 20, 10.0, computing=False).allotted == 20  # done with what it holds


def test_a_peer_of_unknown_rate_is_counted_at_the_mean():
    book = ledger(90, max_peer_share=1.0)
    joined(book, "a", "b", "c")
    for name, rate in (("a", 10.0), ("b", 20.0), ("c", 0.0)):  # c: a chunk, no rate yet (counted at 15/s)
        beat(book, name, 0, rate, step_open=False)
    assert beat(book, "a", 0, 10.0).allotted == 90 * 10 // 45


def test_no_peer_is_allotted_more_than_its_share_cap_while_others_take_part():
    book = ledger(100, max_peer_share=0.5)
    joined(book, "fast", "slow")
    beat(book, "slow", 0, 1.0)
    assert beat(book, "fast", 0, 1000.0).allotted == 50
    assert book.share_cap(others=True) == 50 and book.share_cap(others=False) == 100


# ------------------------------------------------------------ credit


def test_a_claim_is_credited_only_as_the_rate_allows_and_at_most_the_share_cap():
    book = ledger(1000)
    joined(book, "honest", "liar", now=0.0)
    beat(book, "honest", 0, 10.0, now=0.0, step_open=False)
    beat(book, "liar", 0, 1.0, now=0.0, step_open=False)  # (nothing allotted: no grant to credit)
    # ten seconds at one sample a second: SAMPLES_SLACK × 1 × 10 plus two micro-batches, no more
    share = beat(book, "liar", 10**9, 1.0, now=10.0, step_open=False)
    assert share.samples == math.ceil(SAMPLES_SLACK * 1.0 * 10.0 + 2 * MICRO) == 56 and share.capped
    # a rate as large as the lie: credited, but only up to its share cap while another peer takes part
    assert beat(book, "liar", 10**9, 1e12, now=11.0).samples == book.share_cap(others=True) == 500
    assert_tally_is_the_sum(book)


def test_what_was_allotted_is_always_credited():
    book = ledger(100, max_peer_share=1.0)
    joined(book, "a", now=0.0)
    allotted = beat(book, "a", 0, 0.001, now=0.0).allotted  # alone: the whole step, whatever its rate
    assert allotted == 100
    assert beat(book, "a", 100, 0.001, now=0.1).samples == 100


def test_a_heartbeat_for_the_step_before_neither_moves_the_peer_back_nor_frees_its_allotment():
    book = ledger(100, max_peer_share=1.0, step=1)
    joined(book, "a", "b")
    beat(book, "a", 10, 10.0)
    allotted = beat(book, "b", 0, 10.0).allotted
    before = book.share("b").allotted, book.share("b").samples, book.tally.computing
    share = beat(book, "b", 50, 10.0, computing=False, step=0)  # sent before it heard of step 1
    assert share.step == 1 and (share.allotted, share.samples, book.tally.computing) == before
    assert share.allotted == allotted


def test_a_ready_weight_is_credited_as_a_heartbeats_samples_and_samples_ahead_within_the_peers_share():
    book = ledger(20)
    joined(book, "liar", now=0.0)
    beat(book, "liar", 1, 1.0, now=0.0)
    assert book.credit_ready("liar", 0, 10**12, 10**6, now=5.0) <= 1 + 2 * MICRO + 4 * 5
    assert book.credit_ready("nobody", 0, 10, 0, now=5.0) == 0  # not (or no longer) registered


# ------------------------------------------------------------ computing ahead (delay 1)


def test_the_share_a_peer_may_compute_ahead_is_its_rate_share_with_room_for_peers_of_unknown_rate():
    book = ledger(120, delay=True)
    joined(book, "a", "b", "c", "d")
    beat(book, "d", 0, 0.0, computing=False)  # downloading: no room kept for it
    beat(book, "b", 0, 10.0)
    beat(book, "c", 0, 20.0)
    assert beat(book, "a", 10, 10.0, computing=False).ahead_share == 120 * 10 // 40
    beat(book, "d", 0, 0.0)  # has a chunk now, rate unknown: counted at the mean
    assert beat(book, "a", 10, 10.0, computing=False).ahead_share == 120 * 10 * 3 // (40 * 4)
    assert beat(book, "c", 0, 20.0).ahead_share == 120 * 20 * 3 // (40 * 4)
    nodelay = ledger(120)
    joined(nodelay, "a")
    assert beat(nodelay, "a", 0, 10.0).ahead_share is None


def test_a_new_step_allots_what_is_left_by_rate_on_top_of_what_each_computed_ahead():
    book = ledger(120, delay=True)
    joined(book, "a", "b", "c")
    for name in "abc":
        beat(book, name, 0, 10.0)
    for name in "abc":
        beat(book, name, 40, 10.0, computing=False)
    for name, ahead in (("a", 12), ("b", 0), ("c", 0)):
        assert book.credit_ready(name, 0, 40, ahead, now=2.0) == 40
    book.advance(["a", "b", "c"], now=2.0)
    assert book.step == 1
    shares = [book.share(n) for n in "abc"]
    assert [s.samples for s in shares] == [12, 0, 0]
    # 108 left, a third each by rate on top of what each holds (a's 12 are step 1's already)
    assert [s.allotted for s in shares] == [12 + 36, 36, 36]
    assert [book.next_allotment(n, 0) for n in "abc"] == [48, 36, 36]
    assert book.next_allotment("a", 1) is None  # (a ready reply of another step carries none)
    assert_tally_is_the_sum(book)


def test_a_peer_computing_ahead_is_allotted_what_it_may_have_computed_since_its_ready_call():
    book = ledger(96, delay=True)
    joined(book, "a", "b", "c")
    for name in "abc":
        beat(book, name, 0)
    for name in "abc":
        assert beat(book, name, 32, computing=False).ahead_share == 32
    book.credit_ready("a", 0, 32, 0, now=1.0)
    book.credit_ready("b", 0, 32, 0, now=1.0)
    book.credit_ready("c", 0, 32, 24, now=1.0)
    book.advance(["a", "b", "c"], now=1.5)
    assert [book.share(n).allotted for n in "abc"] == [32, 32, 32]
    assert book.tally.reserved == 96


def test_what_no_share_took_goes_to_the_first_peers_below_their_cap():
    book = ledger(100, max_peer_share=1.0, delay=True)
    joined(book, "a", "b")
    for name in "ab":
        beat(book, name, 0, 10.0)
    beat(book, "a", 50, 10.0, computing=False)
    beat(book, "b", 50, 10.0, computing=False)
    book.credit_ready("a", 0, 50, 10, now=2.0)
    book.credit_ready("b", 0, 50, 0, now=2.0)
    book.advance(["a", "b"], now=2.0)
    assert (book.share("a").allotted, book.share("b").allotted) == (10 + 45, 45)
    assert book.tally.reserved == 100


def test_a_reopened_step_forgets_what_its_ready_calls_said_was_computed_ahead():
    book = ledger(100, delay=True)
    joined(book, "a", "b")
    beat(book, "a", 0, 10.0)
    beat(book, "a", 40, 10.0, computing=False)
    book.credit_ready("a", 0, 40, 20, now=1.0)
    book.reopen()
    book.advance(["a"], now=2.0)
    assert book.share("a").samples == 0


def test_eta_is_what_is_left_over_the_run_rate():
    book = ledger(100)
    joined(book, "a", "b")
    assert book.eta_s(step_open=True) is None  # no rate yet
    beat(book, "a", 20, 10.0)
    beat(book, "b", 20, 30.0)
    assert book.eta_s(step_open=True) == pytest.approx(60 / 40)
    assert book.eta_s(step_open=False) == 0.0
    book.remove("a")
    book.remove("b")
    assert book.tally.rate_sum == 0.0 and book.eta_s(step_open=True) is None  # no float dust left


# ------------------------------------------------------------ invariants


NAMES = ("a", "b", "c", "d", "e")
beat_op = st.tuples(
    st.just("beat"),
    st.sampled_from(NAMES),
    st.floats(0.0, 1.0),  # fraction of what is left of its allotment it computed since
    st.sampled_from([0.0, 1.0, 5.0, 20.0, 1e6]),
    st.booleans(),
)
op = st.one_of(
    beat_op,
    beat_op,
    beat_op,
    st.tuples(st.just("join"), st.sampled_from(NAMES)),
    st.tuples(st.just("leave"), st.sampled_from(NAMES)),
    st.tuples(st.just("close")),
    st.tuples(st.just("form"), st.floats(0.0, 1.0)),  # how much of its ahead share each ready peer computed
    st.tuples(st.just("reopen")),
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=20, max_size=80),
    target=st.integers(1, 300),
    share=st.sampled_from([0.25, 0.5, 1.0]),
    delay=st.booleans(),
)
def test_honest_peers_never_get_allotments_above_the_target_and_the_tally_stays_the_sum(
    ops, target, share, delay
):
    """Any sequence of joins, leaves, honest heartbeats (samples within the allotment; a peer new to the
    step claims none), closes, rounds formed (ready calls with samples ahead within the ahead share) and
    reopens: the kept tally equals the sum over the shares, and the peers at the step are never allotted
    more than the target between them (nor more than they hold, once what they hold is above it)."""
    book = Ledger("run-test", target, MICRO, share, delay=delay)
    joined(book, *NAMES)
    now, closed = 0.0, False
    for o in ops:
        now += 0.5
        name = o[1] if len(o) > 1 and isinstance(o[1], str) else None
        s = book.share(name) if name else None
        if o[0] == "join" and s is None:
            book.add(name, now)
        elif o[0] == "leave" and s is not None:
            book.remove(name)
        elif o[0] == "beat" and s is not None:
            _, _, part, rate, computing = o
            claim = s.samples + int(part * max(0, s.allotted - s.samples)) if s.step == book.step else 0
            beat(book, name, claim, rate, computing=computing, now=now, step_open=not closed)
        elif o[0] == "close" and not closed and book.tally.contributors:
            closed = True
        elif o[0] == "form" and closed:  # every peer at the step is ready
            ready = [n for n in NAMES if (x := book.share(n)) is not None and x.step == book.step]
            for n in ready:
                x = book.share(n)
                ahead = int(o[1] * (x.ahead_share or 0)) if delay and not x.computing else 0
                book.credit_ready(n, book.step, x.samples, ahead, now)
            book.advance(ready, now + 0.1)
            closed = False
        elif o[0] == "reopen" and closed:
            book.reopen()
            closed = False
        assert_tally_is_the_sum(book)
        assert book.tally.reserved <= max(target, book.tally.samples)
        at_step = [x for x in (book.share(n) for n in NAMES) if x is not None and x.step == book.step]
        assert sum(max(x.allotted, x.samples) for x in at_step) == book.tally.reserved


def test_a_peer_is_late_once_the_others_waited_half_their_step_and_it_is_past_one_and_a_half_its_own():
    """Backup workers (issue 27): a and c finish at t=4 (a step of 4 s); b reported 8 of its 40 at t=1 at 10
    samples/s, so its rest should take 3.2 s. The others have waited long enough at t=6 (half their step); b is
    late from t = 1 + 1.5 × 3.2 + 0.5 = 6.3, not before."""
    book = ledger(120)
    joined(book, "a", "b", "c")
    for name in ("a", "b", "c"):
        beat(book, name, 0, 10.0, now=0.0)
    assert beat(book, "b", 8, 10.0, now=1.0).allotted == 40
    assert book.overdue(5.0) == []  # nobody is done yet: no one to compare with
    for name in ("a", "c"):
        assert beat(book, name, 40, 10.0, now=4.0).done_at == 4.0
    assert book.overdue(5.9) == []  # the others have not waited half their step
    assert book.overdue(6.29) == []  # b is not past 1.5 × its own time yet
    assert book.overdue(6.3) == ["b"]
    beat(book, "b", 20, 10.0, now=6.4)  # it spoke: its rest (2 s) is timed from now
    assert book.overdue(6.5) == [] and book.overdue(6.4 + 1.5 * 2.0 + 0.5) == ["b"]


def test_a_peer_done_is_not_done_once_allotted_more_and_a_revoked_one_is_written_off_only_while_silent_and_empty():
    book = ledger(120)
    joined(book, "a", "b", "c")
    for name in ("a", "b", "c"):
        beat(book, name, 0, 10.0, now=0.0)
    assert beat(book, "a", 40, 10.0, now=4.0).done_at == 4.0
    assert book.revoke("b") == 40  # b computed nothing of it: freed, written off
    assert book.written_off("b") and not book.written_off("a")
    share = beat(book, "a", 40, 10.0, now=4.5)  # a is allotted a share of what b freed: it owes samples again
    assert share.allotted > 40 and share.done_at == -1.0
    beat(book, "b", 0, 10.0, now=5.0)  # b speaks: it is waited for again
    assert not book.written_off("b")
    book.revoke("c")
    assert book.written_off("c")
    book.advance(["a", "b", "c"], 6.0)  # a new step: nobody is written off
    assert not any(book.written_off(name) for name in ("a", "b", "c"))
