"""Members that pull against the run: copies that point against the other members', round after round.

A member reports another (``POST /api/v1/runs/{id}/pull``, :class:`PullReport`) with the signed receipts of a
round's first phase, those of the parts owned by neither of them. The tracker checks each receipt's signature
and arithmetic and recomputes the cosine between the accused's copy and the other members' terms
(:func:`crowdtrain.protocol.receipts.alignment`): a report it cannot recompute below
:data:`~crowdtrain.protocol.receipts.PULL_COS` is refused with a sentence. A key is barred once reported so
in :data:`PULL_ROUNDS` distinct steps within :data:`PULL_WINDOW` steps, by at least :data:`PULL_REPORTERS`
reporters (addresses, or keys on the tracker's machine).

Honest copies stay far from the threshold (docs/security.md, "A member that pulls": measured cosines of
honest members 0.14 or more in local-steps mode and rarely below −0.4 in every-step mode, a member sending
−4.9× its pseudo-gradient −0.56 or less); a member that points against the others by less is not barred,
and its pull is bounded by the clip (at most its weight's share of the median copy's length).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

PULL_ROUNDS = 3  # distinct steps reported...
PULL_WINDOW = 8  # ...within this many steps...
PULL_REPORTERS = 2  # ...by at least this many reporters bar a key
MAX_KEYS = 4096  # keys with reports kept (the oldest reported is forgotten first)
MAX_REPORTS = 4 * PULL_WINDOW  # reports kept per key


@dataclass(slots=True)
class Pulls:
    """One run's verified pull reports, by accused key."""

    _reports: OrderedDict[str, deque[tuple[int, str]]] = field(default_factory=OrderedDict)

    def report(self, key: str, step: int, reporter: str) -> bool:
        """Count a verified report of ``key`` at ``step`` by ``reporter``; True when the key is now to be barred."""
        seen = self._reports.pop(key, None) or deque(maxlen=MAX_REPORTS)
        self._reports[key] = seen
        while len(self._reports) > MAX_KEYS:
            self._reports.popitem(last=False)
        if (step, reporter) not in seen:
            seen.append((step, reporter))
        newest = max(s for s, _ in seen)
        recent = [(s, r) for s, r in seen if s > newest - PULL_WINDOW]
        return len({s for s, _ in recent}) >= PULL_ROUNDS and len({r for _, r in recent}) >= PULL_REPORTERS

    def rounds(self, key: str) -> int:
        """Distinct steps ``key`` was reported at (kept)."""
        return len({s for s, _ in self._reports.get(key, ())})
