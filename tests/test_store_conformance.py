"""One conformance suite for every :class:`~crowdtrain.tracker.store.RunStore` (chihaya's
``storage/storage_tests.go`` shape): each test runs against each implementation. Today that is SQLite, in a
file and in memory; a new store adds itself to ``STORES`` and must pass all of it."""

from __future__ import annotations

import base64
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crowdtrain.protocol.messages import EvalReport, RunSpec, StepRecord
from crowdtrain.tracker.store import RunStore, Store
from tests.sim import make_run_create

# name -> (how to open it in a folder, whether what it holds outlives closing it)
STORES: dict[str, tuple[Callable[[Path], RunStore], bool]] = {
    "sqlite-file": (lambda folder: Store(str(folder / "sub" / "tracker.sqlite3")), True),
    "sqlite-memory": (lambda folder: Store(":memory:"), False),
}


@pytest.fixture(params=sorted(STORES))
def store(request, tmp_path) -> Iterator[RunStore]:
    opened = STORES[request.param][0](tmp_path)
    yield opened
    opened.close()


def spec(name: str = "conformance", created_at: float = 1000.0, join_policy: str = "public") -> RunSpec:
    msg = make_run_create(name)
    return RunSpec(
        run_id=f"{name}-abc123",
        name=name,
        model=msg.model,
        dataset=msg.dataset,
        optimizer=msg.optimizer,
        schedule=msg.schedule,
        target_batch_size=msg.target_batch_size,
        micro_batch_size=msg.micro_batch_size,
        averaging=msg.averaging,
        eval=msg.eval,
        join_policy=join_policy,
        tracker_public_key="cd" * 32,
        seed=msg.seed,
        created_at=created_at,
    )


def record(step: int, samples: int = 64, loss: float | None = 2.5) -> StepRecord:
    return StepRecord(
        step=step,
        closed_at=2000.0 + step,
        duration_s=1.5,
        samples=samples,
        peers=3,
        groups=1,
        seed=7,
        loss=loss,
    )


def torrent() -> bytes:
    return base64.b64decode(make_run_create("t").torrent)


def test_it_is_a_run_store(store):
    """Every method of the RunStore protocol, with the protocol's parameters (names, kinds, defaults)."""
    wanted = [n for n, v in vars(RunStore).items() if callable(v) and not n.startswith("_")]
    assert len(wanted) >= 10, wanted
    for name in wanted:
        mine = inspect.signature(getattr(type(store), name))
        spec = inspect.signature(getattr(RunStore, name))
        shape = [(p.name, p.kind, p.default) for p in spec.parameters.values()]
        assert [(p.name, p.kind, p.default) for p in mine.parameters.values()] == shape, (name, mine, spec)


def test_meta_is_set_once_by_get_or_set_and_replaced_by_set(store):
    assert store.get_meta("admin_token") is None
    assert store.get_or_set_meta("admin_token", b"first") == b"first"
    assert store.get_or_set_meta("admin_token", b"second") == b"first"  # kept, not replaced
    store.set_meta("admin_token", b"third")
    assert store.get_meta("admin_token") == b"third"
    store.set_meta("empty", b"")
    assert store.get_meta("empty") == b""


def test_data_sets_are_registered_by_info_hash(store):
    assert store.datasets() == {}
    store.add_dataset("aa" * 20, "first name")
    store.add_dataset("bb" * 20, "other")
    store.add_dataset("aa" * 20, "renamed")
    assert store.datasets() == {"aa" * 20: "renamed", "bb" * 20: "other"}


def test_a_run_is_kept_with_its_torrent_token_tokenizer_and_data_set(store):
    first, second = spec("first", 1000.0), spec("second", 999.0, join_policy="token")
    store.add_run(first, torrent(), None)
    store.add_run(second, b"other torrent", "ef" * 32, b'{"model": {}}')
    runs = store.runs()
    assert [r.spec for r in runs] == [second, first]  # oldest first
    assert [(r.torrent, r.join_token_hash, r.global_step, r.closed_at) for r in runs] == [
        (b"other torrent", "ef" * 32, 0, None),
        (torrent(), None, 0, None),
    ]
    assert store.tokenizer(second.run_id) == b'{"model": {}}'
    assert store.tokenizer(first.run_id) is None
    assert store.tokenizer("no-such-run") is None
    assert store.datasets() == {first.dataset.infohash: first.dataset.manifest.name}


