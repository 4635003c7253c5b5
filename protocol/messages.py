"""Every JSON control message crowdtrain exchanges, as strict, versioned msgspec schemas.

Rules on the wire: a message is a JSON object; ``version`` must be one this code speaks; unknown fields,
missing fields and fields of the wrong type are refused with a :class:`ProtocolError` whose text names
the field (``RunSpec: Expected `int`, got `str` - at `$.target_batch_size```). Sizes are bounded by
:class:`~crowdtrain.protocol.limits.Limits` before parsing. What a field may hold on its own (a range, a
length, a pattern) is stated on the field with :class:`msgspec.Meta` and refused the same way
(``Heartbeat: Expected `int` >= 0 - at `$.samples```); rules that need more than the field (the step a run
has reached, a join token a private run requires) are the receiver's. JSON carries no NaN or infinity
(``1e999`` is refused as "Number out of range"), so every float decoded is finite.

Who sends what:

* publisher → tracker: :class:`RunCreate` → :class:`RunCreated`
* volunteer → tracker: :class:`JoinRequest` → :class:`JoinResponse`; :class:`Heartbeat` →
  :class:`HeartbeatReply`; :class:`ReadyRequest` (long-poll) → :class:`ReadyReply` carrying a signed
  :class:`GroupAssignment`; :class:`StateDeclare`; ``GET`` → :class:`DonorList`; :class:`LeaveRequest`
* anyone → tracker: ``GET`` → :class:`RunSpec`, :class:`RunList`, :class:`RunStatus`
* donor → newcomer: :class:`StateManifest`
* any error: :class:`ErrorBody`
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, UnsetType

from crowdtrain.protocol.errors import LimitExceeded, ProtocolError
from crowdtrain.protocol.limits import DEFAULT_LIMITS, MAX_TOKENIZER_BASE64, MAX_TOKENIZER_BYTES, Limits

VERSION: Final = 1
Version = Literal[1]
# What peers exchange directly (tensor frames, the all-reduce and state routes). Builds of different peer
# protocols cannot average together, so the tracker admits only volunteers that speak its own. 2: frames
# with XXH3-64 checksums and stored bodies (a build without ``peer_protocol`` in its JoinRequest speaks 1).
# 3: a step's all-reduce runs in phases, so every group ends with the one mean of all (GroupAssignment.phase).
# 4: one tracker signature per step over a Merkle root of its assignments (GroupAssignment.proof).
# 5: parts of unequal sizes, by the owners' upload rates (GroupAssignment.part_weights).
PEER_PROTOCOL = 5
CodecName = Literal["none", "fp16", "bf16", "int8", "sparse", "int2"]
CHECKABLE_CODECS = frozenset({"none", "fp16", "bf16", "int8"})  # codecs that send every value every round
HEX40 = re.compile(r"^[0-9a-f]{40}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")
MERKLE_STEP = r"^[lr][0-9a-f]{64}$"
MAX_INT = 1 << 53  # whole numbers every JSON reader holds exactly

# Field constraints. A pattern's ``$`` also matches before a final newline: the lengths rule that out.
Count = Annotated[int, Meta(ge=0, le=MAX_INT)]  # a step, a number of samples
Rate = Annotated[float, Meta(ge=0, le=1e12)]  # samples per second
Port = Annotated[int, Meta(ge=1, le=65535)]
Hex40 = Annotated[str, Meta(pattern=HEX40.pattern, max_length=40)]  # a v1 info-hash
Hex64 = Annotated[str, Meta(pattern=HEX64.pattern, max_length=64)]  # a sha256, an Ed25519 public key
PARAM_HASH = r"^([0-9a-f]{64})?$"
Label = Annotated[str, Meta(max_length=100)]  # a short free text a peer reports about itself
PeerId = Annotated[str, Meta(max_length=64)]
# how a pattern reads in an error ("Expected `str` of 64 lowercase hex characters - at `$.public_key`")
_PATTERN_WORDS = {
    HEX40.pattern: "40 lowercase hex characters",
    HEX64.pattern: "64 lowercase hex characters",
    PARAM_HASH: "64 lowercase hex characters (or empty)",
    MERKLE_STEP: "'l' or 'r' and 64 lowercase hex characters",
}


class Message(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of every control message.

    Subclasses repeat ``frozen=True, kw_only=True``: msgspec inherits them, a type checker does not.
    """


# ---------------------------------------------------------------- run spec


class ModelSpec(Message, frozen=True, kw_only=True):
    recipe: str  # a name in the built-in recipes or the ``crowdtrain.models`` entry-point group
    args: dict[str, int | float | str | bool] = {}
    # sha256 of parameter names, shapes and dtypes; "" = filled in by `run create` (a tracker refuses "")
    param_hash: Annotated[str, Meta(pattern=PARAM_HASH, max_length=64)] = ""
    # sha256 of the initial values (parameters and buffers) as `run create` built them; "" = not checked.
    # A volunteer whose recipe (or torch) builds other values is refused before it trains another model.
    init_hash: Annotated[str, Meta(pattern=PARAM_HASH, max_length=64)] = ""
    # the distribution that provides the recipe, "name==version" (docs/recipes.md), and the sha256 of the
    # recipe's source files; "" = not checked. A volunteer whose recipe's code differs is refused.
    package: Annotated[str, Meta(max_length=200)] = ""
    code_hash: Annotated[str, Meta(pattern=PARAM_HASH, max_length=64)] = ""


