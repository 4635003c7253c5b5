"""The runs of one tracker, one record each: its live collaboration, its torrent, its join token's hash, and
whether its admin deleted it (a deleted run is answered 410 while this tracker runs, not 404).

Creating, closing and deleting a run write the store and the live state together, here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.messages import (
    CreditRecord,
    RunSpec,
    RunStatus,
    RunSummary,
    StepHistory,
    replace,
    run_eta,
)
from crowdtrain.tracker.collab import OnFormed, RunState
from crowdtrain.tracker.store import RunStore
from crowdtrain.tracker.swarm import Swarms

log = logging.getLogger("crowdtrain.tracker")


def token_hash(token: str) -> str:
    """How a join token is kept: its sha256, never the token."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(slots=True)
class Run:
    state: RunState
    torrent: bytes
    join_token_hash: str | None  # private runs (join policy "token")
    deleted: bool = False

    @property
    def run_id(self) -> str:
        return self.state.run_id

    @property
    def spec(self) -> RunSpec:
        return self.state.spec

    @property
    def private(self) -> bool:
        return self.spec.join_policy == "token"

    def mark_deleted(self) -> None:
        """Its admin deleted it: its volunteers are answered 410, and its torrent is served no more."""
        self.deleted = True
        self.torrent = b""

    # ------------------------------------------------------------ what anyone may read of it

    def summary(self) -> RunSummary:
        state = self.state
        return RunSummary(
            run_id=state.run_id,
            name=state.spec.name,
            global_step=state.global_step,
            peers_online=len(state.peers),
            created_at=state.spec.created_at,
            closed_at=state.closed_at_time,
        )

    def status(self, swarms: Swarms, peers: int = 100) -> RunStatus:
        """Its progress, its fastest ``peers`` volunteers, its recent steps and evaluations, and its swarm."""
        state = self.state
        swarm = swarms.by_hash.get(bytes.fromhex(state.spec.dataset.infohash))
        fastest = sorted(state.peers.values(), key=lambda p: p.share.samples_per_s, reverse=True)[:peers]
        recent = state.store.history(state.run_id)
        total = state.spec.schedule.total_steps
        return RunStatus(
            run_id=state.run_id,
            name=state.spec.name,
            global_step=state.global_step,
            samples=state.ledger.tally.samples,
            target=state.target,
            eta_s=state.eta_s(),
            peers_online=len(state.peers),
            samples_per_s=state.ledger.tally.rate_sum,
            peers=[p.status() for p in fastest],
            recent_steps=recent,
            notice=state.closed or state.notice or state.state_notice(),
            closed_at=state.closed_at_time,
            swarm_seeds=swarm.seeders if swarm else 0,
            swarm_peers=len(swarm.peers) if swarm else 0,
            evals=state.store.evals(state.run_id),
            inner_steps=state.horizon.h,
            inner_auto=state.spec.averaging.auto_inner_steps,
            codec=state.spec.averaging.codec,
            credits=_with_bars(state.store.credits(state.run_id), state.checks.bars()),
            total_steps=total,
            run_eta_s=run_eta(state.global_step, total, recent),
            spot_checked=state.spec.averaging.spot_checked,
        )

    def history(self, limit: int) -> StepHistory:
        """The newest ``limit`` closed steps and evaluations, oldest first: the page's curves."""
        steps = self.state.store.history(self.run_id, limit)[::-1]
        evals = self.state.store.evals(self.run_id, limit)[::-1]
        return StepHistory(steps=steps, evals=evals)

    def admits(self, token: str) -> bool:
        """Whether ``token`` is this run's join token (the one check behind joins and the private page)."""
        return (
            bool(token)
            and self.join_token_hash is not None
            and hmac.compare_digest(token_hash(token), self.join_token_hash)
        )


class Runs:
    """Every run of one tracker, by id."""

    def __init__(self, store: RunStore, signer: SigningKey, on_formed: Iterable[OnFormed] = ()) -> None:
        self.store = store
        self.signer = signer
        self.on_formed = list(on_formed)
        self._by_id: dict[str, Run] = {}

    def load(self, quiet_s: float) -> None:
        """The stored runs, at their stored steps; a run in progress closes no step for ``quiet_s`` (its
        peers re-register with their next heartbeats)."""
        for stored in self.store.runs():
            state = self._state(stored.spec, stored.global_step, quiet_s)
            if stored.closed_at is not None:
                state.close(stored.closed_at)
            self._by_id[stored.spec.run_id] = Run(state, stored.torrent, stored.join_token_hash)

    def _state(self, spec: RunSpec, global_step: int, quiet_s: float = 0.0) -> RunState:
        return RunState(spec, global_step, self.store, self.signer, quiet_s=quiet_s, on_formed=self.on_formed)

    def create(self, spec: RunSpec, torrent: bytes, join_token: str | None, tokenizer: bytes | None) -> Run:
        hashed = token_hash(join_token) if spec.join_policy == "token" and join_token else None
        self.store.add_run(spec, torrent, hashed, tokenizer)
        run = self._by_id[spec.run_id] = Run(self._state(spec, 0), torrent, hashed)
        log.info("run %s (%s) created", spec.run_id, spec.name)
        return run

    def get(self, run_id: str) -> Run | None:
        """The run's record, a deleted one's too (None: there never was one since this tracker started)."""
        return self._by_id.get(run_id)

    def live(self) -> list[Run]:
        return [run for run in self._by_id.values() if not run.deleted]

    def __len__(self) -> int:
        return sum(not run.deleted for run in self._by_id.values())

    def peers_online(self) -> int:
        return sum(len(run.state.peers) for run in self.live())

    def summaries(self, *, private: bool) -> list[RunSummary]:
        """Every run's summary, oldest first; the private ones only if ``private``."""
        return [run.summary() for run in self.live() if private or not run.private]

    def close(self, run: Run, now: float) -> None:
        """Its admin closed the run: it takes no more steps (idempotent)."""
        if run.state.refusal() is None:
            self.store.close_run(run.run_id, now)
            run.state.close(now)
            log.info("run %s closed by the admin", run.run_id)

    def delete(self, run: Run, now: float) -> None:
        """Its admin deleted the run and its history; its volunteers are answered 410 and leave."""
        run.state.close(now)
        self.store.delete_run(run.run_id)
        run.state.clear()
        run.mark_deleted()
        log.info("run %s deleted by the admin", run.run_id)


def _with_bars(credits: list[CreditRecord], bars: dict[str, str]) -> list[CreditRecord]:
    """The credit ledger, each barred key marked with why (and listed, also without credit)."""
    out = [replace(c, barred=bars[c.public_key]) if c.public_key in bars else c for c in credits]
    listed = {c.public_key for c in credits}
    out += [
        CreditRecord(public_key=k, samples=0, steps=0, last_step=0, barred=why)
        for k, why in sorted(bars.items())
        if k not in listed
    ]
    return out
