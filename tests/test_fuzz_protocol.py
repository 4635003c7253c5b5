"""Fuzzing the decoders: whatever bytes arrive, the only exception is ProtocolError (or, for a tensor body
that ends early, an incomplete read), and nothing beyond the limits is allocated.

Tensor frames are fuzzed through the product's one reader of them, the all-reduce's ``read_part`` (see
:func:`tests.frames.read_frames`), into float32 values and into a lossy codec's kept payload, for every codec,
with the body cut into chunks anywhere.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import struct
import tracemalloc

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crowdtrain.protocol import messages
from crowdtrain.protocol.codecs import Codec, Compressor, untransform
from crowdtrain.protocol.errors import LimitExceeded, ProtocolError
from crowdtrain.protocol.frames import HEADER_SIZE, pack_header, parse_header, payload
from crowdtrain.protocol.limits import Limits, MiB
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.wire import Coder, NonFinite
from tests.frames import encode_frame, encode_part, read_frames
from tests.test_messages import sample_json

# CROWDTRAIN_FUZZ_EXAMPLES=5000 for a longer soak; the default keeps the suite fast.
FUZZ = settings(
    max_examples=int(os.environ.get("CROWDTRAIN_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
HEADER = struct.Struct("<4sBBBB8QQQQ")
LIMITS = Limits(max_frame_bytes=1 * MiB, max_elements=128 * 1024)
STEP = 64  # values per sub-frame
CONFIGS = {codec: AveragingConfig(codec=codec, subframe_elements=STEP, limits=LIMITS) for codec in Codec}


def _valid_parts() -> list[tuple[int, bytes]]:
    """(values, body) of parts as peers send them, each cut into sub-frames, in every codec."""
    rng = np.random.default_rng(3)
    out = []
    for codec in Codec:
        for n in (7, 100, 150):
            x = rng.standard_normal(n).astype(np.float32)
            x[0] = np.nan if codec is Codec.INT8 and n == 100 else x[0]  # a NaN block scale
            out.append((n, encode_part(x, CONFIGS[codec])))
    out.append((15, encode_frame(rng.standard_normal((3, 5)).astype(np.float32), Codec.NONE)))  # 2-D
    return out


PARTS = _valid_parts()
parts = st.sampled_from(PARTS)
cuts = st.lists(st.integers(min_value=0), max_size=4)


def decode_all(buf: bytes, elements: int, cut: list[int] = ()) -> None:
    """Read ``buf`` as a part of ``elements`` values in every codec, into values and (lossy codecs) into a
    kept payload; returning, ProtocolError and an incomplete read (the body ended early) are all fine."""
    for codec, config in CONFIGS.items():
        for kept in (False, True) if codec.lossy else (False,):
            try:
                values, norm2, nbytes = read_frames(buf, config, elements, kept=kept, cuts=cut)
            except (ProtocolError, asyncio.IncompleteReadError):
                continue
            # whatever is read is the whole body, as finite float32 values within the limits
            assert nbytes == len(buf)
            assert values.dtype == np.float32 and values.size == elements <= LIMITS.max_elements
            assert np.isfinite(values).all() and math.isfinite(norm2)


def with_crc(buf: bytes) -> bytes:
    """Recompute the first frame's checksum so that a mutation reaches zstd and the value transforms."""
    if len(buf) < HEADER_SIZE:
        return buf
    fields = list(HEADER.unpack_from(buf))
    end = HEADER_SIZE + min(fields[14], len(buf) - HEADER_SIZE)
    fields[15] = xxhash.xxh3_64_intdigest(buf[HEADER_SIZE:end])
    return HEADER.pack(*fields) + buf[HEADER_SIZE:]


@FUZZ
@given(st.binary(max_size=400), st.integers(min_value=0, max_value=300), cuts)
def test_random_bytes(buf, elements, cut):
    decode_all(buf, elements, cut)
    decode_all(PARTS[0][1][:4] + buf, elements, cut)  # past the magic check


