"""Bounded bencode: round trips, BEP 3 canonical output, and every malformed input refused with a sentence."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain.protocol import bencode
from crowdtrain.protocol.errors import LimitExceeded, ProtocolError

values = st.recursive(
    st.integers(min_value=-(10**30), max_value=10**30) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.binary(max_size=10), inner, max_size=5),
    max_leaves=20,
)


@given(values)
def test_round_trip(value):
    assert bencode.decode(bencode.encode(value)) == value


def test_encoding_is_canonical_with_sorted_keys():
    assert bencode.encode({"b": 1, "a": [b"x", "é", -3]}) == b"d1:al1:x2:\xc3\xa9i-3ee1:bi1ee"
    assert bencode.encode(0) == b"i0e"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "the input ends where a value was expected"),
        (b"i12", "an integer is not terminated with 'e'"),
        (b"i-0e", "-0 is not a valid integer"),
        (b"i03e", "an integer has a leading zero"),
        (b"ie", "b'' is not an integer"),
        (b"i1xe", "b'1x' is not an integer"),
        (b"5:abc", "a string declares 5 bytes but only 3 are left"),
        (b"03:abc", "a string length has a leading zero"),
        (b"l1:a", "a list is not terminated with 'e'"),
        (b"di1ei2ee", "a dictionary key is not a byte string"),
        (b"d1:ai1e1:ai2ee", "the dictionary key b'a' appears twice"),
        (b"i1ei2e", "bencode is malformed at byte 3: 3 bytes follow the value"),
        (b"x", "unexpected byte b'x'"),
        (b"123456789012345678901234:a", "is not followed by ':'"),
    ],
)
def test_malformed_input_is_refused_with_a_sentence(data, message):
    with pytest.raises(ProtocolError) as info:
        bencode.decode(data)
    assert message in str(info.value)


def test_depth_and_size_and_digits_are_bounded():
    with pytest.raises(LimitExceeded, match="nested deeper than 32 levels"):
        bencode.decode(b"l" * 33 + b"e" * 33)
    nested: list = []
    for _ in range(31):
        nested = [nested]
    assert bencode.decode(b"l" * 32 + b"e" * 32) == nested
    with pytest.raises(LimitExceeded, match="more than the limit of 10"):
        bencode.decode(b"11:hello world", max_bytes=10)
    with pytest.raises(LimitExceeded, match="more than 32 digits"):
        bencode.decode(b"i" + b"9" * 40 + b"e")


def test_infohash_is_sha1_of_the_info_dictionary_as_written():
    info = b"d6:lengthi3e4:name1:x12:piece lengthi16384e6:pieces20:" + b"p" * 20 + b"e"
    torrent = b"d8:announce5:x/ann4:info" + info + b"e"
    assert bencode.infohash_v1(torrent) == hashlib.sha1(info).hexdigest()
    with pytest.raises(ProtocolError, match="no 'info' dictionary"):
        bencode.infohash_v1(b"d8:announce1:xe")


def test_encoder_refuses_what_bencode_cannot_hold():
    with pytest.raises(ProtocolError, match="no booleans"):
        bencode.encode(True)
    with pytest.raises(ProtocolError, match="type float"):
        bencode.encode(1.5)
    with pytest.raises(ProtocolError, match="keys must be strings"):
        bencode.encode({1: 2})


@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_protocol_error_only(data):
    try:
        bencode.decode(data)
    except ProtocolError:
        pass
