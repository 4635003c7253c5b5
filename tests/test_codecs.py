"""Codec conformance: every codec round-trips random arrays within its tolerance, and does with NaN/inf
exactly what the module docstring of crowdtrain.protocol.codecs promises."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from crowdtrain.protocol.codecs import (
    INT8_BLOCK,
    SPARSE_CHUNK,
    SPARSE_K,
    Codec,
    Compressor,
    ErrorFeedback,
    raw_size,
    transform,
    untransform,
)
from crowdtrain.protocol.errors import ConfigError, LimitExceeded, ProtocolError
from crowdtrain.protocol.limits import Limits

SETTINGS = settings(max_examples=60, deadline=None)

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
any32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
sizes = st.integers(min_value=0, max_value=3 * INT8_BLOCK + 17)


def signed(lo: float, hi: float, zero: bool = False):
    """float32 values with magnitude in [lo, hi], either sign (and 0 when ``zero``)."""
    mag = st.floats(min_value=float(np.float32(lo)), max_value=float(np.float32(hi)), width=32)
    values = st.tuples(mag, st.booleans()).map(lambda t: -t[0] if t[1] else t[0])
    return st.one_of(st.just(0.0), values) if zero else values


def arrays(elements=finite32, size=sizes):
    return size.flatmap(lambda n: hnp.arrays(np.float32, n, elements=elements))


def roundtrip(x: np.ndarray, codec: Codec, level: int = 1) -> np.ndarray:
    comp = Compressor(level=level)
    body = comp.encode(x, codec)
    y = comp.decode(body, codec, x.size)
    assert y.dtype == np.float32 and y.shape == (x.size,)
    return y


@pytest.mark.parametrize("codec", list(Codec))
@SETTINGS
@given(x=arrays(any32), level=st.sampled_from([-1, 1, 3]))
def test_raw_payload_size_is_what_raw_size_says(codec, x, level):
    assert len(transform(x, codec)) == raw_size(codec, x.size)
    roundtrip(x, codec, level)


@SETTINGS
@given(x=arrays(any32))
def test_none_keeps_every_bit_including_nan_and_inf(x):
    y = roundtrip(x, Codec.NONE)
    assert y.view(np.uint32).tolist() == x.view(np.uint32).tolist()


@SETTINGS
@given(x=arrays(any32))
def test_fp16_is_numpys_round_to_nearest_even_cast(x):
    y = roundtrip(x, Codec.FP16)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(y, expected, equal_nan=True)
    assert np.array_equal(np.signbit(y[~np.isnan(x)]), np.signbit(expected[~np.isnan(x)]))


def test_fp16_non_finite_and_range_as_documented():
    x = np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 65504.0, 65519.0, 65520.0, -1e6, 2.0**-25, -(2.0**-25), 2.0**-24],
        dtype=np.float32,
    )
    y = roundtrip(x, Codec.FP16)
    assert np.isnan(y[:2]).all()
    assert y[2:].tolist() == [np.inf, -np.inf, 65504.0, 65504.0, np.inf, -np.inf, 0.0, -0.0, 2.0**-24]
    assert np.signbit(y[9])


@SETTINGS
@given(x=arrays(signed(2.0**-14, 65000.0), st.integers(0, 300)))
def test_fp16_relative_error_in_normal_range(x):
    y = roundtrip(x, Codec.FP16)
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-11)  # half an ulp of a 10-bit mantissa ≈ 4.9e-4


@SETTINGS
@given(x=arrays(any32, st.integers(0, 400)))  # the reference below is a Python loop
def test_bf16_keeps_nan_and_inf_and_rounds_to_nearest_even(x):
    y = roundtrip(x, Codec.BF16)
    nan = np.isnan(x)
    assert np.isnan(y[nan]).all()
    assert not np.isnan(y[~nan]).any()
    inf = np.isinf(x)
    assert np.array_equal(y[inf], x[inf])
    # exact reference: round the fp32 bits to the nearest even multiple of 2^16 in float64 arithmetic
    finite = x[~nan & ~inf].astype(np.float64)
    ref = _bf16_reference(finite)
    assert np.array_equal(y[~nan & ~inf].astype(np.float64), ref)


def _bf16_reference(v: np.ndarray) -> np.ndarray:
    out = []
    for value in v.tolist():
        bits = int(np.float32(value).view(np.uint32))
        low, high = bits & 0xFFFF, bits >> 16
        if low > 0x8000 or (low == 0x8000 and high & 1):
            high += 1
        out.append(float(np.uint32(high << 16).view(np.float32)))
    return np.array(out, dtype=np.float64)


def test_bf16_overflow_and_nan_as_documented():
    x = np.array([np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 3.38e38, 1.0], dtype=np.float32)
    y = roundtrip(x, Codec.BF16)
    assert np.isnan(y[0])
    assert y[1:5].tolist() == [np.inf, -np.inf, np.inf, -np.inf]
    assert np.isfinite(y[5]) and y[6] == 1.0


@SETTINGS
@given(x=arrays(signed(1e-20, 1e6, zero=True), st.integers(0, 300)))
def test_bf16_relative_error(x):
    y = roundtrip(x, Codec.BF16)
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-8)  # half an ulp of a 7-bit mantissa ≈ 3.9e-3


def _blocks(x: np.ndarray):
    for start in range(0, x.size, INT8_BLOCK):
        yield slice(start, start + INT8_BLOCK)


@SETTINGS
@given(x=arrays(signed(1e-30, 1e30, zero=True)))
def test_int8_error_is_half_a_step_of_the_block_absmax(x):
    y = roundtrip(x, Codec.INT8)
    for block in _blocks(x):
        absmax = float(np.abs(x[block]).max())
        err = np.abs(y[block].astype(np.float64) - x[block])
        assert err.max() <= absmax / 254 * (1 + 1e-5) + 1e-45, (absmax, err.max())


@SETTINGS
@given(
    x=arrays(finite32, st.integers(1, 2 * INT8_BLOCK + 5)),
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
    where=st.integers(min_value=0),
)
# found by Hypothesis: at float32's largest value, 127 × scale rounded past it and spared blocks decoded as inf
@example(x=np.full(INT8_BLOCK + 1, np.finfo(np.float32).max, np.float32), bad=np.nan, where=0)
def test_int8_block_with_nan_or_inf_decodes_as_all_nan_and_spares_the_others(x, bad, where):
    x = x.copy()
    pos = where % x.size
    x[pos] = bad
    y = roundtrip(x, Codec.INT8)
    for block in _blocks(x):
        if block.start <= pos < block.stop:
            assert np.isnan(y[block]).all()
        else:
            assert np.isfinite(y[block]).all()


@pytest.mark.parametrize("codec", list(Codec))
def test_empty_and_zero_arrays(codec):
    assert roundtrip(np.zeros(0, np.float32), codec).size == 0
    assert not roundtrip(np.zeros(5000, np.float32), codec).any()


@pytest.mark.parametrize("codec", list(Codec))
def test_codec_accepts_any_shape_and_dtype_it_can_cast(codec):
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4) / 7
    y = Compressor().decode(Compressor().encode(x, codec), codec, x.size)
    if codec is Codec.SPARSE:
        # only the 8 largest go, at 2 bits: 23/7 exactly, the others within a third of it
        assert np.flatnonzero(y).tolist() == list(range(16, 24)) and y[23] == np.float32(23 / 7)
        assert np.allclose(y[16:], x.reshape(-1)[16:], atol=23 / 7 / 3)
    elif codec is Codec.INT2:
        # each value to the nearest of ±0.5 and ±1.5 times the block's RMS: within half an RMS, or clipped
        flat = x.reshape(-1)
        rms = np.sqrt(np.mean(flat**2))
        assert np.all(np.abs(y - flat) <= 0.5 * rms + np.maximum(0, np.abs(flat) - 1.5 * rms) + 1e-6)
    else:
        assert np.allclose(y, x.reshape(-1), rtol=1e-2, atol=24 / 7 / 127)


@pytest.mark.parametrize("codec", list(Codec))
def test_untransform_refuses_a_payload_of_the_wrong_size(codec):
    raw = transform(np.ones(10, np.float32), codec)
    with pytest.raises(ProtocolError, match=f"codec {codec.label} need"):
        untransform(raw + b"\0", codec, 10)


@pytest.mark.parametrize("codec", [Codec.FP16, Codec.BF16, Codec.INT8])
def test_error_feedback_running_sum_converges_to_the_inputs(codec):
    """What quantisation drops is only delayed: Σ decoded − Σ inputs stays one quantisation error."""
    rng = np.random.default_rng(7)
    ef = ErrorFeedback(codec)
    sent_sum = np.zeros(3000, np.float64)
    input_sum = np.zeros(3000, np.float64)
    plain_sum = np.zeros(3000, np.float64)
    steps = 200
    for _ in range(steps):
        x = (rng.standard_normal(3000) * 1e-3 + 3e-4).astype(np.float32)
        raw, sent = ef.transform(x)
        assert untransform(raw, codec, x.size).tobytes() == sent.tobytes()  # bit for bit, zeros' signs too
        sent_sum += sent
        input_sum += x
        plain_sum += untransform(transform(x, codec), codec, x.size)
    gap = np.abs(sent_sum - input_sum).max()
    # the gap is the current residual, not an accumulation: no larger than one step's quantisation error
    assert np.allclose(sent_sum - input_sum, -ef.residual, atol=1e-6)
    one_step = np.abs(x - untransform(transform(x, codec), codec, x.size)).max()
    assert gap <= 4 * one_step + 1e-7
    assert gap < np.abs(plain_sum - input_sum).max() or codec is Codec.FP16


def _chunks(n: int):
    for start in range(0, n, SPARSE_CHUNK):
        yield slice(start, min(start + SPARSE_CHUNK, n))


def _sparse_levels(scale: float) -> np.ndarray:
    return np.array([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0]) * scale


@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 1000, 4096 + 3])
def test_sparse_sends_each_chunks_largest_values_at_two_bits(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    raw = transform(x, Codec.SPARSE)
    assert len(raw) == raw_size(Codec.SPARSE, n)
    y = untransform(raw, Codec.SPARSE, n)
    for chunk in _chunks(n):
        mags = np.abs(x[chunk])
        top = np.sort(np.argsort(-mags)[: min(SPARSE_K, mags.size)])
        assert np.flatnonzero(y[chunk]).tolist() == top.tolist()
        levels = _sparse_levels(float(mags.max()))
        kept = x[chunk][top].astype(np.float64)
        nearest = levels[np.abs(kept[:, None] - levels).argmin(axis=1)]
        assert np.allclose(y[chunk][top], nearest, rtol=1e-6, atol=0)
        assert np.abs(y[chunk][top] - kept).max() <= mags.max() / 3 * (1 + 1e-6)


def test_sparse_payload_is_14_bytes_a_chunk():
    # 4 (scale) + 8 (indices) + 2 (8 codes of 2 bits): 0.055 bytes a value; a short last chunk keeps fewer
    assert [raw_size(Codec.SPARSE, n) for n in (0, 1, 4, 5, 8, 256, 257, 264, 100 * 256)] == [
        0, 4 + 1 + 1, 4 + 4 + 1, 4 + 5 + 2, 4 + 8 + 2, 14, 14 + 6, 14 + 14, 1400,
    ]  # fmt: skip


@SETTINGS
@given(x=arrays(finite32, st.integers(0, 3 * SPARSE_CHUNK + 17)))
def test_sparse_keeps_at_most_k_of_the_largest_and_each_within_a_third_of_the_scale(x):
    y = roundtrip(x, Codec.SPARSE)
    assert np.isfinite(y).all()
    for chunk in _chunks(x.size):
        mags = np.abs(x[chunk].astype(np.float64))
        k = min(SPARSE_K, mags.size)
        sent = np.flatnonzero(y[chunk])
        assert sent.size <= k
        assert (mags[sent] >= np.sort(mags)[-k]).all()  # among the k largest (ties either way)
        err = np.abs(y[chunk][sent] - x[chunk][sent].astype(np.float64))
        assert (err <= mags.max() / 3 * (1 + 1e-6) + 1e-45).all()
        assert np.abs(y[chunk]).max(initial=0.0) == mags.max()  # the largest goes exactly


@SETTINGS
@given(
    x=arrays(finite32, st.integers(1, 3 * SPARSE_CHUNK + 5)),
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
    where=st.integers(min_value=0),
)
def test_sparse_chunk_with_nan_or_inf_decodes_as_all_nan_and_spares_the_others(x, bad, where):
    x = x.copy()
    pos = where % x.size
    x[pos] = bad
    y = roundtrip(x, Codec.SPARSE)
    for chunk in _chunks(x.size):
        if chunk.start <= pos < chunk.stop:
            assert np.isnan(y[chunk]).all()
        else:
            assert np.isfinite(y[chunk]).all()


def test_sparse_error_feedback_sends_every_value_in_time_and_loses_none():
    """A constant input: each round sends 8 values a chunk, and what was sent plus what is still owed is
    exactly every round's input; the owed values grow until they are among the largest, so all go."""
    rng = np.random.default_rng(3)
    n, rounds = 1000, 100
    x = (rng.uniform(0.5, 1.0, n) * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    ef = ErrorFeedback(Codec.SPARSE)
    sent_sum = np.zeros(n, np.float64)
    ever_sent = np.zeros(n, bool)
    for _ in range(rounds):
        raw, sent = ef.transform(x)
        assert untransform(raw, Codec.SPARSE, n).tobytes() == sent.tobytes()
        assert np.count_nonzero(sent) == 3 * SPARSE_K + min(SPARSE_K, n - 3 * SPARSE_CHUNK)
        sent_sum += sent
        ever_sent |= sent != 0
    assert ef.residual is not None
    assert np.allclose(sent_sum + ef.residual, rounds * x.astype(np.float64), rtol=0, atol=rounds * 1e-6)
    assert ever_sent.all()
    # what is owed stays about a chunk's input over the values it sends (256 × 0.75 / 8 = 24), however long
    assert np.abs(ef.residual).max() < 2 * SPARSE_CHUNK / SPARSE_K


@SETTINGS
@given(n=st.integers(1, 3 * SPARSE_CHUNK + 7), data=st.data())
def test_sparse_decodes_any_bytes_of_the_right_length_to_values(n, data):
    size = raw_size(Codec.SPARSE, n)
    raw = data.draw(st.binary(min_size=size, max_size=size))
    y = untransform(raw, Codec.SPARSE, n)
    assert y.dtype == np.float32 and y.shape == (n,)
    for chunk in _chunks(n):
        assert np.isnan(y[chunk]).all() or np.count_nonzero(y[chunk]) <= SPARSE_K
    with pytest.raises(ProtocolError, match=f"but {n} values in codec sparse need {size}"):
        untransform(raw[:-1], Codec.SPARSE, n)


def test_sparse_picks_past_a_short_last_chunk_or_repeated_write_nothing_outside():
    n = SPARSE_CHUNK + 3  # two chunks, the second keeps 3 values
    raw = bytearray(transform(np.ones(n, np.float32), Codec.SPARSE))
    assert len(raw) == 2 * 4 + SPARSE_K + 3 + 3
    picks = np.frombuffer(raw, np.uint8, offset=8, count=SPARSE_K + 3)
    picks[:SPARSE_K] = 5  # the first chunk names one value eight times
    picks[SPARSE_K:] = [3, 200, 255]  # the short chunk names values past n
    y = untransform(bytes(raw), Codec.SPARSE, n)
    assert y.shape == (n,)
    assert np.flatnonzero(y).tolist() == [5] and y[5] == 1.0  # the short chunk's values 200, 255 are dropped


def _int8_reference(x: np.ndarray) -> bytes:
    """The int8 payload written the plain way (|x|, max, divide, round, clip, cast), to pin the fast one."""
    n = x.size
    blocks = -(-n // INT8_BLOCK)
    view = np.zeros(blocks * INT8_BLOCK, np.float32)
    view[:n] = x
    view = view.reshape(blocks, INT8_BLOCK)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        scales = np.abs(view).max(axis=1) / np.float32(127.0)
        scales[~np.isfinite(scales)] = np.nan
        safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        q = np.clip(np.rint(view / safe[:, None]), -127, 127)
        q = np.nan_to_num(q, nan=0.0).astype(np.int8)
    return scales.astype(np.float32).tobytes() + q.reshape(-1)[:n].tobytes()


@pytest.mark.parametrize("n", [1, 5, INT8_BLOCK - 1, INT8_BLOCK, INT8_BLOCK + 1, 3 * INT8_BLOCK + 17])
def test_int8_payload_and_decoded_values_are_bit_for_bit_the_plain_computation(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 1e3).astype(np.float32)
    cases = [x, np.zeros(n, np.float32), np.full(n, -0.0, np.float32), np.full(n, np.float32(-3.4e38))]
    cases.append((rng.standard_normal(n) * 1e-42).astype(np.float32))  # subnormal
    for fill, step in ((np.nan, 13), (np.inf, 11), (-np.inf, 7), (-0.0, 5), (0.0, 3)):
        y = x.copy()
        y[::step] = fill
        cases.append(y)
    for case in cases:
        raw = transform(case, Codec.INT8)
        assert raw == _int8_reference(case)
        ef = ErrorFeedback(Codec.INT8)
        raw_ef, sent = ef.transform(case)
        assert raw_ef == raw
        decoded = untransform(raw, Codec.INT8, n)
        assert np.array_equal(decoded, sent, equal_nan=True)
        assert np.array_equal(np.signbit(decoded), np.signbit(sent))


def test_int8_error_feedback_keeps_a_copy_within_a_step_of_values_far_smaller_than_the_last():
    """Issue 51, point 3: a gradient 1000x smaller than the one before it in the same place (after a spike,
    early in training, or values last sent rounds ago). The residual of the large one is half a step of its
    blocks, 10x the new values: added whole, the copy was that old rounding error, not the gradient (an
    honest spot-check read 0.99 apart). An encode adds at most half a step of each value's block and keeps
    the rest: the copy stays within one step of its values, and nothing owed is lost."""
    rng = np.random.default_rng(51)
    n = 3 * INT8_BLOCK + 100
    big = (rng.standard_normal(n) * 10).astype(np.float32)
    small = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    ef = ErrorFeedback(Codec.INT8)
    sent_sum = np.zeros(n, np.float64)
    for x in (big, small, small, small):
        raw, sent = ef.transform(x)
        assert untransform(raw, Codec.INT8, n).tobytes() == sent.tobytes()
        sent_sum += sent
        blocks = [slice(a, min(a + INT8_BLOCK, n)) for a in range(0, n, INT8_BLOCK)]
        for b in blocks:
            step = np.abs(sent[b]).max() / 127
            # (half a step now, half a step of the values carried: their step may be a 254th above the copy's)
            assert np.abs(sent[b] - x[b]).max() <= 1.01 * step
    # what is still owed is kept: sent + residual = every input
    owed = big.astype(np.float64) + 3 * small
    assert np.allclose(sent_sum + ef.residual, owed, rtol=0, atol=1e-5)


def test_error_feedback_drops_non_finite_residuals_and_starts_afresh_on_another_length():
    ef = ErrorFeedback(Codec.INT8)
    x = np.array([1.0, np.nan, 0.3], np.float32)
    ef.transform(x)
    assert np.isfinite(ef.residual).all()
    ef.transform(np.array([1.0, 0.3, 0.3], np.float32))
    assert ef.residual[1] != 0  # 0.3 is off the int8 grid of absmax 1: an error to carry
    y = np.array([0.3, 1.0], np.float32)
    raw_y, _ = ef.transform(y)
    assert raw_y == transform(y, Codec.INT8)  # the residual of three values is not added to two
    raw, sent = ErrorFeedback(Codec.NONE).transform(x)
    assert np.array_equal(sent, x, equal_nan=True) and len(raw) == 12


def test_codec_parse_and_level_are_validated():
    assert Codec.parse("INT8") is Codec.INT8
    with pytest.raises(
        ConfigError, match=r"codec: unknown codec 'int4'; choose one of none, fp16, bf16, int8, sparse, int2$"
    ):
        Codec.parse("int4")
    with pytest.raises(ConfigError, match="zstd_level"):
        Compressor(level=23)


def test_decompress_refuses_before_allocating_beyond_the_limit():
    comp = Compressor(limits=Limits(max_frame_bytes=1000))
    body = Compressor().compress(b"\0" * 2000)
    with pytest.raises(LimitExceeded, match="declares 2000 raw bytes, more than the limit of 1000"):
        comp.decompress(body, 2000)
    with pytest.raises(ProtocolError, match="zstd body declares 2000 bytes but the header declares 999"):
        comp.decompress(body, 999)
    with pytest.raises(ProtocolError, match="not zstd data"):
        comp.decompress(b"garbage!", 10)


@pytest.mark.parametrize("codec", list(Codec))
def test_encoding_leaves_the_input_untouched_and_takes_read_only_arrays(codec):
    x = np.frombuffer(np.linspace(-3, 3, 9000, dtype=np.float32).tobytes(), dtype=np.float32)
    assert not x.flags.writeable
    before = x.copy()
    Compressor().encode(x, codec)
    ErrorFeedback(codec).transform(x)
    assert np.array_equal(x, before)


def test_int2_is_two_bits_a_value_at_the_rms_levels_and_a_broken_block_is_nan():
    rng = np.random.default_rng(11)
    x = rng.standard_normal(1000).astype(np.float32)
    raw = transform(x, Codec.INT2)
    assert (
        len(raw) == raw_size(Codec.INT2, 1000) == 4 * 4 + 250
    )  # 4 blocks of 256 (the last short): 2 bits a value
    y = untransform(raw, Codec.INT2, 1000)
    for b in range(4):
        block = slice(256 * b, min(256 * (b + 1), 1000))
        rms = np.sqrt(np.mean(x[block].astype(np.float64) ** 2))
        # every value decodes to one of the four levels, the nearest one (its error at most half a step)
        assert np.allclose(
            np.unique(np.abs(y[block])), [0.5 * rms, 1.5 * rms][: np.unique(np.abs(y[block])).size]
        )
        assert np.all(
            np.abs(y[block] - x[block]) <= 0.5 * rms + np.maximum(0, np.abs(x[block]) - 1.5 * rms) + 1e-5
        )
    x[300] = np.inf
    y = untransform(transform(x, Codec.INT2), Codec.INT2, 1000)
    assert np.isnan(y[256:512]).all() and np.isfinite(y[:256]).all() and np.isfinite(y[512:]).all()


def test_int2_error_feedback_delivers_the_running_sum():
    """Over R rounds of the same vector, what was sent plus what is held back is R times the vector, and the
    mean of what was sent approaches it (the quantisation error is carried, not lost)."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal(4096).astype(np.float32)
    ef = ErrorFeedback(Codec.INT2)
    sent_sum = np.zeros_like(x, dtype=np.float64)
    rounds = 50
    for _ in range(rounds):
        raw, sent = ef.transform(x)
        np.testing.assert_array_equal(untransform(raw, Codec.INT2, x.size), sent)
        sent_sum += sent
    assert np.allclose(sent_sum + ef.residual, rounds * x.astype(np.float64), atol=1e-3)
    once = np.abs(untransform(transform(x, Codec.INT2), Codec.INT2, x.size) - x).mean()
    assert np.abs(sent_sum / rounds - x).mean() < once / 10


def test_hostile_int2_payloads_decode_to_values_or_nan_and_a_wrong_length_is_refused():
    rng = np.random.default_rng(13)
    for n in (1, 255, 257, 5000):
        raw = rng.integers(0, 256, raw_size(Codec.INT2, n), dtype=np.uint8).tobytes()
        assert untransform(raw, Codec.INT2, n).shape == (n,)
        with pytest.raises(ProtocolError):
            untransform(raw[:-1], Codec.INT2, n)
