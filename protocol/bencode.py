"""Bencode (BEP 3) with bounds: the tracker's and the CLI's encoder/decoder, with no libtorrent.

Decoding refuses anything longer than ``max_bytes``, nested deeper than ``max_depth``, strings longer
than what is left of the input, integers with leading zeros or more than ``max_int_digits`` digits,
dictionary keys that are not byte strings, and trailing bytes; every defect is a :class:`ProtocolError`
that says where. Values decode to ``int``, ``bytes``, ``list`` and ``dict[bytes, ...]``.

Encoding accepts ``int``, ``bytes``, ``str`` (UTF-8), ``list``/``tuple`` and ``dict`` with ``bytes`` or
``str`` keys, and writes keys in sorted raw-byte order as BEP 3 requires.
"""

from __future__ import annotations

import hashlib
from typing import Any

from crowdtrain.protocol.errors import LimitExceeded, ProtocolError

Bencodable = int | bytes | str | list[Any] | tuple[Any, ...] | dict[Any, Any]

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_DEPTH = 32
DEFAULT_MAX_INT_DIGITS = 32


def encode(value: Bencodable) -> bytes:
    out: list[bytes] = []
    _encode(value, out, 0)
    return b"".join(out)


def _encode(value: Any, out: list[bytes], depth: int) -> None:
    if depth > DEFAULT_MAX_DEPTH:
        raise ProtocolError(f"bencode value is nested deeper than {DEFAULT_MAX_DEPTH} levels")
    if isinstance(value, bool):
        raise ProtocolError("bencode has no booleans; use 0 or 1")
    if isinstance(value, int):
        out.append(b"i%de" % value)
    elif isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        out.append(b"%d:" % len(raw))
        out.append(raw)
    elif isinstance(value, str):
        raw = value.encode()
        out.append(b"%d:" % len(raw))
        out.append(raw)
    elif isinstance(value, list | tuple):
        out.append(b"l")
        for item in value:
            _encode(item, out, depth + 1)
        out.append(b"e")
    elif isinstance(value, dict):
        items: list[tuple[bytes, Any]] = []
        for key, item in value.items():
            if isinstance(key, str):
                key = key.encode()
            if not isinstance(key, bytes):
                raise ProtocolError(f"bencode dictionary keys must be strings, not {type(key).__name__}")
            items.append((key, item))
        items.sort(key=lambda kv: kv[0])
        out.append(b"d")
        for i, (key, item) in enumerate(items):
            if i and items[i - 1][0] == key:
                raise ProtocolError(f"bencode dictionary has the key {key!r} twice")
            out.append(b"%d:" % len(key))
            out.append(key)
            _encode(item, out, depth + 1)
        out.append(b"e")
    else:
        raise ProtocolError(f"cannot bencode a value of type {type(value).__name__}")


