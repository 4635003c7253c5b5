"""A part owner's receipt: what it reduced, signed, so that no member takes its answer on trust.

An owner answers each member with the reduced part ``a`` (as the member decodes it) and then, at the end of
the same answer, a receipt: per member of the round, the weight and norm of the copy it counted and
``g = f · <c, a>``, the inner product of that member's term (its copy ``c`` times its factor ``f`` in the
mean) with the answer; and ``‖a‖²`` and a digest of ``a``, all signed with the owner's key.

What a member checks before it applies the part (:func:`check`):

* the plan: the weights are at most the tracker's, the factors follow from the listed norms by the
  reducer's rule (the clip reference, ``f = w · min(1, clip · R / n) / W``), so an owner cannot give itself
  more than its share or the others less than theirs;
* its own line: its weight, the norm of the copy it sent and ``g`` it computes itself from its copy and the
  answer it got: an honest member's line cannot be forged, and every honest member checks its own;
* each line: ``|g| ≤ f · n · ‖a‖`` (Cauchy–Schwarz), and the whole: ``‖a‖² = Σ g`` (up to the codec's
  rounding of the answer, :func:`tolerance`), which holds exactly for ``a = Σ f c``.

The bound this buys (docs/security.md, "A part owner"): with ``h`` the honest members' terms summed and the
owner's own term at most ``β = f_o · n_o`` long, a receipt that passes forces ``<a, a - h> ≤ (β + τ‖a‖)‖a‖``:
the answer is no longer than ``h`` plus ``β``, and it cannot point against ``h`` by more than ``β`` — the
pull of one member of the owner's weight. An owner of weight 0 (a backbone) has ``β = 0``. What a receipt
cannot show is a turn within that bound (the answer may shrink towards 0 or turn up to half of ``h`` aside).

A receipt that breaks its own arithmetic (a plan that does not follow from its lines, a line above its
Cauchy–Schwarz bound, ``Σ g`` far from the ``‖a‖²`` it states) is proof against the owner by itself: the
tracker checks the same rules and bars the key at once. A receipt whose numbers disagree only with what the
member holds (its own line, the answer it got) proves nothing to a third party: the tracker counts it as an
accusation, one per accusing address, as it counts failed spot-checks.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from crowdtrain.protocol.codecs import Codec
from crowdtrain.protocol.credentials import SigningKey, verify
from crowdtrain.protocol.errors import AuthError, ProtocolError

MAGIC = b"CTR1"
_HEAD = struct.Struct("<4sIHHd16s")  # magic, part, members, flags, ‖a‖², digest of a
_LINE = struct.Struct("<dddHH")  # weight (NaN: no copy counted), norm, g, first member with the same copy, 0
SIGNATURE_BYTES = 64
FLAG_SHARED = 1  # a later phase: identical copies are one term, clipped against the distinct copies
# How far ‖a‖² may be from Σ g = <mean, a>, relative to ‖a‖²: |<a - mean, a>| / ‖a‖², the answer's rounding
# against itself (its owner carries no residual for these codecs). fp16 and bf16 round each value by at most
# 2⁻¹¹ and 2⁻⁸ of it. int8 rounds each value by at most half its block's step, and a value that rounds to k
# steps (k ≥ 1; one that rounds to 0 adds nothing) is then off by at most 1/(2k) of itself: 0.5 bounds it
# for any data (0.55: a margin for float32 sums) (a block of one outlier and many values near one step comes close: an honest receipt failed
# 0.05 in a run). int2 and sparse round too coarsely (sparse withholds most values for rounds, in a residual)
# for the sum to say anything: their receipts check the plan, each member's own line and Cauchy-Schwarz only.
_TOLERANCE = {Codec.NONE: 1e-4, Codec.FP16: 0.02, Codec.BF16: 0.02, Codec.INT8: 0.55}
OWN_RELATIVE = 1e-3  # a member's own norm and g against its own computation (fp32 sums in another order)


# A later phase bounds its copies at no less than this multiple: its columns may cut the vector into other
# parts, so a clip that binds there would clip each column's parts differently and break the one mean. Its
# copies are first-phase means, usually near their median, but not always: in local-steps mode a group of
# peers that took few inner steps (a small share of the round: slow, or loaded) has a pseudo-gradient several
# times smaller than a fast group's. So a copy beyond the bound there fails the part instead of being clipped
# (``PartReducer.plan``), and the verdicts zero it in every column (docs/security.md)
LATER_PHASE_CLIP = 5.0


# A member whose copy has a cosine below this with the other members' terms (:func:`alignment`), over the
# receipts of PULL_PARTS parts or more, pulls against the run; a member that sees it so in two rounds in a
# row reports it to the tracker (tracker/pulls.py). Measured (docs/security.md, "A member that pulls"), over
# 2 parts of groups of 4: honest members 0.14 and up in local-steps mode (pseudo-gradients of many steps
# agree), now and then below -0.5 in every-step mode (one micro-batch's gradients are noisy), never twice in
# a row there; -4.9x its own: -0.56 and below in local-steps mode, -0.79 and below in every-step mode.
PULL_COS = {"local-steps": -0.3, "every-step": -0.5}
PULL_PARTS = 2


def pull_cos(local: bool) -> float:
    """The cosine below which a member's copy pulls against the others (see PULL_COS)."""
    return PULL_COS["local-steps" if local else "every-step"]


