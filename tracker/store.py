"""Durable tracker state: its key and admin token, data sets, runs (with their torrent and tokenizer), step
history, held-out evaluations, the credit ledger (per volunteer key: samples averaged, steps). :class:`RunStore` is what the tracker asks of a store; :class:`Store` keeps it
in SQLite (WAL), in a file or (``":memory:"``) for one process. Every implementation passes
``tests/test_store_conformance.py`` (chihaya's ``storage_tests`` shape).

Live peer tables are in memory (:mod:`crowdtrain.tracker.collab`, :mod:`crowdtrain.tracker.swarm`) and
are rebuilt from heartbeats and announces after a restart. Writes are small and rare (a run created, a
step closed), so they run on the event loop's thread with ``synchronous=NORMAL``: a process crash loses
nothing that was committed.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from crowdtrain.protocol.messages import (
    CreditRecord,
    EvalRecord,
    EvalReport,
    RunSpec,
    StepRecord,
    decode,
    encode,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS datasets (
    infohash TEXT PRIMARY KEY, name TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, spec BLOB NOT NULL, torrent BLOB NOT NULL, join_token_hash TEXT,
    global_step INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, closed_at REAL, tokenizer BLOB);
CREATE TABLE IF NOT EXISTS steps (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, closed_at REAL NOT NULL, duration_s REAL NOT NULL,
    samples INTEGER NOT NULL, peers INTEGER NOT NULL, groups INTEGER NOT NULL, seed INTEGER NOT NULL,
    loss REAL, inner_steps INTEGER NOT NULL DEFAULT 1, PRIMARY KEY (run_id, step));
CREATE TABLE IF NOT EXISTS credits (
    run_id TEXT NOT NULL, public_key TEXT NOT NULL, samples INTEGER NOT NULL, steps INTEGER NOT NULL,
    last_step INTEGER NOT NULL, verified INTEGER NOT NULL DEFAULT 0, rejected INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, public_key));
CREATE TABLE IF NOT EXISTS bars (
    run_id TEXT NOT NULL, public_key TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (run_id, public_key));
CREATE TABLE IF NOT EXISTS evals (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, loss REAL NOT NULL, metrics TEXT NOT NULL,
    reports INTEGER NOT NULL, PRIMARY KEY (run_id, step));
"""


_CREDIT = "public_key, samples, steps, last_step, verified, rejected"


def _credit(row: Sequence) -> CreditRecord:
    key, samples, steps, last, verified, rejected = row
    return CreditRecord(
        public_key=key, samples=samples, steps=steps, last_step=last, verified=verified, rejected=rejected
    )


@dataclass(slots=True)
class StoredRun:
    spec: RunSpec
    torrent: bytes
    join_token_hash: str | None
    global_step: int
    closed_at: float | None = None  # when its admin closed it: it takes no more steps


@runtime_checkable
class RunStore(Protocol):
    """What the tracker keeps across restarts. A write is durable once the call returns."""

    def close(self) -> None: ...

    def get_meta(self, key: str) -> bytes | None: ...

    def get_or_set_meta(self, key: str, make: bytes) -> bytes:
        """The stored value of ``key``; ``make`` is stored and returned when there is none."""
        ...

    def set_meta(self, key: str, value: bytes) -> None: ...

    def add_dataset(self, infohash: str, name: str) -> None: ...

    def datasets(self) -> dict[str, str]:
        """Registered data sets, info-hash (hex) to name; a run's data set is registered with it."""
        ...

    def add_run(
        self, spec: RunSpec, torrent: bytes, join_token_hash: str | None, tokenizer: bytes | None = None
    ) -> None: ...

    def runs(self) -> list[StoredRun]:
        """Every run, oldest first, at the global step its last closed step advanced it to."""
        ...

    def tokenizer(self, run_id: str) -> bytes | None: ...

    def close_run(self, run_id: str, when: float) -> None:
        """Mark the run closed at ``when``; a run closed already keeps its first time."""
        ...

    def delete_run(self, run_id: str) -> None:
        """The run, its step history and its evaluations go (its data set stays registered)."""
        ...

    def close_step(self, run_id: str, record: StepRecord, credits: Sequence[tuple[str, int]] = ()) -> None:
        """Record a closed step, credit each (public key, samples) averaged in it, and advance the run's global
        step past it, atomically."""
        ...

    def credits(self, run_id: str, limit: int = 20) -> list[CreditRecord]:
        """The credit ledger's ``limit`` leaders: most samples first."""
        ...

    def record_check(self, run_id: str, public_key: str, passed: bool) -> CreditRecord:
        """Count a spot-check of the identity's contributions (passed: ``verified``, else ``rejected``) and
        return its record."""
        ...

    def bar(self, run_id: str, public_key: str, reason: str) -> None:
        """Bar ``public_key`` from the run on proof (a receipt it signed that breaks its own arithmetic)."""
        ...

    def bars(self, run_id: str) -> dict[str, str]:
        """The run's keys barred on proof, and why."""
        ...

    def rejected_keys(self, run_id: str, at_least: int, share: float = 0.0) -> set[str]:
        """The keys of the run with at least ``at_least`` rejected spot-checks, and at least ``share`` of
        their checks rejected."""
        ...

    def history(self, run_id: str, limit: int = 10) -> list[StepRecord]:
        """The newest ``limit`` closed steps, newest first."""
        ...

    def inner_steps(self, run_id: str) -> tuple[int, int] | None:
        """The sum of the run's recorded steps' H and the last one's (None: no step recorded)."""
        ...

    def add_eval(self, run_id: str, report: EvalReport) -> EvalRecord:
        """Fold one report into the mean of its step's reports; the step's record."""
        ...

    def evals(self, run_id: str, limit: int = 10) -> list[EvalRecord]:
        """The newest ``limit`` evaluations, newest first."""
        ...