def test_a_closed_step_is_recorded_and_advances_the_run(store):
    run = spec()
    store.add_run(run, torrent(), None)
    store.close_step(run.run_id, record(0, loss=None))
    store.close_step(run.run_id, record(1, samples=70))
    assert store.runs()[0].global_step == 2
    assert store.history(run.run_id) == [record(1, samples=70), record(0, loss=None)]  # newest first
    assert store.history(run.run_id, limit=1) == [record(1, samples=70)]
    assert store.history("no-such-run") == []


def test_the_credit_ledger_adds_up_each_key_s_averaged_samples_and_steps_with_the_steps(store):
    run, other = spec(), spec("other")
    a, b, c = "aa" * 32, "bb" * 32, "cc" * 32
    for r in (run, other):
        store.add_run(r, torrent(), None)
    store.close_step(run.run_id, record(0), [(a, 40), (b, 24), (c, 0)])  # c: a backbone, weight 0
    store.close_step(run.run_id, record(1), [(a, 30), (b, 34)])
    store.close_step(other.run_id, record(0), [(c, 99)])
    assert [(x.public_key, x.samples, x.steps, x.last_step) for x in store.credits(run.run_id)] == [
        (a, 70, 2, 1),
        (b, 58, 2, 1),
        (c, 0, 1, 0),
    ]
    assert [x.public_key for x in store.credits(run.run_id, limit=1)] == [a]
    assert [(x.public_key, x.samples) for x in store.credits(other.run_id)] == [(c, 99)]
    store.delete_run(run.run_id)
    assert store.credits(run.run_id) == [] and len(store.credits(other.run_id)) == 1


def test_spot_checks_count_verified_and_rejected_beside_the_samples(store):
    run = spec()
    a, b = "aa" * 32, "bb" * 32
    store.add_run(run, torrent(), None)
    store.close_step(run.run_id, record(0), [(a, 40)])
    assert store.record_check(run.run_id, a, True).verified == 1
    after = store.record_check(run.run_id, a, False)
    assert (after.samples, after.steps, after.verified, after.rejected) == (40, 1, 1, 1)
    # a key checked before it was ever credited (its first step's check) gets a record of its own
    assert store.record_check(run.run_id, b, False).rejected == 1
    store.close_step(run.run_id, record(1), [(b, 8)])
    by_key = {c.public_key: (c.samples, c.verified, c.rejected) for c in store.credits(run.run_id)}
    assert by_key == {a: (40, 1, 1), b: (8, 0, 1)}
    store.record_check(run.run_id, b, False)
    assert store.rejected_keys(run.run_id, 2) == {b} and store.rejected_keys(run.run_id, 1) == {a, b}
    # a share of its checks: a has 1 rejected of 2, b 2 of 2
    assert store.rejected_keys(run.run_id, 1, 0.6) == {b} and store.rejected_keys(run.run_id, 1, 0.5) == {
        a,
        b,
    }


def test_closing_a_run_keeps_its_first_time(store):
    run = spec()
    store.add_run(run, torrent(), None)
    store.close_run(run.run_id, 3000.0)
    store.close_run(run.run_id, 4000.0)
    assert store.runs()[0].closed_at == 3000.0


def test_evaluations_are_the_running_mean_of_their_reports_over_the_metrics_every_report_names(store):
    run = spec()
    store.add_run(run, torrent(), None)
    first = store.add_eval(
        run.run_id, EvalReport(step=10, loss=2.0, metrics={"acc": 0.5, "ppl": 7.0}, samples=100)
    )
    assert (first.loss, first.metrics, first.reports) == (2.0, {"acc": 0.5, "ppl": 7.0}, 1)
    second = store.add_eval(run.run_id, EvalReport(step=10, loss=4.0, metrics={"acc": 0.7}, samples=100))
    assert (second.loss, second.reports) == (3.0, 2)
    assert second.metrics == pytest.approx({"acc": 0.6})  # ppl was not in every report
    store.add_eval(run.run_id, EvalReport(step=20, loss=1.0, metrics={}, samples=100))
    assert [(e.step, e.reports) for e in store.evals(run.run_id)] == [(20, 1), (10, 2)]  # newest first
    assert [e.step for e in store.evals(run.run_id, limit=1)] == [20]
    assert store.evals(run.run_id)[1] == second