def clip_for_phase(clip_multiple: float, shared: bool) -> float:
    """The clip multiple the reducer applies: the run's in a first phase, at least LATER_PHASE_CLIP in a
    later one (0: no clipping in either)."""
    if clip_multiple <= 0 or not shared:
        return clip_multiple
    return max(clip_multiple, LATER_PHASE_CLIP)


def size(members: int) -> int:
    """Bytes of the receipt of a round of ``members`` members."""
    return _HEAD.size + members * _LINE.size + SIGNATURE_BYTES


def tolerance(codec: Codec) -> float | None:
    """How far ``Σ g`` may be from ``‖a‖²``, relative to it (None: not checked for this codec)."""
    return _TOLERANCE.get(codec)


def digest(values: np.ndarray) -> bytes:
    """The digest of an answer as its receiver decoded it (float32)."""
    return hashlib.blake2b(np.ascontiguousarray(values, dtype=np.float32).data, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class Line:
    weight: float  # NaN: no copy of this member counted
    norm: float
    g: float
    copy: int  # index of the first member whose copy is identical (itself when distinct)

    @property
    def counted(self) -> bool:
        return not math.isnan(self.weight)


@dataclass(frozen=True, slots=True)
class Receipt:
    part: int
    shared: bool
    answer_norm2: float
    answer_digest: bytes
    lines: tuple[Line, ...]  # one per member of the round, in the assignment's order
    signature: bytes = b""

    def body(self) -> bytes:
        head = _HEAD.pack(
            MAGIC,
            self.part,
            len(self.lines),
            FLAG_SHARED if self.shared else 0,
            self.answer_norm2,
            self.answer_digest,
        )
        return head + b"".join(_LINE.pack(ln.weight, ln.norm, ln.g, ln.copy, 0) for ln in self.lines)

    def to_bytes(self) -> bytes:
        return self.body() + self.signature

    @staticmethod
    def signed_bytes(run_id: str, key: str, body: bytes) -> bytes:
        return b"\x00".join([b"crowdtrain-receipt-v1", run_id.encode(), key.encode(), body])

    def signed(self, signer: SigningKey, run_id: str, key: str) -> Receipt:
        sig = bytes.fromhex(signer.sign(self.signed_bytes(run_id, key, self.body())))
        return Receipt(self.part, self.shared, self.answer_norm2, self.answer_digest, self.lines, sig)

    def verify(self, public_key: str, run_id: str, key: str) -> None:
        """Raise :class:`AuthError` unless the owner with ``public_key`` signed this receipt for round ``key``."""
        verify(public_key, self.signature.hex(), self.signed_bytes(run_id, key, self.body()), "the receipt")

    @classmethod
    def parse(cls, raw: bytes, members: int) -> Receipt:
        """The receipt in ``raw`` (exactly :func:`size` bytes); :class:`ProtocolError` when it is not one."""
        if len(raw) != size(members):
            raise ProtocolError(f"a receipt of {members} members is {size(members)} bytes, not {len(raw)}")
        magic, part, n, flags, norm2, dig = _HEAD.unpack_from(raw, 0)
        if magic != MAGIC or n != members or flags & ~FLAG_SHARED:
            raise ProtocolError("the receipt's header is not one of this protocol's")
        lines = tuple(Line(*_LINE.unpack_from(raw, _HEAD.size + i * _LINE.size)[:4]) for i in range(members))
        return cls(part, bool(flags & FLAG_SHARED), norm2, dig, lines, raw[-SIGNATURE_BYTES:])


@dataclass(frozen=True, slots=True)
class Mine:
    """What the member checking a receipt holds itself: its index, the weight it declared, the norm of the
    copy it sent (as the owner decodes it), ``<copy, answer>`` and the answer it got (norm², digest)."""

    index: int
    weight: float
    norm: float
    dot: float
    answer_norm2: float
    answer_digest: bytes


@dataclass(frozen=True, slots=True)
class Finding:
    proven: bool  # the receipt alone shows it (a third party can check it)
    why: str


def factors(receipt: Receipt, owner: int, clip_multiple: float) -> list[float]:
    """Each line's factor in the mean, by the reducer's rule (``PartReducer.plan``), from the lines alone;
    0 for a line with no copy counted (or a weight of 0)."""
    lines = receipt.lines
    weighted = [i for i, ln in enumerate(lines) if ln.counted and ln.weight > 0]
    total = math.fsum(lines[i].weight for i in weighted)
    distinct = [i for i in weighted if lines[i].copy == i] if receipt.shared else weighted
    scales = {i: 1.0 for i in weighted}
    if clip_multiple > 0 and len(distinct) > 1:
        norms = sorted(lines[i].norm for i in distinct)
        reference = norms[(len(norms) - 1) // 2]
        own = lines[owner] if 0 <= owner < len(lines) else None
        if not receipt.shared and own is not None and own.counted and own.weight > 0 and own.norm > 0:
            reference = min(reference, own.norm)
        bound = clip_multiple * reference
        for i in weighted:
            n = lines[lines[i].copy].norm if receipt.shared else lines[i].norm
            if n > bound:
                scales[i] = bound / n if n > 0 else 0.0
    out = [0.0] * len(lines)
    for i in weighted:
        out[i] = lines[i].weight * scales[i] / total if total > 0 else 0.0
    return out


def check(
    receipt: Receipt,
    *,
    part: int,
    owner: int,
    weights: Sequence[float],
    clip_multiple: float,
    codec: Codec,
    shared: bool,
    mine: Mine | None = None,
) -> Finding | None:
    """What is wrong with ``receipt`` (None: nothing): by its own arithmetic first (``proven``), then against
    what the checking member holds (``mine``). ``weights``: each member's weight as the tracker assigned it
    (1.0 each in a round of parameters); ``owner``: the owner's index among the members; ``clip_multiple``:
    the run's (:func:`clip_for_phase` applies)."""
    if receipt.part != part or receipt.shared != shared or len(receipt.lines) != len(weights):
        return Finding(True, f"the receipt is for another part or round shape (part {receipt.part})")
    a2 = receipt.answer_norm2
    if not (math.isfinite(a2) and a2 >= 0):
        return Finding(True, "the receipt's ‖a‖² is not a finite number ≥ 0")
    why = _lines_wrong(receipt.lines, weights, shared)
    if why is not None:
        return Finding(True, why)
    f = factors(receipt, owner, clip_for_phase(clip_multiple, shared))
    if not any(f):
        return Finding(True, "the receipt counts no copy with a weight, yet the part was answered")
    why = _sums_wrong(receipt, f, tolerance(codec))
    if why is not None:
        return Finding(True, why)
    return None if mine is None else _mine_wrong(receipt, f, mine)


def _lines_wrong(lines: Sequence[Line], weights: Sequence[float], shared: bool) -> str | None:
    for i, ln in enumerate(lines):
        if not ln.counted:
            continue
        if not (math.isfinite(ln.weight) and 0 <= ln.weight <= weights[i] * (1 + 1e-9)):
            return f"member {i}'s weight {ln.weight} is not within the {weights[i]} it was assigned"
        if not (math.isfinite(ln.norm) and ln.norm >= 0 and math.isfinite(ln.g)):
            return f"member {i}'s line holds a number that is not finite"
        first = ln.copy
        if not (0 <= first <= i and lines[first].counted and lines[first].copy == first):
            return f"member {i}'s copy is said to be member {first}'s, which is no distinct copy"
        if first != i and (not shared or not math.isclose(lines[first].norm, ln.norm, rel_tol=1e-6)):
            return f"member {i}'s copy is said to equal member {first}'s, but it cannot"
    return None


def _sums_wrong(receipt: Receipt, f: list[float], tau: float | None) -> str | None:
    a2 = receipt.answer_norm2
    a = math.sqrt(a2)
    for i, ln in enumerate(receipt.lines):
        if ln.counted and abs(ln.g) > f[i] * ln.norm * a * (1 + 1e-3) + 1e-30:
            return f"member {i}'s term is larger than its copy and factor allow (|g| > f·n·‖a‖)"
    total = math.fsum(ln.g for ln in receipt.lines if ln.counted)
    if tau is not None and abs(a2 - total) > tau * a2 + 1e-30:
        return f"the answer is not the mean of the copies listed: ‖a‖² = {a2:.6g} but the terms sum to {total:.6g}"
    return None


def _mine_wrong(receipt: Receipt, f: list[float], mine: Mine) -> Finding | None:
    a2 = receipt.answer_norm2
    if not math.isclose(mine.answer_norm2, a2, rel_tol=1e-4, abs_tol=1e-30) or (
        mine.answer_digest != receipt.answer_digest
    ):
        return Finding(False, "the receipt is not for the answer this member got (its ‖a‖² or digest differ)")
    if mine.weight <= 0:
        return None
    own = receipt.lines[mine.index] if 0 <= mine.index < len(receipt.lines) else None
    if own is None or not own.counted or own.weight != mine.weight:
        return Finding(False, "the receipt does not count this member's copy at the weight it sent")
    if not math.isclose(own.norm, mine.norm, rel_tol=OWN_RELATIVE, abs_tol=1e-30):
        return Finding(
            False, f"the receipt says this member's copy has norm {own.norm:.6g}, not {mine.norm:.6g}"
        )
    g = f[mine.index] * mine.dot
    if abs(own.g - g) > OWN_RELATIVE * f[mine.index] * mine.norm * math.sqrt(a2) + 1e-30:
        return Finding(
            False, f"the receipt says this member's term gives {own.g:.6g} against the answer, not {g:.6g}"
        )
    return None


def verify_owner(receipt: Receipt, public_key: str, run_id: str, key: str) -> Finding | None:
    """None when the receipt is signed by the owner's key, else why not (a member then fails the part)."""
    try:
        receipt.verify(public_key, run_id, key)
    except AuthError as exc:
        return Finding(False, str(exc))
    return None


def alignment(
    held: Sequence[tuple[Receipt, int]], member: int, clip_multiple: float, plans: Sequence[list[float]] = ()
) -> float | None:
    """The cosine between ``member``'s copy and the other members' terms summed, over the parts of a first
    phase whose receipts are ``held`` (each with its owner's index; ``plans``: their :func:`factors`, when
    already computed), from their lines alone:
    ``<c, a - f c> / (‖c‖ ‖a - f c‖)``, with ``<c, a> = g / f`` part by part. None when a receipt counts no
    copy of it with a factor, or a copy or rest has no length, or **one other member's term outweighs the
    rest of the others' together** (its factor × norm over the parts against theirs summed): the cosine then
    says only that two copies disagree, not which of them pulls (a member with half a step's weight pointing
    against the run made every honest member's copy point against "the others" at -0.9). A member whose copy
    points against the others' round after round pulls against the run (docs/security.md, "A member that
    pulls")."""
    dot = copy2 = rest2 = 0.0
    terms2: dict[int, float] = {}  # each other member's term, squared length over the parts
    for k, (r, owner) in enumerate(held):
        f = plans[k] if plans else factors(r, owner, clip_multiple)
        ln = r.lines[member] if 0 <= member < len(r.lines) else None
        if ln is None or not ln.counted or f[member] <= 0:
            return None
        fm = f[member]
        dot += ln.g / fm - fm * ln.norm**2
        copy2 += ln.norm**2
        rest2 += r.answer_norm2 - 2 * ln.g + (fm * ln.norm) ** 2
        for j, other in enumerate(r.lines):
            if j != member and other.counted and f[j] > 0:
                terms2[j] = terms2.get(j, 0.0) + (f[j] * other.norm) ** 2
    terms = sorted((math.sqrt(t) for t in terms2.values()), reverse=True)
    if not held or copy2 <= 0 or rest2 <= 0 or len(terms) < 2 or terms[0] >= math.fsum(terms[1:]):
        return None
    return max(-1.0, min(1.0, dot / math.sqrt(copy2 * rest2)))