class Store:
    """The SQLite :class:`RunStore`: ``path`` a database file (WAL), or ``":memory:"``."""

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(runs)")}
        if "closed_at" not in columns:  # a database of an earlier version
            self._db.execute("ALTER TABLE runs ADD COLUMN closed_at REAL")
        if "tokenizer" not in columns:  # (its runs have none)
            self._db.execute("ALTER TABLE runs ADD COLUMN tokenizer BLOB")
        step_columns = {row[1] for row in self._db.execute("PRAGMA table_info(steps)")}
        if "loss" not in step_columns:
            self._db.execute("ALTER TABLE steps ADD COLUMN loss REAL")
        if "inner_steps" not in step_columns:  # (inner_steps = "auto" came later; before, H was the spec's)
            self._db.execute("ALTER TABLE steps ADD COLUMN inner_steps INTEGER NOT NULL DEFAULT 1")
        credit_columns = {row[1] for row in self._db.execute("PRAGMA table_info(credits)")}
        for column in ("verified", "rejected"):  # (spot-checks came later)
            if column not in credit_columns:
                self._db.execute(f"ALTER TABLE credits ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------ meta

    def get_meta(self, key: str) -> bytes | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def get_or_set_meta(self, key: str, make: bytes) -> bytes:
        """The stored value of ``key``; ``make`` is stored and returned when there is none."""
        self._db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, make))
        value = self.get_meta(key)
        assert value is not None  # just inserted or already there
        return value

    def set_meta(self, key: str, value: bytes) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------ data sets

    def add_dataset(self, infohash: str, name: str) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO datasets (infohash, name, created_at) VALUES (?, ?, ?)",
            (infohash, name, time.time()),
        )

    def datasets(self) -> dict[str, str]:
        return dict(self._db.execute("SELECT infohash, name FROM datasets").fetchall())

    # ------------------------------------------------------------ runs

    def add_run(
        self, spec: RunSpec, torrent: bytes, join_token_hash: str | None, tokenizer: bytes | None = None
    ) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO runs (run_id, spec, torrent, join_token_hash, global_step, created_at, tokenizer)"
                " VALUES (?, ?, ?, ?, 0, ?, ?)",
                (spec.run_id, encode(spec), torrent, join_token_hash, spec.created_at, tokenizer),
            )
            self._db.execute(
                "INSERT OR REPLACE INTO datasets (infohash, name, created_at) VALUES (?, ?, ?)",
                (spec.dataset.infohash, spec.dataset.manifest.name, spec.created_at),
            )

    def runs(self) -> list[StoredRun]:
        rows = self._db.execute(
            "SELECT spec, torrent, join_token_hash, global_step, closed_at FROM runs ORDER BY created_at"
        ).fetchall()
        return [
            StoredRun(decode(bytes(spec), RunSpec), bytes(torrent), token, step, closed)
            for spec, torrent, token, step, closed in rows
        ]

    def tokenizer(self, run_id: str) -> bytes | None:
        """The run's tokenizer.json (read when asked: it can be megabytes), or None when it has none."""
        row = self._db.execute("SELECT tokenizer FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None or row[0] is None else bytes(row[0])

    def close_run(self, run_id: str, when: float) -> None:
        self._db.execute(
            "UPDATE runs SET closed_at = ? WHERE run_id = ? AND closed_at IS NULL", (when, run_id)
        )

    def delete_run(self, run_id: str) -> None:
        """The run and its step history go (its data set stays registered: other runs may use it)."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM steps WHERE run_id = ?", (run_id,))
            self._db.execute("DELETE FROM evals WHERE run_id = ?", (run_id,))
            self._db.execute("DELETE FROM credits WHERE run_id = ?", (run_id,))
            self._db.execute("DELETE FROM bars WHERE run_id = ?", (run_id,))
            self._db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))

    def close_step(self, run_id: str, record: StepRecord, credits: Sequence[tuple[str, int]] = ()) -> None:
        """Record a closed step, credit each (public key, samples) averaged in it, and advance the run's global
        step past it, atomically."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO steps"
                " (run_id, step, closed_at, duration_s, samples, peers, groups, seed, loss, inner_steps)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    record.step,
                    record.closed_at,
                    record.duration_s,
                    record.samples,
                    record.peers,
                    record.groups,
                    record.seed,
                    record.loss,
                    record.inner_steps,
                ),
            )
            self._db.executemany(
                "INSERT INTO credits (run_id, public_key, samples, steps, last_step) VALUES (?, ?, ?, 1, ?)"
                " ON CONFLICT (run_id, public_key) DO UPDATE SET samples = samples + excluded.samples,"
                " steps = steps + 1, last_step = max(last_step, excluded.last_step)",
                [(run_id, key, samples, record.step) for key, samples in credits],
            )
            self._db.execute("UPDATE runs SET global_step = ? WHERE run_id = ?", (record.step + 1, run_id))

    def credits(self, run_id: str, limit: int = 20) -> list[CreditRecord]:
        rows = self._db.execute(
            f"SELECT {_CREDIT} FROM credits WHERE run_id = ?"
            " ORDER BY samples DESC, steps DESC, public_key LIMIT ?",
            (run_id, limit),
        ).fetchall()
        return [_credit(row) for row in rows]

    def record_check(self, run_id: str, public_key: str, passed: bool) -> CreditRecord:
        column = "verified" if passed else "rejected"
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                f"INSERT INTO credits (run_id, public_key, samples, steps, last_step, {column})"
                f" VALUES (?, ?, 0, 0, 0, 1) ON CONFLICT (run_id, public_key) DO UPDATE SET {column} = {column} + 1",
                (run_id, public_key),
            )
            row = self._db.execute(
                f"SELECT {_CREDIT} FROM credits WHERE run_id = ? AND public_key = ?", (run_id, public_key)
            ).fetchone()
        return _credit(row)

    def bar(self, run_id: str, public_key: str, reason: str) -> None:
        with self._db:
            self._db.execute(
                "INSERT OR IGNORE INTO bars (run_id, public_key, reason, at) VALUES (?, ?, ?, ?)",
                (run_id, public_key, reason, time.time()),
            )

    def bars(self, run_id: str) -> dict[str, str]:
        rows = self._db.execute("SELECT public_key, reason FROM bars WHERE run_id = ?", (run_id,)).fetchall()
        return dict(rows)

    def rejected_keys(self, run_id: str, at_least: int, share: float = 0.0) -> set[str]:
        rows = self._db.execute(
            "SELECT public_key FROM credits WHERE run_id = ? AND rejected >= ? AND rejected >= ? * (verified + rejected)",
            (run_id, at_least, share),
        ).fetchall()
        return {key for (key,) in rows}

    def history(self, run_id: str, limit: int = 10) -> list[StepRecord]:
        rows = self._db.execute(
            "SELECT step, closed_at, duration_s, samples, peers, groups, seed, loss, inner_steps FROM steps"
            " WHERE run_id = ? ORDER BY step DESC LIMIT ?",
            (run_id, limit),
        ).fetchall()
        return [
            StepRecord(
                step=s,
                closed_at=c,
                duration_s=d,
                samples=n,
                peers=p,
                groups=g,
                seed=seed,
                loss=loss,
                inner_steps=h,
            )
            for s, c, d, n, p, g, seed, loss, h in rows
        ]

    def inner_steps(self, run_id: str) -> tuple[int, int] | None:
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(inner_steps), 0),"
            " (SELECT inner_steps FROM steps WHERE run_id = ?1 ORDER BY step DESC LIMIT 1)"
            " FROM steps WHERE run_id = ?1",
            (run_id,),
        ).fetchone()
        return (int(row[1]), int(row[2])) if row[0] else None

    # ------------------------------------------------------------ held-out evaluations

    def add_eval(self, run_id: str, report: EvalReport) -> EvalRecord:
        """Fold one volunteer's report into the mean of its step's reports (metrics named by every report
        so far; the rest are dropped), and return the step's record."""
        with self._db:
            self._db.execute("BEGIN")
            row = self._db.execute(
                "SELECT loss, metrics, reports FROM evals WHERE run_id = ? AND step = ?",
                (run_id, report.step),
            ).fetchone()
            if row is None:
                loss, metrics, n = report.loss, dict(report.metrics), 1
            else:
                old_loss, old_metrics, k = row[0], json.loads(row[1]), row[2]
                n = k + 1
                loss = old_loss + (report.loss - old_loss) / n
                metrics = {
                    name: value + (report.metrics[name] - value) / n
                    for name, value in old_metrics.items()
                    if name in report.metrics
                }
            self._db.execute(
                "INSERT OR REPLACE INTO evals (run_id, step, loss, metrics, reports) VALUES (?, ?, ?, ?, ?)",
                (run_id, report.step, loss, json.dumps(metrics, sort_keys=True), n),
            )
        return EvalRecord(step=report.step, loss=loss, metrics=metrics, reports=n)

    def evals(self, run_id: str, limit: int = 10) -> list[EvalRecord]:
        """The newest ``limit`` evaluations, newest first."""
        rows = self._db.execute(
            "SELECT step, loss, metrics, reports FROM evals WHERE run_id = ? ORDER BY step DESC LIMIT ?",
            (run_id, limit),
        ).fetchall()
        return [EvalRecord(step=st, loss=lo, metrics=json.loads(m), reports=n) for st, lo, m, n in rows]
