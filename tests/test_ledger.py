"""The share ledger on its own (issue 26): credit, share cap, allotments by rate, the share a peer may compute
ahead, the re-allotment of a new step, and the invariants kept over any sequence of honest reports (its
tally is the sum over its shares; allotments never sum above the target). No server, no clock: time is an
argument, as in ``tracker/ledger.py`` itself."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crowdtrain.protocol.messages import AveragingSpec, RunSpec
from crowdtrain.tracker.ledger import SAMPLES_SLACK, Ledger, Tally
from tests.sim import make_run_create

MICRO = 8  # micro_batch_size, as in tests/sim.py's runs


def ledger(target: int = 120, *, delay: bool = False, max_peer_share: float = 0.5, step: int = 0) -> Ledger:
    return Ledger("run-test", target, MICRO, max_peer_share, step=step, computes_ahead=bool(delay))


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
    book = Ledger("run-test", target, MICRO, share, computes_ahead=bool(delay))
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


def spared(target: int = 120) -> Ledger:
    """A ledger with the spares rule (a run with delay 0 and one inner step), a, b and c allotted 40 each at
    10 samples/s at t=0."""
    book = Ledger("run-test", target, MICRO, 0.5, spares=True)
    joined(book, "a", "b", "c")
    for name in ("a", "b", "c"):
        assert beat(book, name, 0, 10.0, now=0.0).allotted == 40
    return book


def test_spares_cover_the_rest_of_a_peer_behind_its_time_and_a_covered_peer_that_reports_stops_at_its_samples():
    """Backup workers (issue 27): b reported 8 of its 40 at t=1, so its rest (3.2 s) should end at 4.2; a and
    c are done at t=4 (a step of 4 s). Spares open once a has waited 15 % of its step (t=4.6) and b is past
    its time by 15 % of its rest (t=4.68): a and c are allotted b's 32 once more, by rate. b, alive, reports
    20: it is allotted what it holds (it stops), so the step closes on its target, not 12 above it."""
    book = spared()
    beat(book, "b", 8, 10.0, now=1.0)
    for name in ("a", "c"):
        assert beat(book, name, 40, 10.0, now=4.0).done_at == 4.0
    assert book.open_spares(4.59) == 0  # a has not waited 15 % of its step
    assert book.open_spares(4.67) == 0  # b is not behind by 15 % of its rest yet
    assert book.offered == 0
    assert not book.in_flight("a") and book.in_flight("b")  # a stopped at its share; b computes
    assert book.open_spares(4.7) == 32 and book.offered == 32
    assert not book.in_flight("b")  # covered and silent since: no micro-batch of its is awaited
    assert book.open_spares(4.8) == 0  # (their offers are not taken yet)
    assert [beat(book, n, 40, 10.0, now=4.75).allotted for n in ("a", "c")] == [56, 56]
    assert book.offered == 0 and book.tally.reserved == 152  # above the target: b still holds its 40
    assert beat(book, "b", 20, 10.0, now=4.8).allotted == 20  # covered: it stops at what it holds
    assert book.in_flight("b")  # (it may be in a micro-batch it began before it was cut)
    assert book.tally.reserved == 132
    for name in ("a", "c"):
        assert beat(book, name, 50, 10.0, now=5.8).allotted == 56  # a spare given stands
    assert not book.written_off("b")  # it spoke, and holds samples
    assert_tally_is_the_sum(book)
    assert beat(book, "a", 56, 10.0, now=6.4).samples == 56
    assert beat(book, "c", 44, 10.0, now=6.4).samples == 44
    assert book.tally.samples == 120  # the target, met by whoever computed it


def test_spares_go_to_as_few_peers_done_as_cover_what_the_step_lacks():
    """Regression (issue 27): with 16 volunteers of a micro-batch each, one asleep, every one of the 15 done
    was offered a micro-batch for the one lacking, and computed it: steps of 1.4x the target. The fastest
    peers done are offered a micro-batch or their part, until what the step lacks is covered."""
    book = Ledger("run-test", 64, MICRO, 0.5, spares=True)
    names = [f"p{i}" for i in range(8)]
    joined(book, *names)
    for name in names:
        assert beat(book, name, 0, 10.0, now=0.0).allotted == 8
    for name in names[1:]:  # p0 is asleep with its 8 (due at 0.8); the others are done at 0.8, p7 the fastest
        assert beat(book, name, 8, 11.0 if name == "p7" else 10.0, now=0.8).done_at == 0.8
    assert book.open_spares(1.0) == 8 and book.spares.offered == {"p7": 8}
    assert book.spares.covered == {"p0"}
    assert beat(book, "p7", 8, 11.0, now=1.05).allotted == 16
    assert_tally_is_the_sum(book)


def test_spares_open_again_for_what_the_step_still_lacks_but_not_to_a_peer_that_left_its_offer_untaken():
    book = spared()
    beat(book, "b", 8, 10.0, now=1.0)
    for name in ("a", "c"):
        beat(book, name, 40, 10.0, now=4.0)
    assert book.open_spares(4.7) == 32  # 16 each; c has fallen asleep and never takes its 16
    assert beat(book, "a", 40, 10.0, now=4.75).allotted == 56
    assert book.open_spares(5.5) == 0  # a owes its spare and is on time; c's offer is not taken yet
    assert beat(book, "a", 56, 10.0, now=5.4).done_at == 5.4
    assert book.open_spares(5.9) == 0  # a has not waited 15 % of its step (5.4 s) yet
    # what c left untaken (16), offered to a alone, within its share cap (60): 4
    assert book.open_spares(6.3) == 4
    assert beat(book, "a", 56, 10.0, now=6.4).allotted == 60
    assert book.spares.covered == {"b"}
    assert_tally_is_the_sum(book)


def test_spares_cover_a_peer_behind_while_another_is_on_time_and_a_covered_peer_silent_and_empty_is_written_off():
    """Regression (issue 27, heavy-tail timelines): with one peer asleep (behind) and another still computing
    on time, spares waited for the one on time to finish or fall behind too, and the peers done idled
    meanwhile. Now the rest of the one behind is offered at once; the one on time keeps its share."""
    book = spared()
    assert beat(book, "a", 40, 10.0, now=4.0).done_at == 4.0  # b and c owe 40 each (due at 4.0)
    beat(book, "c", 30, 10.0, now=4.5)  # c is on time: its rest of 10 is due at 5.5
    # b is behind: its 40 (what the step lacks, 50, less c's rest) is offered to a within its cap (60)
    assert book.open_spares(5.0) == 20 and book.spares.offered == {"a": 20}
    assert book.spares.covered == {"b"} and book.share("c").allotted == 40  # c, on time: not cut
    assert book.written_off("b") and not book.written_off("c")  # b holds nothing: its ready brings nothing
    assert book.open_spares(5.7) == 0  # c is behind too now, but a, the only peer done, has its offer
    assert beat(book, "a", 40, 10.0, now=5.8).allotted == 60  # a, the only peer done: up to its share cap
    # b wakes and speaks: it is allotted what the spares left (a's cap took 20 of its 40): the target's rest
    beat(book, "b", 0, 10.0, now=6.0)
    assert not book.written_off("b") and book.share("b").allotted == 20 and book.tally.reserved == 120
    assert_tally_is_the_sum(book)


def test_spares_offer_only_what_the_peers_on_time_will_not_bring():
    """a is done at 4; b reported 8 at t=1, then fell asleep (due at 4.2); c reported 10 at 3.5 and computes on
    (due at 6.5). At 4.7 b is behind: the step lacks 62, of which c still brings 30: b's 32 is offered, to a
    (within its cap, 20). Once a took it, nothing more is offered while c and a are on time."""
    book = spared()
    beat(book, "b", 8, 10.0, now=1.0)
    beat(book, "c", 10, 10.0, now=3.5)
    assert beat(book, "a", 40, 10.0, now=4.0).done_at == 4.0
    assert book.open_spares(4.6) == 0  # b is not behind by 15 % of its rest yet
    assert book.open_spares(4.7) == 20 and book.spares.offered == {"a": 20}
    assert book.spares.covered == {"b"}
    assert beat(book, "a", 40, 10.0, now=4.75).allotted == 60
    assert book.open_spares(5.0) == 0 and book.share("c").allotted == 40
    assert_tally_is_the_sum(book)


def test_spares_go_whole_to_the_peers_with_room_not_to_one_at_its_cap():
    """Regression (issue 27, a 40 s heavy-tail run): spares were split by rate over every peer done, one of
    them at its share cap, so each opening offered the peer with room only its part of what the step lacked,
    in ever thinner micro-batches (23, 13, 7, 4, 2, 1 samples) one after another; and a peer idle at the
    step, allotted nothing, was offered none. Here a holds its cap (60 of 120): c, which came when every
    sample was allotted, is offered all that b's sleep leaves lacking, at once."""
    book = Ledger("run-test", 120, MICRO, 0.5, spares=True)
    joined(book, "a", "b")
    assert [beat(book, n, 0, 10.0, now=0.0).allotted for n in ("a", "b")] == [60, 60]
    book.add("c", 0.5)
    assert beat(book, "c", 0, 10.0, now=0.5).allotted == 0
    beat(book, "b", 8, 10.0, now=1.0)  # then asleep: its rest (52) is due at 6.2
    assert beat(book, "a", 60, 10.0, now=6.0).done_at == 6.0
    assert book.open_spares(6.9) == 0  # b is not behind by 15 % of its rest yet
    assert book.open_spares(7.0) == 52 and book.spares.offered == {"c": 52}
    assert beat(book, "c", 0, 10.0, now=7.05).allotted == 52
    assert_tally_is_the_sum(book)