class OptimizerSpec(Message, frozen=True, kw_only=True):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.0
    grad_clip: float = 1.0  # global norm of the averaged gradient; 0 disables clipping


class ScheduleSpec(Message, frozen=True, kw_only=True):
    kind: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.1


# inner_steps = "auto": the H of the first rounds, before any averaging was measured (within the run's bounds).
# Long rather than short: a round too long costs staleness for a round or two while H halves toward a fast link's,
# one too short leaves a home uplink's volunteers idle (4 hosts at 2 Mbit/s computed 87-89 % starting at 4).
AUTO_FIRST_INNER_STEPS = 16


class AveragingSpec(Message, frozen=True, kw_only=True):
    group_size: int = 4  # G: members per all-reduce group at most
    min_group_size: int = 1  # a step closes on its ETA only with at least this many ready peers
    codec: CodecName = "int8"
    zstd_level: int = 1
    round_timeout_s: float = 15.0  # deadline of one all-reduce round, from its assignment
    gather_s: float = 1.0  # how long the tracker waits for the peers of a closed step to say "ready"
    step_timeout_s: float = 60.0  # a step closes this long after it opened even below the target
    # copies with a norm above this × the lower median of the group's norms (never above the part owner's own
    # copy's norm) are scaled down to it
    clip_multiple: float = 1.0  # 1: no copy pulls harder than the median one (docs/security.md)
    average_state_every: int = 10  # parameter averaging every this many global steps; 0 = never
    # accepted for older run specs and ignored: a peer that missed a step always drops its
    # accumulation and fetches the state (no gradient outlives its parameters)
    state_lag_tolerance: int = 2
    subframe_elements: int = 1 << 20  # values per sub-frame when a part is streamed
    # 0: a step's averaged gradient is applied before the next step's compute starts (the step equals one
    # large batch exactly). 1: delayed parameter updates: step N+1's gradients are computed on the
    # parameters of step N while step N's gradients are averaged; the average is applied when step N+1
    # closes (one step of staleness, declared here so every peer follows the same rule).
    delay: int = 0
    # the most one peer is credited of a step's target while another peer takes part in the step: no peer
    # closes a step alone or outweighs the others then (1.0: no cap, for a run whose peers trust each other)
    max_peer_share: float = 0.5
    # local steps (DiLoCo): 1 = every step is averaged (the default). H > 1: a global step is one outer round
    # of H × target_batch_size samples over the run; each peer takes inner optimizer steps of
    # ``inner_batch_size`` samples (0: the micro-batch size) with the run's optimizer from the round's start
    # parameters, the peers average their pseudo-gradients (start minus end parameters, weighted by samples)
    # and every peer applies the same outer step: Nesterov SGD with ``outer_lr`` and ``outer_momentum``
    # "auto": the tracker chooses H for each round within [inner_steps_min, inner_steps_max] from the peers'
    # measured compute and averaging times, so that a round's averaging takes a small share of its time
    # (tracker/horizon.py); each step's H is recorded in the step history
    # (the least 16: with delay 1 smaller rounds trained worse per token, docs/run-spec.md)
    inner_steps: int | Literal["auto"] = 1
    inner_steps_min: int = 16
    inner_steps_max: int = 100
    inner_batch_size: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # how a group's vector is cut into its owners' parts: "upload", each owner's part in proportion to the
    # upload rate it measured in its last rounds (DeDLOC's bandwidth-proportional partitions: a slow uplink
    # owns less and is not the round's bottleneck); "equal", parts of one size
    part_sizes: Literal["upload", "equal"] = "upload"
    # spot-checks (docs/security.md): the probability that a step's group has one member's contribution
    # recomputed by another member (every-step mode with delay 0 and a codec that keeps every value; 0: never)
    spot_checks: float = 0.25

    # What a mode implies, read by the tracker and the volunteer alike: the one place the delay and the mode
    # are branched on outside the volunteer's cadence (volunteer/cadence.py) and its trainer's choice.

    @property
    def local(self) -> bool:
        """Local-steps mode: inner optimizer steps, an outer step per global step."""
        return self.auto_inner_steps or self.first_inner_steps > 1

    @property
    def auto_inner_steps(self) -> bool:
        """``inner_steps = "auto"``: the tracker chooses each round's H (tracker/horizon.py)."""
        return self.inner_steps == "auto"

    @property
    def first_inner_steps(self) -> int:
        """The H of a run's first rounds: ``inner_steps``, or AUTO_FIRST_INNER_STEPS within the bounds when
        chosen by the tracker (until a round's averaging was measured)."""
        if self.inner_steps == "auto":
            return min(max(AUTO_FIRST_INNER_STEPS, self.inner_steps_min), self.inner_steps_max)
        return self.inner_steps

    @property
    def computes_ahead(self) -> bool:
        """Delay 1: a peer done with its share of a step computes the next step's ahead, told how much."""
        return self.delay == 1

    @property
    def spares(self) -> bool:
        """Whether backup workers apply (docs/tracker.md): a step's rest is shared out once a peer falls behind.
        Delay 0 and one inner step: computing ahead and local rounds have their own slack."""
        return self.delay == 0 and not self.local

    @property
    def checkable(self) -> bool:
        """Whether spot-checks can run: a member's gradient recomputed on the parameters it was computed on
        (every-step mode, delay 0) and compared with the copy that arrived (a codec that keeps every value)."""
        return not self.local and self.delay == 0 and self.codec in CHECKABLE_CODECS

    @property
    def spot_checked(self) -> bool:
        """Whether this run draws spot-checks: asked for (``spot_checks`` > 0) and possible (:attr:`checkable`)."""
        return self.spot_checks > 0 and self.checkable

    def averages_params(self, step: int) -> bool:
        """Whether the round of ``step`` averages the parameters too (every ``average_state_every`` steps;
        never in local-steps mode: every peer ends an outer round with the same parameters). The one rule the
        tracker's assignments and a catching-up volunteer's fetches both follow."""
        every = 0 if self.local else self.average_state_every
        return every > 0 and (step + 1) % every == 0