@FUZZ
@given(
    part=parts,
    flips=st.lists(st.integers(min_value=0), min_size=1, max_size=8),
    fix=st.booleans(),
    cut=cuts,
)
def test_bit_flips(part, flips, fix, cut):
    elements, frame = part
    buf = bytearray(frame)
    for f in flips:
        bit = f % (8 * len(buf))
        buf[bit // 8] ^= 1 << (bit % 8)
    decode_all(with_crc(bytes(buf)) if fix else bytes(buf), elements, cut)


@FUZZ
@given(part=parts, cut=st.integers(min_value=0), extra=st.binary(max_size=50))
def test_truncation_and_trailing_bytes(part, cut, extra):
    elements, frame = part
    decode_all(frame[: cut % len(frame)], elements)
    decode_all(frame + extra, elements)
    decode_all(frame + frame[: cut % len(frame)], elements)


@FUZZ
@given(
    part=parts,
    field=st.integers(min_value=1, max_value=15),
    value=st.one_of(
        st.integers(0, 255), st.integers(0, 2**64 - 1), st.sampled_from([2**31, 2**32 - 1, 2**63])
    ),
    fix=st.booleans(),
)
def test_header_field_tampering(part, field, value, fix):
    elements, frame = part
    fields = list(HEADER.unpack_from(frame))
    limit = 255 if field <= 4 else 2**32 - 1 if field == 15 else 2**64 - 1
    fields[field] = value % (limit + 1)
    buf = HEADER.pack(*fields) + frame[HEADER_SIZE:]
    decode_all(with_crc(buf) if fix else buf, elements)


@FUZZ
@given(part=parts, body=st.binary(max_size=300))
def test_random_body_behind_a_valid_header(part, body):
    elements, frame = part
    fields = list(HEADER.unpack_from(frame))
    fields[14] = len(body)
    decode_all(with_crc(HEADER.pack(*fields) + body), elements)


@pytest.mark.parametrize(
    "shape",
    [(2**64 - 1,), (2**32, 2**32), (1 << 20, 1 << 20, 1 << 20), (LIMITS.max_elements + 1,), (2**63, 0)],
    ids=str,
)
def test_huge_declared_shapes_are_refused_without_allocating(shape):
    numel = 1
    for d in shape:
        numel *= d
    raw = min(4 * numel, 2**64 - 1)
    buf = pack_header(Codec.NONE, shape, raw, b"") + b""
    with pytest.raises(ProtocolError):
        read_frames(buf, CONFIGS[Codec.NONE], STEP)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            parse_header(buf, LIMITS)  # where the reader refuses it: the first thing it does with a frame
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"decoding a refused header allocated {peak} bytes"


def test_zero_element_frame_with_a_huge_dimension_is_refused():
    """Regression: (0, 2**63) has zero elements, but numpy cannot shape it (ValueError escaped)."""
    body = Compressor(limits=LIMITS).compress(b"")
    with pytest.raises(LimitExceeded, match="frame declares a dimension of 9223372036854775808"):
        read_frames(pack_header(Codec.NONE, (0, 2**63), 0, body) + body, CONFIGS[Codec.NONE], STEP)
    header = parse_header(pack_header(Codec.NONE, (0, 5), 0, body) + body, LIMITS)
    assert header.shape == (0, 5) and header.numel == 0
    with pytest.raises(ProtocolError, match=r"sub-frame has shape \[0, 5\]"):
        read_frames(pack_header(Codec.NONE, (0, 5), 0, body) + body, CONFIGS[Codec.NONE], STEP)


@pytest.mark.parametrize("content_size", [True, False], ids=["declared", "undeclared"])
def test_decompression_bomb_is_stopped_at_the_declared_size(content_size):
    """A 1.6 kB zstd body that expands to 50 MB, behind a header that declares 4000 raw bytes."""
    config = AveragingConfig(subframe_elements=1000, limits=LIMITS)
    bomb = zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(b"\0" * (50 * MiB))
    assert len(bomb) < 64 * 1024
    buf = pack_header(Codec.NONE, (1000,), 4000, bomb) + bomb
    with pytest.raises(ProtocolError, match="zstd"):
        read_frames(buf, config, 1000)
    coder, header, out = Coder(config), parse_header(buf, LIMITS), np.empty(1000, np.float32)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="zstd"):
            coder.decode_into(header, bomb, out)  # what the reader runs on the body
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(bomb) + 256 * 1024, f"the bomb made the decoder allocate {peak} bytes"


