"""What makes a run spec one a volunteer can run: one check shared by ``run create``, the tracker (before it
registers a run) and the volunteer (before it joins one). Every problem is a :class:`ConfigError` naming the
field, e.g. ``averaging.zstd_level: must be between -7 and 22, got 1000``.

The recipe's own arguments are checked where the recipe is installed (``run create`` computes the
parameter hash from them; a volunteer builds the model); the tracker cannot import recipes (no torch).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
import unicodedata

from crowdtrain.protocol.errors import ConfigError
from crowdtrain.protocol.limits import DEFAULT_LIMITS, MAX_TOKENIZER_BYTES
from crowdtrain.protocol.messages import (
    HEX64,
    AveragingSpec,
    DatasetManifest,
    OptimizerSpec,
    RunCreate,
    RunSpec,
    ScheduleSpec,
    TokenizerInfo,
)

MAX_INT = 1 << 53  # whole numbers every JSON reader holds exactly
MAX_GROUP_SIZE = 256  # the averager's max_members
MAX_MICRO_BATCH = 1 << 20
MAX_MODEL_ARG = (1 << 31) - 1
# a recipe is a name in the built-in recipes or an entry point: never a path
MAX_LR = 10.0  # a learning rate above this diverges at once: a typo (1e300), not a choice
MIN_WAIT_S = 0.01  # the shortest round, gather or step timeout: below it nothing can answer in time
RECIPE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:-]{0,199}$")
# a chunk is a file in the data set's folder: a plain name, never a path
CHUNK_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
DTYPES = {
    "uint8",
    "uint16",
    "uint32",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "bool",
}


# control characters (NUL, ESC, CR, LF…), format characters (U+202E and the other bidi overrides), line and
# paragraph separators, surrogates and private use: none belongs in a name a terminal or a log shows
_UNPRINTABLE = {"Cc", "Cf", "Cs", "Co", "Zl", "Zp"}


def check_text(field: str, value: str, longest: int = 200) -> None:
    """A name people read in logs and terminals: 1 to ``longest`` characters, none that moves the cursor,
    ends a line, reverses the text or is invisible."""
    if not value or len(value) > longest:
        raise ConfigError(field, f"must be 1 to {longest} characters long")
    for ch in value:
        if unicodedata.category(ch) in _UNPRINTABLE:
            raise ConfigError(
                field, f"must be printable text; it holds the control character U+{ord(ch):04X}"
            )


def printable(text: str) -> str:
    """``text`` with every character :func:`check_text` refuses written as an escape (``\\x1b``,
    ``\\u202e``): for showing a string a tracker of an earlier version stored unchecked."""
    return "".join(ch if unicodedata.category(ch) not in _UNPRINTABLE else ascii(ch)[1:-1] for ch in text)


def _int(field: str, value: int, low: int, high: int = MAX_INT) -> None:
    if not low <= value <= high:
        span = f"at least {low}" if high == MAX_INT else f"between {low} and {high}"
        raise ConfigError(field, f"must be {span}, got {value}")


def _positive(field: str, value: float, high: float = math.inf) -> None:
    if not (math.isfinite(value) and 0 < value <= high):
        raise ConfigError(
            field, f"must be a positive number{'' if high == math.inf else f' up to {high:g}'}, got {value}"
        )


def check_optimizer(spec: OptimizerSpec) -> None:
    checks = [
        ("lr", spec.lr, 0 < spec.lr <= MAX_LR),
        ("weight_decay", spec.weight_decay, spec.weight_decay >= 0),
        ("beta1", spec.beta1, 0 <= spec.beta1 < 1),
        ("beta2", spec.beta2, 0 <= spec.beta2 < 1),
        ("eps", spec.eps, spec.eps > 0),
        ("momentum", spec.momentum, 0 <= spec.momentum < 1),
        ("grad_clip", spec.grad_clip, spec.grad_clip >= 0),
    ]
    for name, value, ok in checks:
        if not (math.isfinite(value) and ok):
            bound = f" (a learning rate is above 0 and at most {MAX_LR:g})" if name == "lr" else ""
            raise ConfigError(f"optimizer.{name}", f"value {value!r} is out of range{bound}")


def check_schedule(schedule: ScheduleSpec) -> None:
    _int("schedule.total_steps", schedule.total_steps, 1)
    _int("schedule.warmup_steps", schedule.warmup_steps, 0)
    if not (0.0 <= schedule.min_lr_ratio <= 1.0):
        raise ConfigError("schedule.min_lr_ratio", f"must be within [0, 1], got {schedule.min_lr_ratio!r}")


def check_averaging(avg: AveragingSpec) -> None:
    _int("averaging.group_size", avg.group_size, 2, MAX_GROUP_SIZE)
    _int("averaging.min_group_size", avg.min_group_size, 1, MAX_GROUP_SIZE)
    _int("averaging.average_state_every", avg.average_state_every, 0)
    _int("averaging.zstd_level", avg.zstd_level, -7, 22)
    _int("averaging.subframe_elements", avg.subframe_elements, 1, DEFAULT_LIMITS.max_elements)
    _int("averaging.delay", avg.delay, 0, 1)
    _int("averaging.state_lag_tolerance", avg.state_lag_tolerance, 0)
    for name in ("round_timeout_s", "gather_s", "step_timeout_s"):
        _positive(f"averaging.{name}", getattr(avg, name), 86400.0)
        if getattr(avg, name) < MIN_WAIT_S:
            raise ConfigError(
                f"averaging.{name}", f"must be at least {MIN_WAIT_S} s, got {getattr(avg, name)!r}"
            )
    share = avg.max_peer_share
    if not (math.isfinite(share) and 0 < share <= 1):
        raise ConfigError("averaging.max_peer_share", f"must be above 0 and at most 1, got {share}")
    clip = avg.clip_multiple
    if not (math.isfinite(clip) and (clip == 0 or clip >= 1)):
        raise ConfigError("averaging.clip_multiple", f"must be 0 (no clipping) or a number ≥ 1, got {clip}")
    if not (math.isfinite(avg.spot_checks) and 0 <= avg.spot_checks <= 1):
        raise ConfigError(
            "averaging.spot_checks", f"must be a probability from 0 to 1, got {avg.spot_checks}"
        )
    check_local_steps(avg)


def check_local_steps(avg: AveragingSpec) -> None:
    """The local-steps options: whole numbers in range, an outer step that moves and a momentum below 1."""
    if avg.inner_steps == "auto":
        _int("averaging.inner_steps_min", avg.inner_steps_min, 2, 100_000)
        _int("averaging.inner_steps_max", avg.inner_steps_max, avg.inner_steps_min, 100_000)
    else:
        _int("averaging.inner_steps", avg.inner_steps, 1, 100_000)
    _int("averaging.inner_batch_size", avg.inner_batch_size, 0, 1 << 24)
    if not (math.isfinite(avg.outer_lr) and 0 < avg.outer_lr <= 10):
        raise ConfigError("averaging.outer_lr", f"must be above 0 and at most 10, got {avg.outer_lr}")
    if not (math.isfinite(avg.outer_momentum) and 0 <= avg.outer_momentum < 1):
        raise ConfigError(
            "averaging.outer_momentum", f"must be at least 0 and below 1, got {avg.outer_momentum}"
        )


def check_manifest(m: DatasetManifest, field: str = "dataset.manifest") -> None:
    if m.kind == "tokens" and m.dtype not in ("uint8", "uint16", "uint32"):
        raise ConfigError(f"{field}.dtype", f"tokens must be uint8, uint16 or uint32, got {m.dtype!r}")
    if m.dtype not in DTYPES or (m.label_dtype is not None and m.label_dtype not in DTYPES):
        raise ConfigError(f"{field}.dtype", f"must be one of {', '.join(sorted(DTYPES))}")
    if len(m.sample_shape) > 8 or any(not 1 <= d <= 1 << 24 for d in m.sample_shape):
        raise ConfigError(f"{field}.sample_shape", "must be at most 8 dimensions of 1 to 16,777,216 each")
    _int(f"{field}.chunk_bytes", m.chunk_bytes, 1, 1 << 32)
    if not 1 <= len(m.chunks) <= 1 << 20:
        raise ConfigError(f"{field}.chunks", f"must list 1 to 1,048,576 chunks, got {len(m.chunks)}")
    names = set()
    samples = 0
    for i, c in enumerate(m.chunks):
        where = f"{field}.chunks[{i}]"
        if not CHUNK_NAME.fullmatch(c.name) or ".." in c.name:
            raise ConfigError(
                f"{where}.name", f"{c.name[:80]!r} is not a plain file name (letters, digits, '.', '_', '-')"
            )
        if c.name in names:
            raise ConfigError(f"{where}.name", f"{c.name!r} is listed twice")
        names.add(c.name)
        _int(f"{where}.samples", c.samples, 1)
        _int(f"{where}.bytes", c.bytes, 1, 1 << 40)
        if not HEX64.fullmatch(c.sha256):
            raise ConfigError(f"{where}.sha256", "must be 64 lowercase hex digits")
        samples += c.samples
    _int(f"{field}.total_samples", m.total_samples, 1)
    if m.kind == "arrays" and m.total_samples != samples:
        raise ConfigError(f"{field}.total_samples", f"is {m.total_samples} but the chunks hold {samples}")
    if isinstance(m.tokenizer, TokenizerInfo):
        check_tokenizer_info(m, m.tokenizer, f"{field}.tokenizer")


TOKEN_IDS = {"uint8": 1 << 8, "uint16": 1 << 16, "uint32": 1 << 32}  # ids a token dtype holds


def check_tokenizer_info(m: DatasetManifest, info: TokenizerInfo, field: str) -> None:
    """A tokenizer belongs to a tokens set whose dtype holds every id of its vocabulary."""
    if m.kind != "tokens":
        raise ConfigError(field, "belongs to a tokens data set only, not an arrays one")
    _int(f"{field}.bytes", info.bytes, 1, MAX_TOKENIZER_BYTES)
    held = TOKEN_IDS.get(m.dtype, 0)
    if not 1 <= info.vocab_size <= held:
        raise ConfigError(
            f"{field}.vocab_size", f"is {info.vocab_size}, but {m.dtype} tokens hold ids 0 to {held - 1}"
        )


def tokenizer_bytes(msg: RunCreate) -> bytes | None:
    """The tokenizer a RunCreate carries (base64), checked against the one its manifest names (size and
    sha256); None when neither names one. The tracker's check before it stores and serves it."""
    info = msg.dataset.manifest.tokenizer
    if not isinstance(msg.tokenizer, str):
        if isinstance(info, TokenizerInfo):
            raise ConfigError(
                "tokenizer",
                "is missing, but dataset.manifest.tokenizer names one; `run create` sends the data set's "
                "tokenizer.json",
            )
        return None
    if not isinstance(info, TokenizerInfo):
        raise ConfigError("tokenizer", "is sent, but dataset.manifest.tokenizer names none")
    try:
        data = base64.b64decode(msg.tokenizer, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("tokenizer", "is not valid base64") from None
    if len(data) != info.bytes:
        raise ConfigError(
            "tokenizer", f"is {len(data)} bytes, but dataset.manifest.tokenizer says {info.bytes}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise ConfigError(
            "tokenizer",
            f"has sha256 {digest}, but dataset.manifest.tokenizer names {info.sha256}; it is not the "
            "tokenizer the data set was made with",
        )
    return data


def check_run(msg: RunCreate | RunSpec) -> None:
    """Raise :class:`ConfigError` naming the first field that makes ``msg`` a run no volunteer can run."""
    check_text("name", msg.name)
    check_text("model.recipe", msg.model.recipe)
    if not RECIPE_NAME.fullmatch(msg.model.recipe):
        raise ConfigError(
            "model.recipe",
            f"{msg.model.recipe[:80]!r} is not a recipe name (letters, digits, '.', '_', '-', ':')",
        )
    if msg.model.package:
        check_text("model.package", msg.model.package, 200)
    if len(msg.model.args) > 100:
        raise ConfigError("model.args", f"holds {len(msg.model.args)} arguments; at most 100")
    for key, value in msg.model.args.items():
        check_text("model.args", key, 100)
        where = f"model.args.{key}"
        if isinstance(value, str):
            check_text(where, value, 1000)
        elif isinstance(value, bool):
            pass
        elif isinstance(value, int):
            # the recipe checks its own ranges where it is installed; no model argument is this large
            _int(where, value, -MAX_MODEL_ARG, MAX_MODEL_ARG)
        elif not math.isfinite(value):
            raise ConfigError(where, f"must be a finite number, got {value}")
    check_text("dataset.manifest.name", msg.dataset.manifest.name)
    _int("target_batch_size", msg.target_batch_size, 1)
    _int("micro_batch_size", msg.micro_batch_size, 1, MAX_MICRO_BATCH)
    _int("seed", msg.seed, 0)
    check_optimizer(msg.optimizer)
    check_schedule(msg.schedule)
    check_averaging(msg.averaging)
    check_eval(msg)
    web_seed = msg.dataset.web_seed
    if web_seed is not None and not re.match(r"^https?://[^\s/]+", web_seed):
        raise ConfigError("dataset.web_seed", f"must be an http:// or https:// URL, got {web_seed[:80]!r}")
    check_manifest(msg.dataset.manifest)
    if isinstance(msg, RunCreate) and isinstance(msg.tokenizer, str) != isinstance(
        msg.dataset.manifest.tokenizer, TokenizerInfo
    ):
        tokenizer_bytes(msg)  # (says which of the two is missing)


MAX_EVAL_SAMPLES = 1 << 16


def check_eval(msg: RunCreate | RunSpec) -> None:
    """A held-out split must leave chunks to train on; its evaluation must be bounded."""
    spec = msg.eval
    _int("eval.every", spec.every, 0)
    if not spec.every:
        return
    _int("eval.samples", spec.samples, 1, MAX_EVAL_SAMPLES)
    chunks = len(msg.dataset.manifest.chunks)
    if not 1 <= spec.holdout_chunks < chunks:
        raise ConfigError(
            "eval.holdout_chunks",
            f"must hold out 1 to {chunks - 1} of the data set's {chunks} chunks (the rest are trained on), "
            f"got {spec.holdout_chunks}",
        )