# What a local-steps run (``inner_steps`` > 1 or "auto") gets where its spec's [averaging] table says nothing: the
# settings measured best for home links (docs/run-spec.md, "Local-steps defaults"): 2-bit updates sent while
# the next round computes (delay 1: a round's averaging hides behind the next one's compute, the compute share
# 0.9 a 2 Mbit/s uplink cannot give without it), with the class's outer step, DiLoCo's 0.7 / 0.9 (tiny-gpt,
# H = 30, 2M tokens: held-out 1.768 against 1.780 every-step int8 at 105x fewer bytes per token; with delay 1
# the outer 0.9 / 0.95 that is best without delay gave 1.944). Every-step runs keep every class default.
LOCAL_DEFAULTS: dict[str, object] = {"codec": "int2", "delay": 1}


def with_mode_defaults(averaging: dict[str, object]) -> dict[str, object]:
    """A run spec's [averaging] table with the local-steps defaults filled in where it gives none (its
    ``inner_steps`` > 1), and ``step_timeout_s`` that many times the default (a round covers ``inner_steps``
    steps' samples); any other table as it is."""
    h = averaging.get("inner_steps", 1)
    if h == "auto":  # (its rounds are as long as the largest H it may choose)
        h = averaging.get("inner_steps_max", AveragingSpec().inner_steps_max)
    if isinstance(h, bool) or not isinstance(h, int) or h <= 1:
        return averaging
    return {**LOCAL_DEFAULTS, "step_timeout_s": h * AveragingSpec().step_timeout_s, **averaging}


class ChunkInfo(Message, frozen=True, kw_only=True):
    name: str
    samples: int
    bytes: int
    sha256: str


class TokenizerInfo(Message, frozen=True, kw_only=True):
    """The tokenizer a tokens data set was cut with: ``tokenizer.json`` beside its chunks (Hugging Face
    ``tokenizers`` format). Its ids are the data set's token ids, all below ``vocab_size``."""

    sha256: Hex64  # of the file's bytes, exactly as written
    bytes: Annotated[int, Meta(ge=1, le=MAX_TOKENIZER_BYTES)]
    vocab_size: Annotated[int, Meta(ge=1, le=1 << 32)]  # the largest id + 1 (added tokens included)