def test_declared_raw_size_above_the_limit_is_refused_before_decompression():
    limits = Limits(max_frame_bytes=1000, max_elements=10_000)
    body = Compressor().compress(b"\0" * 4000)
    header = parse_header(pack_header(Codec.NONE, (1000,), 4000, body) + body, limits)
    with pytest.raises(LimitExceeded, match="declares 4000 raw bytes, more than the limit of 1000"):
        payload(header, body, Compressor(limits=limits))


def test_peer_supplied_non_finite_int8_scales_decode_without_warnings():
    """The receiver's finiteness check sees NaN/inf; the decoding itself must not raise or warn (a warning is
    an error under this suite's filterwarnings, so a warning would surface here instead of NonFinite)."""
    n = 10
    raw = struct.pack("<f", float("inf")) + bytes(n)  # inf × 0 is NaN
    body = Compressor().compress(raw)
    buf = pack_header(Codec.INT8, (n,), len(raw), body) + body
    assert np.isnan(untransform(raw, Codec.INT8, n)).all()
    for kept in (False, True):
        with pytest.raises(NonFinite, match="NaN or infinite"):
            read_frames(buf, CONFIGS[Codec.INT8], n, kept=kept)


# ---------------------------------------------------------------- JSON messages

MESSAGES = sorted(
    (
        obj
        for obj in vars(messages).values()
        if isinstance(obj, type) and issubclass(obj, messages.Message) and obj is not messages.Message
    ),
    key=lambda cls: cls.__name__,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


def decode_message(data: bytes | str, cls: type[messages.Message]) -> None:
    try:
        msg = messages.decode(data, cls, Limits(max_json_bytes=4096))
    except ProtocolError:
        return
    assert isinstance(msg, cls)
    assert messages.decode(messages.encode(msg), cls) == msg


@FUZZ
@given(cls=st.sampled_from(MESSAGES), data=st.binary(max_size=300))
def test_random_bytes_as_messages(cls, data):
    decode_message(data, cls)


@FUZZ
@given(cls=st.sampled_from(MESSAGES), value=json_values)
def test_random_json_as_messages(cls, value):
    decode_message(json.dumps(value), cls)


def _sample(cls: type[messages.Message]) -> bytes:
    return json.dumps(sample_json(cls)).encode()


@FUZZ
@given(
    cls=st.sampled_from(MESSAGES),
    edits=st.lists(
        st.tuples(st.integers(min_value=0), st.integers(0, 255), st.sampled_from("xid")), max_size=6
    ),
)
def test_mutated_json_messages(cls, edits):
    buf = bytearray(_sample(cls))
    for pos, byte, op in edits:
        i = pos % (len(buf) + 1)
        if op == "x" and i < len(buf):
            buf[i] = byte
        elif op == "i":
            buf.insert(i, byte)
        elif op == "d" and i < len(buf):
            del buf[i]
    decode_message(bytes(buf), cls)


@FUZZ
@given(cls=st.sampled_from(MESSAGES), key=st.text(max_size=12), value=json_values)
def test_messages_with_replaced_fields(cls, key, value):
    obj = json.loads(_sample(cls))
    fields = [*sorted(obj), key]
    obj[fields[len(key) % len(fields)]] = value
    decode_message(json.dumps(obj), cls)


def test_invalid_utf8_in_a_key_is_a_protocol_error():
    """Regression: msgspec raised UnicodeDecodeError, not DecodeError, for a bad byte inside a key."""
    with pytest.raises(ProtocolError, match="AveragingSpec is not valid JSON"):
        messages.decode(b'{"\x80roup_size": 4}', messages.AveragingSpec)


def test_deeply_nested_json_is_a_protocol_error():
    deep = "[" * 100_000 + "]" * 100_000
    for cls in (messages.RunSpec, messages.ModelSpec):
        with pytest.raises(ProtocolError):
            messages.decode(deep, cls, Limits(max_json_bytes=1 * MiB))
    obj = json.loads(_sample(messages.ModelSpec))
    obj["args"] = {"a": [[[[1]]]]}
    with pytest.raises(ProtocolError, match=r"at `\$\.args\[\.\.\.\]`"):
        messages.decode(json.dumps(obj), messages.ModelSpec)