class _Decoder:
    __slots__ = ("data", "max_depth", "max_int_digits", "pos")

    def __init__(self, data: bytes, max_depth: int, max_int_digits: int) -> None:
        self.data = data
        self.pos = 0
        self.max_depth = max_depth
        self.max_int_digits = max_int_digits

    def fail(self, problem: str) -> ProtocolError:
        return ProtocolError(f"bencode is malformed at byte {self.pos}: {problem}")

    def value(self, depth: int) -> Any:
        data = self.data
        if self.pos >= len(data):
            raise self.fail("the input ends where a value was expected")
        c = data[self.pos]
        if c == 0x69:  # i
            return self.integer()
        if 0x30 <= c <= 0x39:
            return self.string()
        if c == 0x6C or c == 0x64:  # l, d
            if depth >= self.max_depth:
                raise LimitExceeded(f"bencode is nested deeper than {self.max_depth} levels")
            self.pos += 1
            if c == 0x6C:
                items: list[Any] = []
                while True:
                    if self.pos >= len(data):
                        raise self.fail("a list is not terminated with 'e'")
                    if data[self.pos] == 0x65:
                        self.pos += 1
                        return items
                    items.append(self.value(depth + 1))
            result: dict[bytes, Any] = {}
            while True:
                if self.pos >= len(data):
                    raise self.fail("a dictionary is not terminated with 'e'")
                if data[self.pos] == 0x65:
                    self.pos += 1
                    return result
                if not 0x30 <= data[self.pos] <= 0x39:
                    raise self.fail("a dictionary key is not a byte string")
                key = self.string()
                if key in result:
                    raise self.fail(f"the dictionary key {key[:40]!r} appears twice")
                # BEP 3 wants sorted keys; some encoders get it wrong and the order does not change the
                # meaning, so an unsorted dictionary is read as it is.
                result[key] = self.value(depth + 1)
        raise self.fail(f"unexpected byte {bytes([c])!r}")

    def integer(self) -> int:
        data = self.data
        end = data.find(b"e", self.pos + 1, self.pos + 2 + self.max_int_digits + 1)
        if end < 0:
            if data.find(b"e", self.pos + 1) < 0:
                raise self.fail("an integer is not terminated with 'e'")
            raise LimitExceeded(
                f"bencode integer at byte {self.pos} has more than {self.max_int_digits} digits"
            )
        raw = data[self.pos + 1 : end]
        digits = raw[1:] if raw.startswith(b"-") else raw
        if not digits or not digits.isdigit():
            raise self.fail(f"{raw[:40]!r} is not an integer")
        if len(digits) > 1 and digits.startswith(b"0"):
            raise self.fail("an integer has a leading zero")
        if raw == b"-0":
            raise self.fail("-0 is not a valid integer")
        self.pos = end + 1
        return int(raw)

    def string(self) -> bytes:
        data = self.data
        colon = data.find(b":", self.pos, self.pos + 21)
        if colon < 0:
            raise self.fail("a string length is not followed by ':'")
        raw = data[self.pos : colon]
        if not raw.isdigit():
            raise self.fail(f"{raw!r} is not a string length")
        if len(raw) > 1 and raw.startswith(b"0"):
            raise self.fail("a string length has a leading zero")
        length = int(raw)
        start = colon + 1
        if length > len(data) - start:
            raise self.fail(f"a string declares {length} bytes but only {len(data) - start} are left")
        self.pos = start + length
        return data[start : self.pos]


def decode(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_int_digits: int = DEFAULT_MAX_INT_DIGITS,
) -> Any:
    """Decode exactly one bencoded value that fills ``data``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"bencode input must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise LimitExceeded(f"bencode input is {len(data)} bytes, more than the limit of {max_bytes}")
    decoder = _Decoder(data, max_depth, max_int_digits)
    value = decoder.value(0)
    if decoder.pos != len(data):
        raise decoder.fail(f"{len(data) - decoder.pos} bytes follow the value")
    return value


def info_span(torrent: bytes) -> tuple[int, int]:
    """Byte range of the raw ``info`` dictionary inside a .torrent file (for hashing it as it was written)."""
    top = decode(torrent)
    if not isinstance(top, dict) or not isinstance(top.get(b"info"), dict):
        raise ProtocolError("the torrent has no 'info' dictionary")
    # Walk the top-level dictionary again to find where the info value starts and ends.
    decoder = _Decoder(torrent, DEFAULT_MAX_DEPTH, DEFAULT_MAX_INT_DIGITS)
    decoder.pos = 1
    while torrent[decoder.pos] != 0x65:
        key = decoder.string()
        start = decoder.pos
        decoder.value(1)
        if key == b"info":
            return start, decoder.pos
    raise ProtocolError("the torrent has no 'info' dictionary")  # unreachable after the check above


def infohash_v1(torrent: bytes) -> str:
    """The v1 info-hash (SHA-1 of the bencoded info dictionary, as written) in lowercase hex."""
    start, end = info_span(torrent)
    return hashlib.sha1(torrent[start:end]).hexdigest()
