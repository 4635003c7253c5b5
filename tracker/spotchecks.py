"""Spot-checks: one member's gradient recomputed by another, and what a mismatch costs.

The rules (docs/security.md, "Spot-checks"):

* When a step's round forms, each group of its first phase gets one check with probability
  ``averaging.spot_checks`` (every-step mode with delay 0 and a codec that keeps every value: the checker must
  hold the step's parameters and the suspect's whole copy of its part). The *suspect* is a member with a
  weight: one with a rejection first (to confirm or clear it), then the one verified least (a new identity
  is on probation), ties by lot. The *checker* is a part owner other than the suspect, from another
  address if there is one, and never one that already rejected this suspect. Only the checker is told, in
  its ready reply: the suspect learns of it when asked for its samples, after its copy was sent.
* The checker asks the suspect for the samples of its gradient (``GET /v1/spotcheck/{step}``), recomputes
  the gradient at the step's parameters and compares its own part of it with the suspect's copy
  (``crowdtrain.volunteer.spotcheck``), then reports ``match``, ``mismatch``, ``unanswered`` (the suspect
  did not answer) or ``unverifiable`` (the checker could not recompute: a chunk it does not hold yet).
* ``match``: the suspect's key is ``verified`` once more. ``mismatch`` from an accuser that had not
  rejected this key before: ``rejected`` once more. ``unanswered`` (the suspect's peer server did not give
  its samples: a refusal, or a network fault) makes it a suspect first again, and
  :data:`UNANSWERED_TO_REJECT` of them in a row (no match between) count as one rejection by the accuser
  of the last. An accuser is a checker's address, or its key when it runs on the tracker's machine (a
  demo's volunteers). At :data:`REJECTIONS_TO_BAR` rejections, if they are at least
  :data:`REJECTED_SHARE_TO_BAR` of its checks (an honest key whose copy was once quantised far from its
  gradient is not barred for it after many matches), the key is barred from the run: its peer is removed
  (its allotment freed, its weight 0 from then on) and every request it makes is answered 410 with
  :meth:`SpotChecks.refusal`'s sentence. ``unverifiable`` counts for nothing. The counts are the credit
  ledger's (durable); so a barred key stays barred after a restart.
* A verdict is taken once, from the checker the tracker drew for that step and suspect; anything else is
  refused.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from crowdtrain.protocol.addresses import Origin
from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.protocol.messages import GroupAssignment, RunSpec, SpotCheck, SpotCheckVerdict
from crowdtrain.tracker.pulls import Pulls
from crowdtrain.tracker.store import RunStore

if TYPE_CHECKING:
    from crowdtrain.tracker.peers import Peer

log = logging.getLogger(__name__)

REJECTIONS_TO_BAR = 2  # rejections, from as many accusers, that bar a key from the run...
REJECTED_SHARE_TO_BAR = 0.1  # ...when they are at least this share of its checks
UNANSWERED_TO_REJECT = 3  # unanswered checks in a row that count as a rejection
KEEP_STEPS = 8  # drawn checks await their verdicts this many steps (then they are forgotten)


class VerdictRefused(CrowdtrainError):
    """A verdict the tracker does not take (answered 409 with this sentence)."""


@dataclass(slots=True)
class _Drawn:
    checker: str  # peer id
    checker_key: str
    suspect_key: str


@dataclass(slots=True)
class SpotChecks:
    """One run's spot-checks: who checks whom at which step, the verdicts, the barred keys."""

    spec: RunSpec
    store: RunStore
    rng: random.Random = field(default_factory=random.SystemRandom)
    _drawn: OrderedDict[tuple[int, str], _Drawn] = field(default_factory=OrderedDict)  # (step, suspect)
    _for_checker: dict[tuple[int, str], SpotCheck] = field(default_factory=dict)  # (step, checker)
    _verified: dict[str, int] = field(default_factory=dict)  # key -> checks passed (since start)
    _accusers: dict[str, set[str]] = field(default_factory=dict)  # key -> who rejected it
    _unanswered: dict[str, int] = field(default_factory=dict)  # key -> checks in a row it did not answer
    _barred: set[str] | None = None  # keys at REJECTIONS_TO_BAR rejections (read from the store once)...
    _proven: dict[str, str] = field(default_factory=dict)  # ...and those barred on proof, with why
    pulls: Pulls = field(
        default_factory=Pulls
    )  # members reported pulling against the others (tracker/pulls.py)

    @property
    def enabled(self) -> bool:
        return self.spec.averaging.spot_checked

    # ------------------------------------------------------------ drawing

    def draw(
        self,
        step: int,
        assignments: Mapping[str, list[GroupAssignment]],
        peers: Mapping[str, Peer],
        origin: Mapping[str, Origin | None],
    ) -> None:
        """Draw the checks of ``step``'s groups (phase 0), by the module's rules."""
        if not self.enabled:
            return
        for old in [k for k in self._drawn if k[0] <= step - KEEP_STEPS]:
            self._for_checker.pop((old[0], self._drawn.pop(old).checker), None)
        groups = {a[0].round_id: a[0] for a in assignments.values() if a and a[0].phase == 0}
        for group in groups.values():
            if self.rng.random() >= self.spec.averaging.spot_checks:
                continue
            pair = self._pick(group, peers, origin)
            if pair is not None:
                suspect, checker = pair
                self._remember(step, suspect, checker, peers)

    def _pick(
        self, group: GroupAssignment, peers: Mapping[str, Peer], origin: Mapping[str, Origin | None]
    ) -> tuple[str, str] | None:
        members = [m for m in group.members if m.peer_id in peers]
        # (a member in client mode cannot be asked for its samples: it is not checked, docs/security.md)
        weighted = [m.peer_id for m in members if m.weight > 0 and m.address is not None]
        self.rng.shuffle(weighted)

        def doubt(pid: str) -> tuple[int, int]:
            key = peers[pid].public_key
            doubts = len(self._accusers.get(key, ())) + (self._unanswered.get(key, 0) > 0)
            return (-doubts, self._verified.get(key, 0))

        for suspect in sorted(weighted, key=doubt):
            key = peers[suspect].public_key
            owners = [
                m.peer_id
                for m in members
                if m.part >= 0
                and m.peer_id != suspect
                and self._accuser(m.peer_id, peers, origin) not in self._accusers.get(key, ())
            ]
            if not owners:
                continue
            apart = [o for o in owners if origin.get(o) is None or origin.get(o) != origin.get(suspect)]
            return suspect, self.rng.choice(apart or owners)
        return None

    def _remember(self, step: int, suspect: str, checker: str, peers: Mapping[str, Peer]) -> None:
        self._drawn[(step, suspect)] = _Drawn(checker, peers[checker].public_key, peers[suspect].public_key)
        self._for_checker[(step, checker)] = SpotCheck(step=step, suspect=suspect)

    def of(self, step: int, peer_id: str) -> SpotCheck | None:
        """The check ``peer_id`` was drawn to make at ``step``, if any."""
        return self._for_checker.get((step, peer_id))

    # ------------------------------------------------------------ verdicts

    @staticmethod
    def _accuser(peer_id: str, peers: Mapping[str, Peer], origin: Mapping[str, Origin | None]) -> str:
        where = origin.get(peer_id)
        return where.address if where is not None else f"key {peers[peer_id].public_key}"

    def verdict(self, verdict: SpotCheckVerdict, checker_key: str, accuser: str, run_id: str) -> str | None:
        """Take a checker's verdict (raises :class:`VerdictRefused` when it was not drawn so); returns the
        suspect's key when this verdict barred it."""
        drawn = self._drawn.get((verdict.step, verdict.suspect))
        if drawn is None or drawn.checker != verdict.peer_id or drawn.checker_key != checker_key:
            raise VerdictRefused(
                f"peer {verdict.peer_id} was not drawn to check {verdict.suspect} at step {verdict.step} "
                "(or its verdict was already taken)"
            )
        del self._drawn[(verdict.step, verdict.suspect)]
        self._for_checker.pop((verdict.step, verdict.peer_id), None)
        key = drawn.suspect_key
        if verdict.outcome == "match":
            self._verified[key] = self._verified.get(key, 0) + 1
            self._unanswered.pop(key, None)
            self.store.record_check(run_id, key, True)
            return None
        if verdict.outcome == "unverifiable":
            return None
        if verdict.outcome == "unanswered":
            self._unanswered[key] = self._unanswered.get(key, 0) + 1
            if self._unanswered[key] < UNANSWERED_TO_REJECT:
                return None
            self._unanswered[key] = 0
        return self.accuse(key, accuser, run_id)

    def accuse(self, key: str, accuser: str, run_id: str) -> str | None:
        """A rejection of ``key`` by ``accuser`` (a failed spot-check, or a part owner's receipt that did not
        hold for the member it answered), counted once per accuser; returns the key when it is now barred."""
        accusers = self._accusers.setdefault(key, set())
        if accuser in accusers:
            return None
        accusers.add(accuser)
        record = self.store.record_check(run_id, key, False)
        checked = record.verified + record.rejected
        if record.rejected >= REJECTIONS_TO_BAR and record.rejected >= REJECTED_SHARE_TO_BAR * checked:
            self.barred_keys().add(key)
            log.warning(
                "run %s: key %s barred: %d rejections (failed spot-checks or receipts) against %d passed "
                "checks; accused from %s",
                run_id,
                key,
                record.rejected,
                record.verified,
                ", ".join(sorted(accusers)),
            )
            return key
        return None

    # ------------------------------------------------------------ barred keys

    def barred_keys(self) -> set[str]:
        if self._barred is None:
            self._barred = self.store.rejected_keys(
                self.spec.run_id, REJECTIONS_TO_BAR, REJECTED_SHARE_TO_BAR
            )
            self._proven = self.store.bars(self.spec.run_id)
            self._barred |= set(self._proven)
        return self._barred

    def bar_on_proof(self, key: str, reason: str) -> bool:
        """Bar ``key`` at once: ``reason`` (a sentence its refusals give) is a fact signed statements show: its
        own receipt (tracker/volunteers.py, complaint) or its owners' (tracker/pulls.py). True: newly barred."""
        if key in self.barred_keys():
            return False
        self.store.bar(self.spec.run_id, key, reason)
        self._proven[key] = reason
        self.barred_keys().add(key)
        return True

    def bars(self) -> dict[str, str]:
        """Every key barred from the run, with why (what `status` and the page show)."""
        return {
            key: self._proven.get(key, f"its gradients failed {REJECTIONS_TO_BAR} or more spot-checks")
            for key in sorted(self.barred_keys())
        }

    def refusal(self, key: str) -> str | None:
        """The sentence a barred key's requests get (None: it is not barred)."""
        if key not in self.barred_keys():
            return None
        if key in self._proven:
            return (
                f"run {self.spec.run_id} takes nothing more from this volunteer's key: {self._proven[key]}; "
                "see docs/security.md"
            )
        return (
            f"run {self.spec.run_id} takes nothing more from this volunteer's key: its gradients failed "
            f"{REJECTIONS_TO_BAR} or more spot-checks by other volunteers (recomputed from the samples it "
            "named, they did not match what it sent); see docs/security.md"
        )