def test_spares_reach_a_peer_idle_at_the_step_with_nothing_allotted():
    """Regression (issue 27): a peer back from a catch-up mid-step, computing but allotted nothing (every
    sample was allotted), sat idle while the others computed a sleeper's rest as spares. It counts as done
    with the step now (an unknown rate at the mean) and is offered its part, a micro-batch at least."""
    book = spared()
    beat(book, "b", 8, 10.0, now=1.0)  # then asleep: its rest (32) is due at 4.2
    book.add("d", 2.0)
    assert beat(book, "d", 0, 0.0, now=2.0).allotted == 0  # nothing free for it
    for name in ("a", "c"):
        assert beat(book, name, 40, 10.0, now=4.0).done_at == 4.0
    assert book.open_spares(4.7) == 33  # 32 lacking, in three (a, c, d at 10 samples/s): 11 each
    assert book.spares.offered == {"a": 11, "c": 11, "d": 11}
    assert beat(book, "d", 0, 0.0, now=4.75).allotted == 11
    book.remove("c")  # it leaves with its offer untaken: the offer goes with it
    assert book.spares.offered == {"a": 11}
    assert_tally_is_the_sum(book)


def test_a_peer_still_in_its_round_is_not_covered_until_it_says_it_began_its_step():
    """Regression (issue 27): a round held 1.8 s by a member asleep kept its other members from their next
    step; timed from when the round formed, they all looked behind, so spares went to the one peer outside
    the round and cut the others to what they held (a heavy-tail run's tracker log). And a member still
    sending its answers up a home line looked behind in the same way, and was left out (spares taken back,
    2026-11-24). A peer is covered (cut to what it holds) only once it reported at its step (volunteers
    report as they begin one); before, its rest may be offered, but it keeps its share. A heartbeat of the
    step before, sent with nothing of the new one, moves its start to then."""
    book = spared()
    for name in ("a", "b", "c"):
        beat(book, name, 40, 10.0, now=4.0)
    book.advance(["a", "b", "c"], now=4.1)  # the round of step 0 forms; a's and b's parts are held 3.9 s
    for name in ("a", "b"):
        beat(book, name, 0, 10.0, now=4.5, step=0)  # (sent during the round)
    assert book.share("b").step_since == 4.5
    beat(book, "c", 0, 10.0, now=4.2)  # c began at once (it had no part held)
    assert beat(book, "c", 40, 10.0, now=8.2).done_at == 8.2
    # a and b (due at 8.5 from 4.5) have not said they began: their rest is offered to c (within its cap of
    # 60), but they are not covered: they keep their shares
    assert book.open_spares(9.3) == 20 and book.spares.offered == {"c": 20}
    assert book.spares.covered == set()
    for name in ("a", "b"):
        assert beat(book, name, 0, 10.0, now=9.35).allotted == 40  # they begin now, and are not cut
    assert beat(book, "c", 40, 10.0, now=9.4).allotted == 60
    assert_tally_is_the_sum(book)


