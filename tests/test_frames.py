"""Tensor frames: round trips, several frames back to back, and every header check."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from crowdtrain.protocol.codecs import Codec, Compressor, ErrorFeedback, Residual, raw_size
from crowdtrain.protocol.errors import LimitExceeded, ProtocolError
from crowdtrain.protocol.frames import (
    HEADER_SIZE,
    MAGIC,
    decode_frame,
    encode_frame,
    encode_raw_frame,
    iter_frames,
    pack_header,
    parse_header,
)
from crowdtrain.protocol.limits import Limits
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.wire import Coder

shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=12)
values = st.floats(min_value=-1e4, max_value=1e4, width=32)


@pytest.mark.parametrize("codec", list(Codec))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_frame_round_trips_shape_and_values(codec, data):
    x = data.draw(hnp.arrays(np.float32, shapes, elements=values))
    comp = Compressor()
    frame = encode_frame(x, codec, comp)
    y, header = decode_frame(frame, comp)
    assert header.codec is codec and header.shape == x.shape and y.shape == x.shape
    assert header.raw_length == raw_size(codec, x.size)
    assert header.encoded_length == len(frame) - HEADER_SIZE
    expected = comp.decode(comp.encode(x, codec), codec, x.size).reshape(x.shape)
    assert np.array_equal(y, expected)
    if codec is Codec.NONE:
        assert np.array_equal(y, x)


def test_scalar_travels_as_shape_one():
    comp = Compressor()
    y, header = decode_frame(encode_frame(np.float32(2.5).reshape(()), Codec.NONE, comp), comp)
    assert header.shape == (1,) and y.tolist() == [2.5]


@settings(max_examples=30, deadline=None)
@given(
    parts=st.lists(
        st.tuples(st.sampled_from(list(Codec)), hnp.arrays(np.float32, shapes, elements=values)),
        min_size=1,
        max_size=6,
    )
)
def test_iter_frames_decodes_several_frames_back_to_back(parts):
    comp = Compressor()
    buf = b"".join(encode_frame(x, codec, comp) for codec, x in parts)
    decoded = list(iter_frames(buf, comp))
    assert len(decoded) == len(parts)
    for (codec, x), (y, header) in zip(parts, decoded, strict=True):
        assert header.codec is codec and y.shape == x.shape
        assert np.array_equal(y, decode_frame(encode_frame(x, codec, comp), comp)[0])


def test_iter_frames_over_a_memoryview_and_an_empty_buffer():
    comp = Compressor()
    x = np.arange(10, dtype=np.float32)
    buf = bytearray(encode_frame(x, Codec.NONE, comp) * 3)
    assert [y.tolist() for y, _ in iter_frames(memoryview(buf), comp)] == [x.tolist()] * 3
    assert list(iter_frames(b"", comp)) == []


def test_iter_frames_limits_the_number_of_frames():
    comp = Compressor()
    buf = encode_frame(np.ones(1, np.float32), Codec.NONE, comp) * 3
    with pytest.raises(LimitExceeded, match="more than 2 frames"):
        list(iter_frames(buf, comp, max_frames=2))


def test_iter_frames_refuses_a_truncated_last_frame():
    comp = Compressor()
    one = encode_frame(np.ones(100, np.float32), Codec.NONE, comp)
    with pytest.raises(ProtocolError, match=r"frame 2 declares a \d+-byte body but only \d+ remain"):
        list(iter_frames(one + one[:-1], comp))


def test_raw_frame_from_error_feedback_decodes_to_what_the_sender_believes_it_sent():
    comp = Compressor()
    x = np.linspace(-1, 1, 5000, dtype=np.float32).reshape(50, 100)
    raw, sent = ErrorFeedback(Codec.INT8).transform(x)
    y, header = decode_frame(encode_raw_frame(raw, Codec.INT8, x.shape, comp), comp)
    assert header.shape == (50, 100)
    assert np.array_equal(y.reshape(-1), sent)


def _header_fields(frame: bytes) -> list:
    return list(struct.unpack_from("<4sBBBB8QQQQ", frame))


def _with(frame: bytes, index: int, value) -> bytes:
    fields = _header_fields(frame)
    fields[index] = value
    return struct.pack("<4sBBBB8QQQQ", *fields) + frame[HEADER_SIZE:]


@pytest.fixture
def frame() -> bytes:
    return encode_frame(np.arange(12, dtype=np.float32).reshape(3, 4), Codec.FP16, Compressor())


@pytest.mark.parametrize(
    ("index", "value", "error", "text"),
    [
        (0, b"XXXX", ProtocolError, "does not start with the crowdtrain magic"),
        (1, 1, ProtocolError, r"frame version 1 is not supported \(this peer speaks 2\)"),
        (2, 9, ProtocolError, "unknown codec id 9"),
        (3, 1, ProtocolError, "unknown dtype id 1"),
        (4, 0, ProtocolError, "frame has 0 dimensions; 1 to 8 are allowed"),
        (4, 9, ProtocolError, "frame has 9 dimensions"),
        (6, 3, ProtocolError, "non-zero dimensions past its ndim"),
        (5, 2**40, LimitExceeded, "dimension of 1099511627776, more than the limit of 16777216 elements"),
        (5, 2**23, LimitExceeded, "frame declares more than the limit of 16777216 elements"),
        (13, 7, ProtocolError, "frame declares 7 raw bytes but 12 values in codec fp16 need 24"),
        (14, 2**40, LimitExceeded, "frame body declares 1099511627776 bytes, more than the limit"),
        (15, 0, ProtocolError, "fails its XXH3-64 checksum"),
    ],
)
def test_tampered_header_fields_are_refused(frame, index, value, error, text):
    if index == 6:  # the third dimension of a 2-D frame
        fields = _header_fields(frame)
        fields[4 + 1 + 2] = value
        tampered = struct.pack("<4sBBBB8QQQQ", *fields) + frame[HEADER_SIZE:]
    else:
        tampered = _with(frame, index, value)
    with pytest.raises(error, match=text):
        decode_frame(tampered, Compressor())


def test_header_is_checked_before_the_body_is_touched(frame):
    with pytest.raises(ProtocolError, match="frame header needs 96 bytes, got 95"):
        parse_header(frame[:95])
    with pytest.raises(ProtocolError, match=r"frame body holds \d+ bytes but its header declares"):
        decode_frame(frame + b"\0", Compressor())


def test_body_with_a_valid_checksum_but_wrong_content_is_refused(frame):
    header = parse_header(frame)
    bogus = b"not zstd at all"
    tampered = pack_header(header.codec, header.shape, header.raw_length, bogus) + bogus
    with pytest.raises(ProtocolError, match="not zstd data"):
        decode_frame(tampered, Compressor())
    small = Compressor().compress(b"\0" * 10)  # decompresses to fewer bytes than declared
    tampered = pack_header(header.codec, header.shape, header.raw_length, small) + small
    with pytest.raises(ProtocolError, match="zstd body declares 10 bytes but the header declares 24"):
        decode_frame(tampered, Compressor())


def test_limits_are_configurable():
    comp = Compressor()
    frame = encode_frame(np.zeros(100, np.float32), Codec.NONE, comp)
    with pytest.raises(LimitExceeded, match="more than the limit of 99 elements"):
        decode_frame(frame, comp, Limits(max_elements=99))
    with pytest.raises(ProtocolError, match="frame has 2 dimensions; 1 to 1 are allowed"):
        decode_frame(encode_frame(np.zeros((2, 2), np.float32), Codec.NONE, comp), comp, Limits(max_ndim=1))


def test_magic_and_checksum_layout():
    frame = encode_frame(np.ones(3, np.float32), Codec.NONE, Compressor())
    assert frame[:4] == MAGIC
    # XXH3-64 with seed 0: its published value for the empty input is 0x2D06800538D394C2
    assert xxhash.xxh3_64_intdigest(b"") == 0x2D06800538D394C2
    assert struct.unpack_from("<Q", frame, 88)[0] == xxhash.xxh3_64_intdigest(frame[HEADER_SIZE:])
    assert struct.unpack_from("<I", frame, 88)[0] != zlib.crc32(frame[HEADER_SIZE:])  # not version 1's


def test_a_bfloat16_residual_keeps_values_within_2_to_the_minus_8_and_its_slices_are_views():
    values = np.linspace(-3e-3, 5e-3, 1000, dtype=np.float32)
    residual = Residual.zeros(1200)
    residual[100:1100].keep(values)
    got = residual.values()
    assert not got[:100].any() and not got[1100:].any()
    assert np.allclose(got[100:1100], values, rtol=2.0**-8, atol=0)
    assert residual.bits.nbytes == 2 * 1200


def test_error_feedback_through_a_bfloat16_residual_keeps_the_running_sum_within_one_step():
    # What an averaging peer does each round with its int8 codec: the quantisation error of each encode is
    # carried into the next, so the sum of what was sent tracks the sum of the inputs. Without the feedback
    # the error would grow by up to half a step every round (a hundred rounds here).
    coder = Coder(AveragingConfig(codec=Codec.INT8))
    x = (np.random.default_rng(3).standard_normal(20_000) * 1e-3).astype(np.float32)
    residual = Residual.zeros(x.size)
    sent_sum = np.zeros(x.size, dtype=np.float64)
    for _ in range(100):
        _, _, sent = coder.encode_sent(x, residual)
        sent_sum += sent
    step = float(np.abs(x).max()) / 127
    assert np.abs(sent_sum - 100 * x.astype(np.float64)).max() <= step