def test_deleting_a_run_takes_its_history_and_evaluations_and_leaves_its_data_set(store):
    kept, deleted = spec("kept"), spec("deleted")
    for run in (kept, deleted):
        store.add_run(run, torrent(), None)
        store.close_step(run.run_id, record(0))
        store.add_eval(run.run_id, EvalReport(step=1, loss=1.0, metrics={}, samples=100))
    store.delete_run(deleted.run_id)
    assert [r.spec.run_id for r in store.runs()] == [kept.run_id]
    assert store.history(deleted.run_id) == [] and store.evals(deleted.run_id) == []
    assert len(store.history(kept.run_id)) == 1 and len(store.evals(kept.run_id)) == 1
    assert deleted.dataset.infohash in store.datasets()


@pytest.mark.parametrize("name", sorted(n for n, (_, durable) in STORES.items() if durable))
def test_a_durable_store_holds_everything_after_it_is_opened_again(name, tmp_path):
    open_store = STORES[name][0]
    store = open_store(tmp_path)
    run = spec()
    store.add_run(run, torrent(), "ef" * 32, b"{}")
    store.set_meta("tracker_key", b"key")
    store.close_step(run.run_id, record(0), [("ab" * 32, 24)])
    store.record_check(run.run_id, "ab" * 32, True)
    store.add_eval(run.run_id, EvalReport(step=1, loss=1.0, metrics={"acc": 1.0}, samples=100))
    store.close_run(run.run_id, 3000.0)
    store.close()
    again = open_store(tmp_path)
    [back] = again.runs()
    assert (back.spec, back.join_token_hash, back.global_step, back.closed_at) == (run, "ef" * 32, 1, 3000.0)
    assert again.get_meta("tracker_key") == b"key"
    assert again.history(run.run_id) == [record(0)]
    assert again.evals(run.run_id)[0].metrics == {"acc": 1.0}
    assert again.tokenizer(run.run_id) == b"{}"
    assert [(c.public_key, c.samples, c.steps, c.verified) for c in again.credits(run.run_id)] == [
        ("ab" * 32, 24, 1, 1)
    ]
    again.close()


def test_a_database_of_an_earlier_version_gains_the_spot_check_counts(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE credits (run_id TEXT NOT NULL, public_key TEXT NOT NULL, samples INTEGER NOT NULL,"
        " steps INTEGER NOT NULL, last_step INTEGER NOT NULL, PRIMARY KEY (run_id, public_key))"
    )
    db.execute("INSERT INTO credits VALUES ('r', ?, 24, 1, 0)", ("ab" * 32,))
    db.commit()
    db.close()
    store = Store(str(path))
    [credit] = store.credits("r")
    assert (credit.samples, credit.verified, credit.rejected) == (24, 0, 0)
    assert store.record_check("r", "ab" * 32, False).rejected == 1
    store.close()


def test_the_steps_inner_steps_are_kept_and_summed_for_a_restarted_tracker(store):
    """``inner_steps = "auto"``: each step's H is recorded, and a restarted tracker reads their sum and the last."""
    s = spec("inner")
    store.add_run(s, torrent(), None)
    assert store.inner_steps(s.run_id) is None
    for step, h in enumerate([4, 4, 9, 12]):
        store.close_step(s.run_id, _with_h(step, h))
    assert store.inner_steps(s.run_id) == (29, 12)
    assert [r.inner_steps for r in store.history(s.run_id)] == [12, 9, 4, 4]


def _with_h(step: int, h: int) -> StepRecord:
    r = record(step)
    return StepRecord(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "inner_steps": h})