class DatasetManifest(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    name: str
    kind: Literal["tokens", "arrays"]
    dtype: str  # tokens: the token dtype ("uint8" for byte-level); arrays: dtype of x
    sample_shape: list[int] = []  # arrays: shape of one x; tokens: []
    label_dtype: str | None = None  # arrays: dtype of y
    chunk_bytes: int  # the --chunk-size the set was cut with
    chunks: list[ChunkInfo]
    total_samples: int  # tokens: total tokens; arrays: total samples
    # a tokens set cut with a tokenizer (``dataset make --tokenizer``/``--train-bpe``). Absent, not null, when
    # there is none (UNSET is left out when encoded): manifests without one keep their bytes and info-hash,
    # and crowdtrain versions that know no tokenizer still read them.
    tokenizer: TokenizerInfo | UnsetType = UNSET


class DatasetRef(Message, frozen=True, kw_only=True):
    infohash: Hex40
    manifest: DatasetManifest
    web_seed: str | None = None


JoinPolicy = Literal["public", "token"]
MetricName = Annotated[str, Meta(pattern=r"^[A-Za-z][A-Za-z0-9_.-]{0,31}\Z")]  # (\Z: no final newline)
Metrics = Annotated[dict[MetricName, float], Meta(max_length=16)]  # a recipe's metrics, beside the loss


class EvalSpec(Message, frozen=True, kw_only=True):
    """The run's held-out split: the data set's last ``holdout_chunks`` chunks are never trained on; every
    ``every`` steps each volunteer evaluates the state on the same ``samples`` samples of them (drawn once
    with the run's seed) and reports the mean loss and the recipe's metrics in its heartbeat."""

    every: int = 0  # steps between evaluations; 0: no held-out split, no evaluation
    holdout_chunks: int = 1
    samples: int = 256


class EvalReport(Message, frozen=True, kw_only=True):
    """One volunteer's evaluation of the state after ``step`` steps, carried by its next heartbeat."""

    step: Count  # steps the evaluated state has taken (a multiple of ``eval.every``)
    loss: float
    metrics: Metrics = {}
    samples: Count


class EvalRecord(Message, frozen=True, kw_only=True):
    """The run's evaluation of the state after ``step`` steps: the mean of its volunteers' reports."""

    step: int
    loss: float
    metrics: dict[str, float] = {}
    reports: int  # volunteers whose reports make the mean


class RunSpec(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    run_id: str
    name: str
    model: ModelSpec
    dataset: DatasetRef
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    target_batch_size: int  # samples per global step, summed over all volunteers
    micro_batch_size: int = 8
    averaging: AveragingSpec = AveragingSpec()
    eval: EvalSpec = EvalSpec()
    join_policy: JoinPolicy = "public"
    tracker_public_key: str  # hex Ed25519 key that signs credentials and group assignments
    seed: int = 0
    created_at: float = 0.0


class RunCreate(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    name: str
    model: ModelSpec
    dataset: DatasetRef
    torrent: str  # base64 of the data set's .torrent file
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    target_batch_size: int
    micro_batch_size: int = 8
    averaging: AveragingSpec = AveragingSpec()
    eval: EvalSpec = EvalSpec()
    join_policy: JoinPolicy = "public"
    join_token: str | None = None  # required when join_policy is "token"
    seed: int = 0
    # base64 of the data set's tokenizer.json, when its manifest names one (the tracker checks its sha256
    # and serves it at GET /api/v1/runs/{id}/tokenizer). Absent, not null, when there is none.
    tokenizer: Annotated[str, Meta(max_length=MAX_TOKENIZER_BASE64)] | UnsetType = UNSET


class RunCreated(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    run_id: str
    spec: RunSpec


class RunSummary(Message, frozen=True, kw_only=True):
    run_id: str
    name: str
    global_step: int
    peers_online: int
    created_at: float
    closed_at: float | None = None  # its admin closed it: it takes no more steps


class RunList(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    runs: list[RunSummary]


# ---------------------------------------------------------------- volunteers


class Credential(Message, frozen=True, kw_only=True):
    """The tracker's signed statement: ``peer_id`` in ``run_id`` holds the Ed25519 key ``public_key``."""

    run_id: str
    peer_id: str
    public_key: str  # hex, the peer's own Ed25519 public key; it signs the peer's requests to other peers
    expires_at: float  # unix seconds
    signature: str  # hex, by the tracker's key over the fields above


class JoinRequest(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    public_key: Hex64
    # "host:port" of the peer server; ":port" = "at the address you see this request come from" (the
    # default, as BitTorrent trackers do); None = client mode (behind NAT)
    address: str | None = None
    token: str | None = None
    device: Label = "cpu"
    client_version: Label = ""
    peer_protocol: int = 1


class JoinResponse(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    peer_id: str
    credential: Credential
    global_step: int
    heartbeat_interval_s: float
    peer_ttl_s: float
    # hex HMAC key for the peer's requests to the tracker (cheaper than an Ed25519 signature per heartbeat);
    # only the tracker and this peer know it. None: sign tracker requests with the Ed25519 key.
    session_key: str | None = None
    # where the tracker saw this request come from: the host a ":port" address stands for
    observed_host: str | None = None


class StateVersion(Message, frozen=True, kw_only=True):
    step: Count
    content_hash: Hex64  # sha256 of the whole snapshot
    size: Annotated[int, Meta(ge=0, le=1 << 42)]


class Heartbeat(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    peer_id: str
    step: Count  # the global step this peer is accumulating for
    samples: Count  # samples accumulated toward ``step``
    samples_per_s: Rate
    address: str | None = None  # as in JoinRequest
    chunks_held: Count = 0
    loss: float | None = None
    bt_port: Port | None = None  # the port its BitTorrent session listens on (the tracker checks it)
    computing: bool = True  # False: what it computes does not count now (catching up, or no chunk yet)
    # a backbone peer (join --backbone): computes no gradients; it averages, serves the state and the data set
    backbone: bool = False
    # share of its wall time (since its first micro-batch) spent computing gradients that entered an average
    compute_share: Annotated[float, Meta(ge=0, le=1000)] | None = None
    eval: EvalReport | None = None  # its evaluation of the held-out split, once per evaluated step
    # bytes per second its all-reduce rounds went out at lately (None: no round yet): the tracker sizes the
    # parts it owns by it (AveragingSpec.part_sizes)
    upload_bps: Annotated[float, Meta(ge=0, le=1e12)] | None = None
    # seconds its last step's averaging took, from its gradient handed over to the mean in hand (None: none
    # yet): with inner_steps = "auto" the tracker sizes the next rounds by it (tracker/horizon.py)
    averaging_s: Annotated[float, Meta(ge=0, le=86_400)] | None = None


class InnerSteps(Message, frozen=True, kw_only=True):
    """The inner steps of a local-steps run around global step ``step`` (tracker/horizon.py): its round's H,
    the inner steps of all steps before it, and the H of the step before it (0 at step 0)."""

    step: Count
    h: Annotated[int, Meta(ge=1, le=100_000)]
    before: Annotated[int, Meta(ge=0, le=1 << 53)]
    previous: Annotated[int, Meta(ge=0, le=100_000)] = 0


class HeartbeatReply(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    global_step: int
    samples: int  # run-wide samples toward the target of ``global_step``
    target: int
    peers_online: int
    samples_per_s: float  # run-wide
    eta_s: float | None
    step_closed: bool  # the target of ``global_step`` is reached; peers should say "ready"
    reachable: bool  # the tracker could connect to this peer's declared address
    address: str | None = None  # the address the tracker reaches this peer at (None: client mode)
    checked: bool = False  # a reachability check of ``address`` finished (``reachable`` is its answer)
    bt_address: str | None = None  # where the tracker tried this peer's BitTorrent port
    bt_reachable: bool | None = None  # None: not checked (yet)
    notice: str | None = None  # a run-wide problem, in one sentence, e.g. no reachable volunteer
    # how many samples this peer may accumulate for ``global_step``: its share of the target, by rate
    # (tracker/collab.py, RunState._allot); None while the step is closed or the peer is not at it
    allotment: int | None = None
    # delay 1: how many samples this peer may compute ahead for the next step once done with this one: its
    # share of a step by rate, room left for peers of unknown rate (RunState.ahead_share); None: unknown
    ahead_share: int | None = None
    # local steps: the open step's H, the inner steps of the steps before it (where its round's inner learning
    # rates start on the schedule) and the step before's H (tracker/horizon.py); None: an every-step run
    inner: InnerSteps | None = None


class StepWatch(Message, frozen=True, kw_only=True):
    """The answer to ``GET .../step?step=N`` (a long-poll): returned as soon as step N closed or the run
    moved past it, so every volunteer hears of a close within a round trip, not a heartbeat interval; and
    as soon as samples of open step N were freed (``free``), so a volunteer at its allotment hears of a
    larger share without polling for it."""

    version: Version = VERSION
    global_step: int
    step_closed: bool  # the target of ``global_step`` is reached
    # samples of the open step's target that no peer holds or was allotted, when some were freed while the
    # watch waited (a peer left, or stopped computing): a peer at its allotment heartbeats for a share of
    # them (None: nothing was freed, or a tracker that does not say)
    free: int | None = None


class LeaveRequest(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    peer_id: str
    # the state it kept on leaving (in its data folder): the tracker vouches for its content hash, so the peer
    # serves it when it joins again under a new identity (see the tracker's donor rule)
    kept: StateVersion | None = None


class ReadyRequest(Message, frozen=True, kw_only=True):
    """A long-poll: "I am ready to average step ``step`` with this weight"."""

    version: Version = VERSION
    peer_id: str
    step: Count
    weight: Count  # samples accumulated toward ``step``; 0 is allowed (the peer still gets the average)
    # delay 1: samples already computed toward ``step + 1`` (while waiting for ``step`` to close), no more
    # than its ``ahead_share``
    ahead: Count = 0


class GroupMember(Message, frozen=True, kw_only=True):
    peer_id: str
    address: str | None  # None: client mode, owns no part
    public_key: str
    weight: int
    part: int  # index of the part this member reduces, -1 for none


class GroupAssignment(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    run_id: str
    round_id: str
    step: int
    members: list[GroupMember]
    parts: int  # number of parts the flat vector is cut into (= members that own one)
    average_params: bool  # after the optimizer step, average parameters in the same group
    deadline: float  # unix seconds; the round is over at this time whatever happened
    seed: int  # the seed the tracker drew this partition with (recorded in the step history)
    phase: int = 0  # which phase of the step's all-reduce (tracker/matchmaking.py: plan)
    phases: int = 1  # how many phases the step's all-reduce has: after the last, everyone holds one mean
    # in a later phase, the cluster whose columns this group is one of (tracker/matchmaking.py): a part that
    # fails in one column is left out by every column of the cluster (tracker/verdicts.py)
    cluster: int = 0
    step_samples: int = 0  # the samples of every ready peer of the step: what the mean stands for
    # hex, the tracker's Ed25519 signature over the root of the step's assignments (protocol/credentials.py)
    signature: str
    # this assignment's path to that root: per level, ``l`` or ``r`` (which side its sibling is on) and the
    # sibling's SHA-256 in hex; 32 levels hold 4 billion assignments
    proof: Annotated[list[Annotated[str, Meta(pattern=MERKLE_STEP, max_length=65)]], Meta(max_length=32)] = []
    # part i's share of the vector is part_weights[i] / their sum (one per part); empty: parts of equal size
    part_weights: Annotated[list[Annotated[int, Meta(ge=1, le=1 << 20)]], Meta(max_length=256)] = []


def round_tag(kind: str, phase: int) -> str:
    """The tag a step's round of ``kind`` (``grad`` or ``params``) runs under in ``phase``: ``grad``,
    ``grad-p1``, ... (its key on the peers is ``{round_id}/{tag}``; a cut call names one of them)."""
    return kind if phase == 0 else f"{kind}-p{phase}"


class ReadyReply(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    status: Literal["group", "wait", "missed", "open"]
    # group: ``assignment`` is yours. wait: the step is not closed yet, call again.
    # missed: the step closed without you; keep your accumulation and carry it into ``global_step``.
    # open: no group could be formed (no reachable peer was ready); the step is open again: keep
    # accumulating and call again when a heartbeat says it closed.
    global_step: int
    assignment: GroupAssignment | None = None  # the first phase this peer is in
    later_phases: list[GroupAssignment] = []  # its groups in the later phases, in order
    retry_after_s: float = 0.0
    # group: this peer's allotment of the next step (its share of the target by rate), so it computes
    # on without waiting for a heartbeat's answer
    next_allotment: int | None = None
    # group: recompute this member's contribution to the part you own in phase 0 and report the verdict
    spot_check: SpotCheck | None = None
    # group, local steps: the inner steps around ``global_step`` (as a heartbeat's reply)
    inner: InnerSteps | None = None


# ---------------------------------------------------------------- cutting a sleeper from a round


class CutCall(Message, frozen=True, kw_only=True):
    """``POST /api/v1/runs/{id}/cut``: a member of a round about the owner of a part of it.

    From another member (a vote): ``owner``'s answer has not begun although the round has been quiet for a
    while; cut it if every other member says so. From ``owner`` itself (a claim), sent once its answer went
    out: may it apply what it reduced? The tracker decides each (round, tag, owner) once: ``cut`` when every
    other member voted before the owner claimed, ``kept`` otherwise (also at the round's deadline)."""

    version: Version = VERSION
    peer_id: PeerId  # the caller
    assignment: GroupAssignment  # the round, as the tracker signed it
    tag: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,200}$")]  # grad, params, grad-p1, ...
    owner: PeerId


class CutVerdict(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    decision: Literal["cut", "kept"]


# ---------------------------------------------------------------- spot-checks

MAX_CHECKED_SAMPLES = 1 << 16  # samples one spot-check answer may list


class SpotCheck(Message, frozen=True, kw_only=True):
    """The tracker's request to a part owner of a step's first phase: recompute ``suspect``'s gradient of
    ``step`` from the samples it says it used, at the step's parameters, and compare with its copy of your
    part. Only the checker is told (in its own ready reply), after the suspect's gradient was computed."""

    step: Count
    suspect: PeerId


class SpotCheckAnswer(Message, frozen=True, kw_only=True):
    """``GET /v1/spotcheck/{step}`` on a volunteer's peer server: the micro-batches of its gradient of
    ``step``, each a list of (chunk index, offset) samples in order, and the sum of their mean losses × n."""

    version: Version = VERSION
    step: Count
    batches: Annotated[
        list[Annotated[list[tuple[Count, Count]], Meta(min_length=1, max_length=MAX_CHECKED_SAMPLES)]],
        Meta(max_length=MAX_CHECKED_SAMPLES),
    ]
    loss_sum: float  # Σ over its micro-batches of n × mean loss


SpotOutcome = Literal["match", "mismatch", "unanswered", "unverifiable"]


class SpotCheckVerdict(Message, frozen=True, kw_only=True):
    """``POST /api/v1/runs/{id}/spotcheck``: what a checker found."""

    version: Version = VERSION
    peer_id: PeerId  # the checker
    step: Count
    suspect: PeerId
    outcome: SpotOutcome
    detail: Label = ""  # the figures behind it, in a few words


class Complaint(Message, frozen=True, kw_only=True):
    """``POST /api/v1/runs/{id}/complaint``: a member of a round whose part owner answered with a receipt
    that does not hold (protocol/receipts.py). The tracker checks the receipt's own arithmetic: broken, it
    bars the owner's key at once (the receipt, signed by the owner, is the proof); else it counts an
    accusation, one per accusing address, as it counts failed spot-checks."""

    version: Version = VERSION
    peer_id: PeerId  # the member complaining
    assignment: GroupAssignment  # the round, as the tracker signed it
    tag: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,200}$")]  # grad, params, grad-p1, ...
    owner: PeerId
    receipt: Annotated[
        str, Meta(pattern=r"^[0-9a-f]*$", max_length=2 * (100 + 28 * 256))
    ]  # hex, &le; 256 members
    why: Annotated[str, Meta(max_length=300)]  # what the member found, in its words


class ComplaintReply(Message, frozen=True, kw_only=True):
    """What the tracker made of a :class:`Complaint`: the owner ``barred`` (on proof, or at its second
    accuser), ``already barred``, or ``accused`` (counted)."""

    version: Version = VERSION
    outcome: Literal["barred", "already barred", "accused"]
    proven: bool  # the receipt alone showed it


class PullReport(Message, frozen=True, kw_only=True):
    """``POST /api/v1/runs/{id}/pull``: a member of a round's first phase whose part owners' signed receipts
    show another member's copy pointing against the others' terms (protocol/receipts.py, :func:`alignment`
    below :data:`PULL_COS`). The receipts are those of the parts owned by neither the reporter nor the
    accused; the tracker checks their signatures and recomputes the cosine, and bars a key reported so in
    enough rounds by enough reporters (tracker/pulls.py)."""

    version: Version = VERSION
    peer_id: PeerId  # the member reporting
    assignment: GroupAssignment  # the round, as the tracker signed it
    tag: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,200}$")]  # the first phase's grad tag
    member: PeerId  # the member whose copy pulls
    receipts: Annotated[
        list[Annotated[str, Meta(pattern=r"^[0-9a-f]*$", max_length=2 * (100 + 28 * 256))]],
        Meta(min_length=1, max_length=256),
    ]  # hex, one per part


class PullReply(Message, frozen=True, kw_only=True):
    """What the tracker made of a :class:`PullReport`: the member ``barred`` (at the report that completes
    the rule), ``already barred``, or ``counted``; ``alignment`` is the cosine it recomputed."""

    version: Version = VERSION
    outcome: Literal["barred", "already barred", "counted"]
    alignment: float


class RoundVerdict(Message, frozen=True, kw_only=True):
    """``POST /api/v1/runs/{id}/verdicts``: the parts of a round this member could not apply (an answer that
    failed its receipt, or never came); answered with every member's (tracker/verdicts.py)."""

    version: Version = VERSION
    peer_id: PeerId
    assignment: GroupAssignment  # the round, as the tracker signed it
    tag: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,200}$")]
    failed: Annotated[list[Annotated[int, Meta(ge=0, le=255)]], Meta(max_length=256)]
    # a parameter round's later phase: this member's input is not the mean (it lost a part before)
    spoiled: bool = False


class ColumnParts(Message, frozen=True, kw_only=True):
    """Another column's failed parts, with how that column cuts the vector (``parts``, ``part_weights``: as
    in its :class:`GroupAssignment`), so a member can zero the same values."""

    parts: int
    part_weights: list[int] = []
    failed: list[int]


class RoundVerdicts(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    failed: list[int]  # the union of the members' failed parts
    reported: int  # members that had reported when it was given
    # this member's failed parts that other members were told to apply (its report came after the union was
    # given out): its mean is not theirs, so it takes the run's state instead
    late: list[int] = []
    # a later phase: the other columns of the cluster that lost parts; every member zeroes those values too
    elsewhere: list[ColumnParts] = []
    spoiled: bool = (
        False  # a member's input to a parameter round was not the mean: every member keeps its own
    )


# ---------------------------------------------------------------- state directory


MAX_DECLARED_STATES = 4  # snapshots one peer may declare at once (its newest and the older it still serves)


class StateDeclare(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    peer_id: str
    state: StateVersion  # its newest snapshot
    # older snapshots it still serves (at most MAX_DECLARED_STATES - 1): peers that snapshot the same steps a
    # little apart in time still back one version together
    older: Annotated[list[StateVersion], Meta(max_length=MAX_DECLARED_STATES - 1)] = []


class Donor(Message, frozen=True, kw_only=True):
    peer_id: str
    address: str
    public_key: str


class DonorList(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    state: StateVersion | None
    donors: list[Donor]
    # peers serving some state of the run, listed or not, that train (a weight in its newest steps; all of
    # them when none does): how many must agree on a state (at most 2) is counted among these
    serving: int = 0
    # when ``state`` is None although ``serving`` > 0: why none is listed (wait and ask again)
    reason: str | None = None
    # the other reachable peers serving some state of the run, newest state first: a peer that missed a few
    # steps asks them, with ``donors``, for those steps' averages (volunteer/averaging/averages.py)
    peers: list[Donor] = []


class StateManifest(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    run_id: str
    step: int
    content_hash: str
    total_bytes: int
    range_bytes: int
    range_sha256: list[str]


# ---------------------------------------------------------------- status


class PeerStatus(Message, frozen=True, kw_only=True):
    peer_id: str
    step: int
    samples: int
    samples_per_s: float
    client_mode: bool
    chunks_held: int
    loss: float | None = None
    address: str | None = None  # where the tracker reaches its peer server; None: client mode
    reachable: bool = False  # the tracker's last check of ``address`` answered
    bt_reachable: bool | None = None  # its BitTorrent port accepted a connection; None: not checked
    compute_share: float | None = None  # as its last heartbeat said (see Heartbeat.compute_share)
    backbone: bool = False  # computes no gradients: averages, serves the state and the data set
    upload_bps: float | None = None  # as its last heartbeat said: the rate its answers went out at (bytes/s)


class StepRecord(Message, frozen=True, kw_only=True):
    step: int
    closed_at: float
    duration_s: float
    samples: int
    peers: int
    groups: int
    seed: int
    loss: float | None = None  # the averaged peers' training loss, weighted by their samples
    inner_steps: int = 1  # its round's H (local steps; chosen by the tracker with inner_steps = "auto")


class StepHistory(Message, frozen=True, kw_only=True):
    """``GET /api/v1/runs/{id}/history``: the newest closed steps, oldest first (for curves)."""

    version: Version = VERSION
    steps: list[StepRecord]
    evals: list[EvalRecord] = []  # the held-out evaluations of those steps' states, oldest first


class CreditRecord(Message, frozen=True, kw_only=True):
    """One identity's credit in a run (the tracker's credit ledger, durable): what of its work entered an
    average, by its public key (a peer id is new at every join; the key is the volunteer's own)."""

    public_key: Hex64
    samples: Count  # samples of its that entered the steps' averages (the weight it was credited with)
    steps: Count  # steps it was averaged in (a backbone's, at weight 0, count too)
    last_step: Count  # the newest of them
    verified: Count = 0  # spot-checks its contributions passed
    rejected: Count = 0  # spot-checks they failed, and receipts accused (each from a distinct address)
    barred: Annotated[str, Meta(max_length=400)] = ""  # why the key is barred (proof, or failed spot-checks)


class RunStatus(Message, frozen=True, kw_only=True):
    version: Version = VERSION
    run_id: str
    name: str
    global_step: int
    samples: int
    target: int
    eta_s: float | None
    peers_online: int
    samples_per_s: float
    peers: list[PeerStatus]
    recent_steps: list[StepRecord]
    notice: str | None = None  # a run-wide problem, in one sentence (as in HeartbeatReply)
    closed_at: float | None = None  # its admin closed it: it takes no more steps
    # the data set's BitTorrent swarm as this tracker's /announce sees it
    swarm_seeds: int = 0
    swarm_peers: int = 0
    evals: list[EvalRecord] = []  # the newest held-out evaluations, newest first (see EvalSpec)
    # the run's averaging mode: inner steps per global step (1: every step averages a gradient; H > 1: local
    # steps, a global step is an outer round of H inner steps per volunteer; the open step's H) and its codec
    inner_steps: int = 1
    inner_auto: bool = False  # inner_steps = "auto": the tracker chooses each round's H (see recent_steps)
    codec: CodecName | None = None
    credits: list[CreditRecord] = []  # the credit ledger's leaders, most samples first
    # the run as a whole: the steps its schedule spans, and the time to reach them at the recent steps' pace
    # (None: fewer than two steps closed yet; 0: reached)
    total_steps: int = 0
    run_eta_s: float | None = None
    spot_checked: bool = (
        False  # the run draws spot-checks (AveragingSpec.spot_checked): their figures mean something
    )

    @property
    def progress(self) -> float | None:
        """The share of the schedule's steps taken."""
        return min(1.0, self.global_step / self.total_steps) if self.total_steps > 0 else None


def run_eta(global_step: int, total_steps: int, recent: list[StepRecord]) -> float | None:
    """Seconds until ``total_steps`` at the pace of the ``recent`` steps (their closes' mean spacing); None when
    fewer than two closed, 0 when reached."""
    if global_step >= total_steps:
        return 0.0
    closes = sorted(r.closed_at for r in recent)
    if len(closes) < 2 or closes[-1] <= closes[0]:
        return None
    return (total_steps - global_step) * (closes[-1] - closes[0]) / (len(closes) - 1)


class ErrorBody(Message, frozen=True, kw_only=True):
    error: str


# ---------------------------------------------------------------- codec

M = TypeVar("M", bound=Message)
_encoder = msgspec.json.Encoder()


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def to_builtins(msg: Message) -> Any:
    return msgspec.to_builtins(msg)


def decode(data: bytes | str, kind: type[M], limits: Limits = DEFAULT_LIMITS) -> M:
    """Strictly decode one message; any defect becomes a :class:`ProtocolError` naming the field."""
    if len(data) > limits.max_json_bytes:
        raise LimitExceeded(
            f"{kind.__name__} message is {len(data)} bytes, more than the limit of {limits.max_json_bytes}"
        )
    try:
        return msgspec.json.decode(data, type=kind, strict=True)
    except msgspec.ValidationError as exc:
        raise _invalid(kind, exc) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # the latter: bad UTF-8 inside a key
        raise ProtocolError(f"{kind.__name__} is not valid JSON: {exc}") from None


def convert(obj: Any, kind: type[M]) -> M:
    """Validate already-parsed data (e.g. a TOML spec file) into a message."""
    try:
        return msgspec.convert(obj, type=kind, strict=True)
    except msgspec.ValidationError as exc:
        raise _invalid(kind, exc) from None


def _invalid(kind: type[Message], exc: msgspec.ValidationError) -> ProtocolError:
    text = str(exc)
    for pattern, words in _PATTERN_WORDS.items():
        text = text.replace(f"matching regex {pattern!r}", f"of {words}")
    return ProtocolError(f"{kind.__name__}: {text}")


def replace(msg: M, **changes: Any) -> M:
    return msgspec.structs.replace(msg, **changes)


# ---------------------------------------------------------------- tracker administration


class DatasetRegistration(Message, frozen=True, kw_only=True):
    """publisher → tracker (admin): serve BitTorrent announces for this info-hash."""

    version: Version = VERSION
    infohash: Hex40
    name: Annotated[str, Meta(min_length=1, max_length=200)]
