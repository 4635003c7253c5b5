"""Tensor frames: round trips through the product's reader, parts cut into sub-frames, and every header check.

Frames are read back by the all-reduce's reader (``read_part``, through :func:`tests.frames.read_frames`), the
one decoder of frames in the product, fed in chunks cut anywhere as a network would cut them.
"""

from __future__ import annotations

import asyncio
import struct
import zlib

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from crowdtrain.protocol.codecs import Codec, Compressor, Residual, raw_size, transform, untransform
from crowdtrain.protocol.errors import LimitExceeded, ProtocolError
from crowdtrain.protocol.frames import HEADER_SIZE, MAGIC, pack_header, parse_header, payload
from crowdtrain.protocol.limits import Limits
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.wire import Coder, subframe_bounds
from tests.frames import encode_frame, encode_part, read_frames

shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=12)
values = st.floats(min_value=-1e4, max_value=1e4, width=32)


def decoded(x: np.ndarray, codec: Codec) -> np.ndarray:
    """What a receiver decodes of ``x`` sent in ``codec`` (one frame), float32."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    return untransform(transform(flat, codec), codec, flat.size)


@pytest.mark.parametrize("codec", list(Codec))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_frame_round_trips_shape_and_values(codec, data):
    x = data.draw(hnp.arrays(np.float32, shapes, elements=values))
    frame = encode_frame(x, codec)
    header = parse_header(frame)
    assert header.codec is codec and header.shape == x.shape
    assert header.raw_length == raw_size(codec, x.size)
    assert header.encoded_length == len(frame) - HEADER_SIZE
    if not x.size:  # a frame of no values is not a sub-frame: the reader takes one dimension of 1 or more
        return
    flat = encode_frame(x.reshape(-1), codec)
    config = AveragingConfig(clip_multiple=0.0, codec=codec, subframe_elements=x.size)
    expected = decoded(x, codec)
    y, norm2, nbytes = read_frames(flat, config, x.size, cuts=data.draw(st.lists(st.integers(0), max_size=3)))
    assert np.array_equal(y, expected) and nbytes == len(flat)
    assert norm2 == pytest.approx(float(np.dot(expected.astype(np.float64), expected)), rel=1e-5, abs=1e-30)
    if codec.lossy:  # a part owner keeps the payload as it came, then decodes it to the same values
        assert np.array_equal(read_frames(flat, config, x.size, kept=True)[0], expected)
    else:
        assert np.array_equal(y, x.reshape(-1))


@settings(max_examples=30, deadline=None)
@given(
    codec=st.sampled_from(list(Codec)),
    x=hnp.arrays(np.float32, st.integers(1, 300), elements=values),
    step=st.integers(1, 64),
    cuts=st.lists(st.integers(0), max_size=6),
)
def test_a_part_cut_into_sub_frames_reads_back_whole(codec, x, step, cuts):
    config = AveragingConfig(clip_multiple=0.0, codec=codec, subframe_elements=step)
    body = encode_part(x, config)
    step = config.frame_elements  # (whole blocks of a lossy codec)
    expected = np.concatenate([decoded(x[a:b], codec) for a, b in subframe_bounds(0, x.size, step)])
    y, _, nbytes = read_frames(body, config, x.size, cuts=cuts)
    assert nbytes == len(body)
    assert np.array_equal(y, expected)
    if codec.lossy:
        assert np.array_equal(read_frames(body, config, x.size, kept=True, cuts=cuts)[0], expected)


def test_an_empty_part_is_an_empty_body():
    y, norm2, nbytes = read_frames(b"", AveragingConfig(clip_multiple=0.0), 0)
    assert y.size == 0 and norm2 == 0.0 and nbytes == 0


def test_frames_beyond_the_values_of_the_part_are_refused():
    config = AveragingConfig(clip_multiple=0.0, subframe_elements=4)
    body = encode_part(np.ones(8, np.float32), config)
    with pytest.raises(ProtocolError, match="sub-frames carry more than the 6 values this part holds"):
        read_frames(body, config, 6)
    with pytest.raises(ProtocolError, match="body continues after the 4 values this part holds"):
        read_frames(body, config, 4)


def test_a_truncated_last_frame_is_an_incomplete_read():
    config = AveragingConfig(clip_multiple=0.0, subframe_elements=100)
    body = encode_part(np.ones(200, np.float32), config)
    with pytest.raises(asyncio.IncompleteReadError):
        read_frames(body[:-1], config, 200)


def test_raw_frame_from_error_feedback_decodes_to_what_the_sender_believes_it_sent():
    config = AveragingConfig(clip_multiple=0.0, codec=Codec.INT8, subframe_elements=5000)
    x = np.linspace(-1, 1, 5000, dtype=np.float32)
    header, body, sent = Coder(config).encode_sent(x, Residual.zeros(x.size))
    assert parse_header(header).shape == (5000,)
    assert np.array_equal(read_frames(header + bytes(body), config, x.size)[0], sent)


def _header_fields(frame: bytes) -> list:
    return list(struct.unpack_from("<4sBBBB8QQQQ", frame))


def _with(frame: bytes, changes: dict[int, object]) -> bytes:
    fields = _header_fields(frame)
    for index, value in changes.items():
        fields[index] = value
    return struct.pack("<4sBBBB8QQQQ", *fields) + frame[HEADER_SIZE:]


FP16 = AveragingConfig(clip_multiple=0.0, codec=Codec.FP16, subframe_elements=12)


@pytest.fixture
def frame() -> bytes:
    """One fp16 sub-frame of 12 values, as a peer's coder sends it."""
    return encode_part(np.arange(12, dtype=np.float32), FP16)


