"""The errors crowdtrain raises, one tree under :class:`CrowdtrainError`.

Every message is a sentence that says what went wrong and, where it can, what to do::

    CrowdtrainError                  anything crowdtrain raises on purpose; the CLI exits 1 with its text
    ├── ConfigError                  a setting is invalid; names the field
    ├── ProtocolError                bytes or JSON from the network are malformed; names the field
    │   ├── LimitExceeded            a declared or actual size is beyond a configured limit
    │   ├── AnnounceError*           an announce or scrape the tracker refuses (tracker/announce.py)
    │   ├── AddressError*            a declared address the tracker cannot use (tracker/reach.py)
    │   ├── NonFinite*               a frame decoded to NaN or infinity (volunteer/averaging/wire.py)
    │   └── RangeNotSatisfiable*     a state request's Range header is malformed (volunteer/state/serve.py)
    ├── AuthError                    a token, credential or signature is missing, wrong or expired
    │   └── AdminAuthError*          the admin token is missing or wrong (tracker/auth.py)
    ├── TrackerError                 the tracker answered with an error
    │   └── TrackerUnreachable       the tracker did not answer (down, wrong URL, timeout)
    ├── PeerUnreachable*             a peer did not answer, or its answer was cut off (protocol/peerclient.py)
    ├── ApiError*                    a tracker route's refusal: its HTTP status and sentence (tracker/replies.py)
    ├── StateRefused*                a state declaration the tracker does not record (tracker/donors.py)
    ├── VerdictRefused*              a spot-check verdict the tracker did not draw (tracker/spotchecks.py)
    ├── CutRefused*                  a cut call the tracker cannot hold: too many open cases (tracker/cuts.py)
    ├── DatasetError                 a data set cannot be made, read or fetched
    ├── RecipeError                  the model recipe is unknown or does not match the run's spec
    ├── AveragingError               an all-reduce round failed as a whole
    │   └── RoundDiverged*           this peer's mean of a round is not the others' (volunteer/rounds.py)
    └── StateSyncError               no donor could deliver the run's current state
        └── DonorsDisagree           the peers serving the run's state disagree: none can be listed

(* defined beside the one module that raises it; ``tests/test_errors_tree.py`` holds this drawing to the code.)
"""

from __future__ import annotations


class CrowdtrainError(Exception):
    """Root of every error crowdtrain raises on purpose."""


class ConfigError(CrowdtrainError, ValueError):
    """A configuration value is invalid."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class ProtocolError(CrowdtrainError):
    """Malformed input from the network (a frame, a JSON message, a query string)."""


class LimitExceeded(ProtocolError):
    """A size declared by or measured on the input is larger than the configured limit."""


class AuthError(CrowdtrainError):
    """A token, credential or signature is missing, wrong or expired."""


class TrackerError(CrowdtrainError):
    """The tracker answered with an error; ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int = 0) -> None:
        self.status = status
        super().__init__(message)


class TrackerUnreachable(TrackerError):
    """The tracker could not be reached."""


class DatasetError(CrowdtrainError):
    """A data set cannot be made, read or fetched."""


class RecipeError(CrowdtrainError):
    """A model recipe is unknown, or its parameters do not match the run's spec."""


class AveragingError(CrowdtrainError):
    """An all-reduce round failed as a whole."""


class StateSyncError(CrowdtrainError):
    """No donor could deliver the run's current state."""

    def __init__(self, message: str, donors: tuple[str, ...] = ()) -> None:
        self.donors = donors
        super().__init__(message)


class DonorsDisagree(StateSyncError):
    """The peers serving the run's state disagree on it, so the tracker lists none: wait, do not guess."""
