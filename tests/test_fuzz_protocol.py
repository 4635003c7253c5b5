"""Fuzzing the decoders: whatever bytes arrive, the only exception is ProtocolError, and nothing beyond
the limits is allocated."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_messages import sample_json  # tests/ is on sys.path under pytest's default import mode

from crowdtrain.protocol import messages
from crowdtrain.protocol.codecs import Codec, Compressor
from crowdtrain.protocol.errors import LimitExceeded, ProtocolError
from crowdtrain.protocol.frames import HEADER_SIZE, decode_frame, encode_frame, iter_frames, pack_header
from crowdtrain.protocol.limits import Limits, MiB

# CROWDTRAIN_FUZZ_EXAMPLES=5000 for a longer soak; the default keeps the suite fast.
FUZZ = settings(
    max_examples=int(os.environ.get("CROWDTRAIN_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
HEADER = struct.Struct("<4sBBBB8QQQQ")
LIMITS = Limits(max_frame_bytes=1 * MiB, max_elements=128 * 1024)


def _valid_frames() -> list[bytes]:
    rng = np.random.default_rng(3)
    comp = Compressor()
    out = []
    for codec in Codec:
        for shape in [(7,), (33, 65), (2, 3, 5)]:
            x = rng.standard_normal(shape).astype(np.float32)
            x.reshape(-1)[0] = np.nan if codec is Codec.INT8 else x.reshape(-1)[0]
            out.append(encode_frame(x, codec, comp))
    return out


FRAMES = _valid_frames()


def decode_all(buf: bytes) -> None:
    """Run every frame decoder over ``buf``; returning or ProtocolError are both fine."""
    comp = Compressor(limits=LIMITS)
    for decoder in (lambda: decode_frame(buf, comp, LIMITS), lambda: list(iter_frames(buf, comp, LIMITS))):
        try:
            result = decoder()
        except ProtocolError:
            continue
        arrays = [result[0]] if isinstance(result, tuple) else [y for y, _ in result]
        for y in arrays:  # whatever decodes is a float32 array within the limits
            assert y.dtype == np.float32 and y.size <= LIMITS.max_elements


def with_crc(buf: bytes) -> bytes:
    """Recompute the checksum so that a mutation reaches zstd and the value transforms."""
    if len(buf) < HEADER_SIZE:
        return buf
    fields = list(HEADER.unpack_from(buf))
    fields[15] = xxhash.xxh3_64_intdigest(buf[HEADER_SIZE:])
    return HEADER.pack(*fields) + buf[HEADER_SIZE:]


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes(buf):
    decode_all(buf)
    decode_all(FRAMES[0][:4] + buf)  # past the magic check


@FUZZ
@given(
    frame=st.sampled_from(FRAMES),
    flips=st.lists(st.integers(min_value=0), min_size=1, max_size=8),
    fix=st.booleans(),
)
def test_bit_flips(frame, flips, fix):
    buf = bytearray(frame)
    for f in flips:
        bit = f % (8 * len(buf))
        buf[bit // 8] ^= 1 << (bit % 8)
    decode_all(with_crc(bytes(buf)) if fix else bytes(buf))


@FUZZ
@given(frame=st.sampled_from(FRAMES), cut=st.integers(min_value=0), extra=st.binary(max_size=50))
def test_truncation_and_trailing_bytes(frame, cut, extra):
    decode_all(frame[: cut % len(frame)])
    decode_all(frame + extra)
    decode_all(frame + frame[: cut % len(frame)])


@FUZZ
@given(
    frame=st.sampled_from(FRAMES),
    field=st.integers(min_value=1, max_value=15),
    value=st.one_of(
        st.integers(0, 255), st.integers(0, 2**64 - 1), st.sampled_from([2**31, 2**32 - 1, 2**63])
    ),
    fix=st.booleans(),
)
def test_header_field_tampering(frame, field, value, fix):
    fields = list(HEADER.unpack_from(frame))
    limit = 255 if field <= 4 else 2**32 - 1 if field == 15 else 2**64 - 1
    fields[field] = value % (limit + 1)
    buf = HEADER.pack(*fields) + frame[HEADER_SIZE:]
    decode_all(with_crc(buf) if fix else buf)


@FUZZ
@given(frame=st.sampled_from(FRAMES), body=st.binary(max_size=300))
def test_random_body_behind_a_valid_header(frame, body):
    fields = list(HEADER.unpack_from(frame))
    fields[14] = len(body)
    decode_all(with_crc(HEADER.pack(*fields) + body))


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
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decode_frame(buf, Compressor(limits=LIMITS), LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"decoding a refused header allocated {peak} bytes"


def test_zero_element_frame_with_a_huge_dimension_is_refused():
    """Regression: (0, 2**63) has zero elements, but numpy cannot shape it (ValueError escaped)."""
    comp = Compressor(limits=LIMITS)
    body = comp.compress(b"")
    with pytest.raises(LimitExceeded, match="frame declares a dimension of 9223372036854775808"):
        decode_frame(pack_header(Codec.NONE, (0, 2**63), 0, body) + body, comp, LIMITS)
    y, header = decode_frame(pack_header(Codec.NONE, (0, 5), 0, body) + body, comp, LIMITS)
    assert y.shape == (0, 5) and header.numel == 0


@pytest.mark.parametrize("content_size", [True, False], ids=["declared", "undeclared"])
def test_decompression_bomb_is_stopped_at_the_declared_size(content_size):
    """A 1.6 kB zstd body that expands to 50 MB, behind a header that declares 4000 raw bytes."""
    comp = Compressor(limits=LIMITS)
    bomb = zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(b"\0" * (50 * MiB))
    assert len(bomb) < 64 * 1024
    buf = pack_header(Codec.NONE, (1000,), 4000, bomb) + bomb
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="zstd"):
            decode_frame(buf, comp, LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(bomb) + 256 * 1024, f"the bomb made the decoder allocate {peak} bytes"


def test_declared_raw_size_above_the_limit_is_refused_before_decompression():
    limits = Limits(max_frame_bytes=1000, max_elements=10_000)
    comp = Compressor(limits=limits)
    body = comp.compress(b"\0" * 4000)
    buf = pack_header(Codec.NONE, (1000,), 4000, body) + body
    with pytest.raises(LimitExceeded, match="declares 4000 raw bytes, more than the limit of 1000"):
        decode_frame(buf, comp, limits)


def test_peer_supplied_non_finite_int8_scales_decode_without_warnings():
    """The receiver's finiteness check sees NaN/inf; the decoder itself must not raise or warn."""
    comp = Compressor()
    n = 10
    raw = struct.pack("<f", float("inf")) + bytes(n)  # inf × 0 is NaN
    body = comp.compress(raw)
    y, _ = decode_frame(pack_header(Codec.INT8, (n,), len(raw), body) + body, comp)
    assert np.isnan(y).all()


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