@pytest.mark.parametrize(
    ("changes", "error", "text"),
    [
        ({0: b"XXXX"}, ProtocolError, "does not start with the crowdtrain magic"),
        ({1: 1}, ProtocolError, r"frame version 1 is not supported \(this peer speaks 2\)"),
        ({2: 9}, ProtocolError, "unknown codec id 9"),
        ({3: 1}, ProtocolError, "unknown dtype id 1"),
        ({4: 0}, ProtocolError, "frame has 0 dimensions; 1 to 8 are allowed"),
        ({4: 9}, ProtocolError, "frame has 9 dimensions"),
        ({6: 3}, ProtocolError, "non-zero dimensions past its ndim"),
        ({5: 2**40}, LimitExceeded, "dimension of 1099511627776, more than the limit of 16777216 elements"),
        ({4: 2, 5: 2**23, 6: 4}, LimitExceeded, "frame declares more than the limit of 16777216 elements"),
        ({13: 7}, ProtocolError, "frame declares 7 raw bytes but 12 values in codec fp16 need 24"),
        ({14: 2**40}, LimitExceeded, "frame body declares 1099511627776 bytes, more than the limit"),
        ({15: 0}, ProtocolError, "fails its XXH3-64 checksum"),
    ],
)
def test_tampered_header_fields_are_refused(frame, changes, error, text):
    with pytest.raises(error, match=text):
        read_frames(_with(frame, changes), FP16, 12)


def test_header_is_checked_before_the_body_is_touched(frame):
    with pytest.raises(ProtocolError, match="frame header needs 96 bytes, got 95"):
        parse_header(frame[:95])
    header = parse_header(frame)
    with pytest.raises(ProtocolError, match=r"frame body holds \d+ bytes but its header declares"):
        payload(header, frame[HEADER_SIZE:] + b"\0", Compressor())


def test_body_with_a_valid_checksum_but_wrong_content_is_refused(frame):
    header = parse_header(frame)
    bogus = b"not zstd at all"
    tampered = pack_header(header.codec, header.shape, header.raw_length, bogus) + bogus
    with pytest.raises(ProtocolError, match="not zstd data"):
        read_frames(tampered, FP16, 12)
    small = Compressor().compress(b"\0" * 10)  # decompresses to fewer bytes than declared
    tampered = pack_header(header.codec, header.shape, header.raw_length, small) + small
    with pytest.raises(ProtocolError, match="zstd body declares 10 bytes but the header declares 24"):
        read_frames(tampered, FP16, 12)


def test_limits_are_configurable():
    frame = encode_frame(np.zeros(100, np.float32), Codec.NONE)
    few = AveragingConfig(clip_multiple=0.0, subframe_elements=99, limits=Limits(max_elements=99))
    with pytest.raises(LimitExceeded, match="more than the limit of 99 elements"):
        read_frames(frame, few, 100)
    flat = AveragingConfig(clip_multiple=0.0, subframe_elements=4, limits=Limits(max_ndim=1))
    with pytest.raises(ProtocolError, match="frame has 2 dimensions; 1 to 1 are allowed"):
        read_frames(encode_frame(np.zeros((2, 2), np.float32), Codec.NONE), flat, 4)


def test_magic_and_checksum_layout():
    frame = encode_part(np.ones(3, np.float32), AveragingConfig(clip_multiple=0.0))
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
    coder = Coder(AveragingConfig(clip_multiple=0.0, codec=Codec.INT8))
    x = (np.random.default_rng(3).standard_normal(20_000) * 1e-3).astype(np.float32)
    residual = Residual.zeros(x.size)
    sent_sum = np.zeros(x.size, dtype=np.float64)
    for _ in range(100):
        _, _, sent = coder.encode_sent(x, residual)
        sent_sum += sent
    step = float(np.abs(x).max()) / 127
    assert np.abs(sent_sum - 100 * x.astype(np.float64)).max() <= step
