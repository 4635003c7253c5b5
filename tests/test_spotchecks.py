"""Spot-checks in a real run (issue 29): a volunteer whose well-formed gradients are computed on other data
than the samples it names is caught by other volunteers recomputing them, barred, and its weight goes to 0;
honest volunteers are verified and never rejected. A real tracker, a real seeder, real peer servers (one
process, so every volunteer is "this machine": an accuser is a checker's key, tracker/spotchecks.py)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random

import msgspec
import numpy as np
import pytest

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import TrackerError
from crowdtrain.protocol.messages import AveragingSpec, GroupAssignment, GroupMember, SpotCheckVerdict
from crowdtrain.tracker.peers import Peer, Share
from crowdtrain.tracker.spotchecks import KEEP_STEPS, REJECTIONS_TO_BAR, SpotChecks, VerdictRefused
from crowdtrain.tracker.store import Store
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.engine import Volunteer
from tests.harness import published_run

STEPS = 14
GROUP = 4


class OtherData(Volunteer):
    """Names the run's samples it drew, but computes its gradients on other tokens (the same shapes, so every
    copy it sends is well-formed, finite and of a plausible norm)."""

    def __init__(self, config: VolunteerConfig, emit: ev.Emit) -> None:
        def event(e: ev.Event) -> None:
            if isinstance(e, ev.Joined):
                self._arm()
            emit(e)

        super().__init__(config, emit=event)

    def _arm(self) -> None:
        assert self._run is not None
        trainer = self._run.trainer
        accumulate = trainer.accumulate
        rng = np.random.default_rng(5)

        def elsewhere(x, y):
            other = rng.integers(0, 256, size=(x.shape[0], x.shape[1] + 1), dtype=np.int64)
            return accumulate(other[:, :-1], other[:, 1:])

        trainer.accumulate = elsewhere


def config(run, tmp_path, name: str, seed: int, max_steps: int | None = STEPS) -> VolunteerConfig:
    return VolunteerConfig(
        run_id=run.spec.run_id,
        tracker_url=run.tracker.url,
        data_dir=tmp_path / name,
        seed=seed,
        max_steps=max_steps,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_volunteer_computing_on_other_data_is_caught_barred_and_honest_ones_are_verified(
    tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="crowdtrain.tracker.spotchecks")
    async with published_run(
        tmp_path, averaging={"codec": "int8", "group_size": GROUP, "spot_checks": 1.0}, target_batch_size=64
    ) as run:
        logs: dict[str, list[ev.Event]] = {}
        honest = []
        for i in range(GROUP - 1):
            logs[f"honest-{i}"] = []
            honest.append(
                Volunteer(config(run, tmp_path, f"honest-{i}", 100 + i), emit=logs[f"honest-{i}"].append)
            )
        logs["hostile"] = []
        hostile = OtherData(config(run, tmp_path, "hostile", 7, max_steps=None), emit=logs["hostile"].append)
        results = await asyncio.wait_for(
            asyncio.gather(*(v.run() for v in honest), hostile.run(), return_exceptions=True), 280
        )
        for r in results:
            assert not isinstance(r, BaseException), repr(r)
        async with TrackerClient(run.tracker.url) as client:
            status = await client.status(run.spec.run_id)

        # the hostile was barred: it left on the tracker's sentence, long before the honest ones' last step
        barred = results[-1]
        assert "spot-checks" in (barred.ended or ""), barred.ended
        # its last event says it left on that sentence (not "run closed")
        last = logs["hostile"][-1]
        assert isinstance(last, ev.Left) and last.reason == barred.ended, last
        assert barred.steps_done < STEPS - 2, barred.steps_done
        # and its key cannot come back: a new join with its data folder's key is refused with the sentence
        again = OtherData(config(run, tmp_path, "hostile", 7), emit=lambda e: None)
        with pytest.raises(TrackerError, match="spot-checks"):
            await asyncio.wait_for(again.run(), 60)

    credits = {c.public_key: c for c in status.credits}
    keys = {name: v._me.key.public_hex for name, v in zip(logs, [*honest, hostile], strict=True)}
    bad = credits[keys["hostile"]]
    assert bad.rejected >= REJECTIONS_TO_BAR, bad
    assert "spot-checks" in bad.barred, bad  # `status` and the page show the bar, with why
    # the tracker wrote a line with the evidence: the key, its rejections, its passed checks, its accusers
    lines = [r.getMessage() for r in caplog.records if "barred" in r.getMessage()]
    assert any(keys["hostile"] in m and " rejections " in m and "accused from" in m for m in lines), lines
    assert bad.verified == 0, bad  # its gradients never matched the samples it named
    for name in ("honest-0", "honest-1", "honest-2"):
        mine = credits[keys[name]]
        assert mine.rejected == 0, (name, mine)  # never flagged
    assert sum(credits[keys[n]].verified for n in ("honest-0", "honest-1", "honest-2")) >= 2
    # after it was barred its weight is 0: no later step credited it, and the honest ones went on to the end
    last = max(s.step for s in status.recent_steps)
    assert bad.last_step < last - 1, (bad, last)
    assert all(r.steps_done == STEPS for r in results[:-1]), [r.steps_done for r in results]
    # the checkers said so in their logs, with the figures behind each verdict
    found = [
        e
        for name in logs
        if name != "hostile"
        for e in logs[name]
        if isinstance(e, ev.LogLine) and "spot-check" in e.message and "mismatch" in e.message
    ]
    assert len(found) >= REJECTIONS_TO_BAR, found


class Silent(Volunteer):
    """Computes honestly but never gives its samples to a checker (its spot-check route answers 404)."""

    def __init__(self, config: VolunteerConfig, emit: ev.Emit) -> None:
        def event(e: ev.Event) -> None:
            if isinstance(e, ev.Joined):
                assert self._run is not None
                self._run.averager.samples.answer = lambda step: None
            emit(e)

        super().__init__(config, emit=event)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_volunteer_that_never_gives_its_samples_is_barred_after_unanswered_checks(tmp_path):
    async with published_run(
        tmp_path, averaging={"codec": "int8", "group_size": GROUP, "spot_checks": 1.0}, target_batch_size=64
    ) as run:
        steps = 24
        honest = [
            Volunteer(config(run, tmp_path, f"honest-{i}", 100 + i, max_steps=steps), emit=lambda e: None)
            for i in range(GROUP - 1)
        ]
        silent = Silent(config(run, tmp_path, "silent", 7, max_steps=None), emit=lambda e: None)
        results = await asyncio.wait_for(
            asyncio.gather(*(v.run() for v in honest), silent.run(), return_exceptions=True), 280
        )
        for r in results:
            assert not isinstance(r, BaseException), repr(r)
        async with TrackerClient(run.tracker.url) as client:
            status = await client.status(run.spec.run_id)
    # 3 unanswered checks in a row count as one rejection: barred at the second, from another accuser
    assert "spot-checks" in (results[-1].ended or ""), results[-1]
    credits = {c.public_key: c for c in status.credits}
    bad = credits[silent._me.key.public_hex]
    assert (bad.verified, bad.rejected) == (0, REJECTIONS_TO_BAR), bad
    assert all(credits[v._me.key.public_hex].rejected == 0 for v in honest)
    assert all(r.steps_done == steps for r in results[:-1]), [r.steps_done for r in results]


# ---------------------------------------------------------------------------------------------- the rules


def rules(tmp_path, **averaging) -> SpotChecks:
    from tests.test_store_conformance import spec

    run = spec()
    run = msgspec.structs.replace(
        run, averaging=AveragingSpec(**{"spot_checks": 1.0, "codec": "int8", **averaging})
    )
    store = Store(str(tmp_path / "tracker.sqlite3"))
    return SpotChecks(run, store, rng=random.Random(3))


def group(*members: tuple[str, int, bool]) -> tuple[dict[str, list[GroupAssignment]], dict[str, Peer]]:
    """(peer id, weight, owns a part) → one phase-0 group and its peers (key = the id repeated)."""
    listed, part = [], 0
    for pid, weight, owner in members:
        address = f"10.0.0.{len(listed) + 1}:9000" if owner else None
        listed.append(
            GroupMember(
                peer_id=pid, address=address, public_key=pid * 4, weight=weight, part=part if owner else -1
            )
        )
        part += owner
    a = GroupAssignment(
        run_id="r", round_id="g0", step=0, members=listed, parts=part, average_params=False, deadline=0.0,
        seed=0, signature="",
    )  # fmt: skip
    peers = {pid: Peer(peer_id=pid, public_key=pid * 4, share=Share()) for pid, _, _ in members}
    return {pid: [a] for pid, _, _ in members}, peers


def drawn(checks: SpotChecks, step: int, ids) -> tuple[str, str]:
    [(checker, check)] = [(c, x) for c in ids if (x := checks.of(step, c)) is not None]
    return check.suspect, checker


def test_the_suspect_is_a_weighted_member_with_an_address_checked_by_another_owner(tmp_path):
    checks = rules(tmp_path)
    ids = ["a" * 16, "b" * 16, "c" * 16, "d" * 16]
    assignments, peers = group((ids[0], 8, True), (ids[1], 0, True), (ids[2], 8, False), (ids[3], 8, True))
    for step in range(20):
        checks.draw(step, assignments, peers, {})
        suspect, checker = drawn(checks, step, ids)
        # b computed nothing, c is in client mode (no address to ask): neither is a suspect
        assert suspect in (ids[0], ids[3]) and checker != suspect and checker != ids[2]
    # where nothing can be checked (one owner, and it is the only weighted member), nothing is drawn
    alone, alone_peers = group((ids[0], 8, True), (ids[2], 8, False))
    checks.draw(99, alone, alone_peers, {})
    assert checks.of(99, ids[0]) is None and checks.of(99, ids[2]) is None


def test_two_accusers_bar_a_key_one_accuser_twice_does_not_and_the_bar_survives_a_restart(tmp_path):
    checks = rules(tmp_path)
    ids = ["a" * 16, "b" * 16, "c" * 16]
    assignments, peers = group(*((pid, 8, True) for pid in ids))
    checks.draw(0, assignments, peers, {})
    suspect, checker = drawn(checks, 0, ids)
    key = suspect * 4

    def say(step: int, checker: str, outcome: str, accuser: str) -> str | None:
        msg = SpotCheckVerdict(peer_id=checker, step=step, suspect=suspect, outcome=outcome)
        return checks.verdict(msg, checker * 4, accuser, "conformance-abc123")

    with pytest.raises(VerdictRefused, match="was not drawn"):  # only the drawn checker is heard
        say(0, next(p for p in ids if p not in (suspect, checker)), "mismatch", "elsewhere")
    first = f"key {checker * 4}"  # (an accuser on this machine is its key; elsewhere its address)
    assert say(0, checker, "mismatch", first) is None  # one rejection: not barred
    with pytest.raises(VerdictRefused):  # a verdict is taken once
        say(0, checker, "mismatch", first)
    # the rejected suspect is checked first from now on, by an owner that has not accused it
    checks.draw(1, assignments, peers, {})
    again, second = drawn(checks, 1, ids)
    assert again == suspect and second != checker
    assert checks.refusal(key) is None
    assert say(1, second, "mismatch", first) is None  # an accuser already counted: still one rejection
    checks.draw(2, assignments, peers, {})
    again, third = drawn(checks, 2, ids)
    assert again == suspect
    assert say(2, third, "mismatch", "host-2") == key  # a second accuser bars the key
    assert "spot-checks" in (checks.refusal(key) or "")
    restarted = SpotChecks(checks.spec, checks.store)
    assert restarted.refusal(key) is not None and restarted.refusal(checker * 4) is None
    [credit] = [c for c in checks.store.credits(checks.spec.run_id) if c.public_key == key]
    assert (credit.verified, credit.rejected) == (0, 2)  # (the first accuser's second word was not)


def test_a_match_verifies_and_unverifiable_counts_for_nothing(tmp_path):
    checks = rules(tmp_path)
    ids = ["a" * 16, "b" * 16]
    assignments, peers = group(*((pid, 8, True) for pid in ids))
    outcomes = ["match", "unverifiable", "match"]
    for step, outcome in enumerate(outcomes):
        checks.draw(step, assignments, peers, {})
        suspect, checker = drawn(checks, step, ids)
        msg = SpotCheckVerdict(peer_id=checker, step=step, suspect=suspect, outcome=outcome)
        assert checks.verdict(msg, checker * 4, checker, "conformance-abc123") is None
    by_key = {c.public_key: (c.verified, c.rejected) for c in checks.store.credits(checks.spec.run_id)}
    assert sum(v for v, _ in by_key.values()) == 2 and all(r == 0 for _, r in by_key.values())


@pytest.mark.parametrize(
    "averaging",
    [{"inner_steps": 10}, {"delay": 1}, {"codec": "sparse"}, {"codec": "int2"}, {"spot_checks": 0.0}],
)
def test_no_check_is_drawn_where_a_gradient_cannot_be_recomputed_or_checks_are_off(tmp_path, averaging):
    checks = rules(tmp_path, **averaging)
    ids = ["a" * 16, "b" * 16]
    assignments, peers = group(*((pid, 8, True) for pid in ids))
    checks.draw(0, assignments, peers, {})
    assert all(checks.of(0, pid) is None for pid in ids)


def test_unanswered_checks_in_a_row_count_as_one_rejection_and_a_match_resets_them(tmp_path):
    checks = rules(tmp_path)
    ids = ["a" * 16, "b" * 16, "c" * 16]
    assignments, peers = group(*((pid, 8, True) for pid in ids))
    said: list[tuple[str, str | None]] = []

    def check(step: int, outcome: str) -> str:
        checks.draw(step, assignments, peers, {})
        suspect, checker = drawn(checks, step, ids)
        msg = SpotCheckVerdict(peer_id=checker, step=step, suspect=suspect, outcome=outcome)
        said.append((suspect, checks.verdict(msg, checker * 4, f"key {checker * 4}", "conformance-abc123")))
        return suspect

    first = check(0, "unanswered")
    # it is a suspect first from now on; two more unanswered in a row make one rejection
    assert check(1, "unanswered") == first and check(2, "unanswered") == first
    rejected = {c.public_key: c.rejected for c in checks.store.credits(checks.spec.run_id)}
    assert rejected == {first * 4: 1}
    # a match between unanswered ones starts the count again
    assert check(3, "unanswered") == first and check(4, "match") == first
    check(5, "unanswered")
    check(6, "unanswered")
    rejected = {c.public_key: c.rejected for c in checks.store.credits(checks.spec.run_id)}
    assert rejected[first * 4] == 1 and all(barred is None for _, barred in said)


def test_rejections_that_are_a_small_share_of_a_key_s_checks_do_not_bar_it(tmp_path):
    checks = rules(tmp_path)
    ids = ["a" * 16, "b" * 16, "c" * 16]
    assignments, peers = group(*((pid, 8, True) for pid in ids))
    outcomes: dict[str, list[str]] = {pid: [] for pid in ids}
    step = 0
    # every key is checked until one has 20 matches; then that key's copies fail twice, from two accusers
    while not any(o.count("match") >= 20 for o in outcomes.values()):
        checks.draw(step, assignments, peers, {})
        suspect, checker = drawn(checks, step, ids)
        msg = SpotCheckVerdict(peer_id=checker, step=step, suspect=suspect, outcome="match")
        checks.verdict(msg, checker * 4, f"key {checker * 4}", "conformance-abc123")
        outcomes[suspect].append("match")
        step += 1
    [honest] = [pid for pid, o in outcomes.items() if o.count("match") >= 20]
    barred = []
    for accuser in ("host-1", "host-2"):
        while True:  # (the next check drawn of that key)
            checks.draw(step, assignments, peers, {})
            suspect, checker = drawn(checks, step, ids)
            step += 1
            if suspect == honest:
                break
            msg = SpotCheckVerdict(peer_id=checker, step=step - 1, suspect=suspect, outcome="match")
            checks.verdict(msg, checker * 4, f"key {checker * 4}", "conformance-abc123")
        msg = SpotCheckVerdict(peer_id=checker, step=step - 1, suspect=honest, outcome="mismatch")
        barred.append(checks.verdict(msg, checker * 4, accuser, "conformance-abc123"))
    assert barred == [None, None] and checks.refusal(honest * 4) is None  # 2 of 22 checks: under 10 %
    [credit] = [c for c in checks.store.credits(checks.spec.run_id) if c.public_key == honest * 4]
    assert (credit.verified, credit.rejected) == (20, 2)


def test_a_verdict_comes_within_eight_steps_of_its_draw_or_is_refused(tmp_path):
    checks = rules(tmp_path)
    ids = ["a" * 16, "b" * 16]
    assignments, peers = group(*((pid, 8, True) for pid in ids))
    checks.draw(0, assignments, peers, {})
    suspect, checker = drawn(checks, 0, ids)
    for step in range(1, KEEP_STEPS + 1):
        checks.draw(step, assignments, peers, {})
    assert checks.of(0, checker) is None  # forgotten: its verdict is refused
    msg = SpotCheckVerdict(peer_id=checker, step=0, suspect=suspect, outcome="mismatch")
    with pytest.raises(VerdictRefused):
        checks.verdict(msg, checker * 4, "host-1", "conformance-abc123")
    late, late_checker = drawn(checks, KEEP_STEPS, ids)  # the newest are kept
    msg = SpotCheckVerdict(peer_id=late_checker, step=KEEP_STEPS, suspect=late, outcome="match")
    assert checks.verdict(msg, late_checker * 4, "host-1", "conformance-abc123") is None


def test_a_check_compares_a_random_window_of_whole_frames_of_at_most_check_values():
    from crowdtrain.volunteer.spotcheck import CHECK_VALUES, window

    rng = random.Random(1)
    assert window(1000, 1 << 20, rng) == [(0, 1000)]  # a small part: all of it
    frame = 1 << 20
    n = 10 * CHECK_VALUES + 123
    starts = set()
    for _ in range(50):
        frames = window(n, frame, rng)
        assert sum(b - a for a, b in frames) <= CHECK_VALUES
        assert all(a % frame == 0 and b == min(a + frame, n) for a, b in frames)
        assert all(f[1] == g[0] for f, g in itertools.pairwise(frames))  # contiguous
        starts.add(frames[0][0])
    assert len(starts) > 10  # drawn at random over the part, the last (short) frame included
    assert window(5 * frame, 8 * CHECK_VALUES, rng) == [(0, 5 * frame)]  # frames above the window: one