def test_the_rest_of_a_peer_that_began_late_is_shared_so_everyone_finishes_together():
    """Backup workers (issue 27): b began the step 3 s late (it recomputed another's gradient for a spot-check,
    or came back from a catch-up) and reported 0 at t=3: on time, but due at 7, while a and c were done at 4
    (a step of 4 s) and would idle 3 s. Once a has waited 15 % of its step (t=4.6), b's rest (40, less the 16
    it computed since t=3 at 10 samples/s) is shared by rate: 8 each for a and c, and b is trimmed to the 24
    it has by then, so all three finish at 5.4 and the allotments sum to the target. One due soon (within a
    quarter of the others' step) keeps its share."""
    book = spared()
    beat(book, "b", 0, 10.0, now=3.0)
    for name in ("a", "c"):
        assert beat(book, name, 40, 10.0, now=4.0).done_at == 4.0
    assert book.open_spares(4.55) == 0  # a has not waited 15 % of its step
    assert book.open_spares(4.61) == 16  # moved at once (not offered): each hears it at its report
    assert [book.share(n).allotted for n in ("a", "b", "c")] == [48, 24, 48]
    assert book.spares.covered == set()  # b, on time: trimmed, not cut to what it holds
    assert book.tally.reserved == book.target
    assert book.offered == 16  # (what a and c were given, announced on the step watch until they report)
    assert beat(book, "b", 16, 10.0, now=4.65).allotted == 24
    assert [beat(book, n, 40, 10.0, now=4.7).allotted for n in ("a", "c")] == [48, 48]
    assert book.offered == 0
    assert beat(book, "b", 24, 10.0, now=5.4).done_at == 5.4
    assert beat(book, "b", 24, 10.0, now=5.5).allotted == 24  # (its trim stands once reached)
    assert book.spares.trim("b", 20) == 24
    book.spares.covered.add(
        "b"
    )  # (had it fallen behind later, spares covering it: it stops at what it holds)
    assert book.spares.trim("b", 20) is None
    assert_tally_is_the_sum(book)

    soon = spared()
    beat(soon, "b", 30, 10.0, now=4.0)  # its rest of 10 is due at 5.0: 0.4 s after 4.61, under 1 s
    for name in ("a", "c"):
        beat(soon, name, 40, 10.0, now=4.0)
    assert soon.open_spares(4.61) == 0 and soon.share("b").allotted == 40


def test_no_spares_with_delay_1_or_local_steps_or_without_a_peer_done():
    book = spared()
    assert book.open_spares(100.0) == 0  # nobody is done: nobody to give them to
    create = make_run_create(target_batch_size=120)
    fields = {f: getattr(create, f) for f in ("name", "model", "dataset", "target_batch_size")}
    spec = RunSpec(run_id="run-test", tracker_public_key="00" * 32, **fields)
    assert Ledger.of(spec, 0).with_spares
    for averaging in (AveragingSpec(delay=1), AveragingSpec(inner_steps=4)):
        assert not Ledger.of(msgspec.structs.replace(spec, averaging=averaging), 0).with_spares


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
