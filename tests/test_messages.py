"""Every control message round-trips through encode/decode; decoding is strict and names the field.

The strategies are derived from the schemas themselves (msgspec.inspect), constraints included, so a
message added to crowdtrain.protocol.messages is covered without touching this file.
"""

from __future__ import annotations

import json
import re

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crowdtrain.protocol import messages
from crowdtrain.protocol.errors import LimitExceeded, ProtocolError
from crowdtrain.protocol.limits import Limits

ALL_MESSAGES = sorted(
    (
        obj
        for obj in vars(messages).values()
        if isinstance(obj, type) and issubclass(obj, messages.Message) and obj is not messages.Message
    ),
    key=lambda cls: cls.__name__,
)
VERSIONED = [cls for cls in ALL_MESSAGES if "version" in cls.__struct_fields__]


def _only_ge_and_le(t: mi.IntType | mi.FloatType) -> None:
    assert t.gt is None and t.lt is None and t.multiple_of is None, f"teach tests/test_messages.py {t!r}"


def fits(t: mi.StrType, text: str) -> bool:
    return (t.min_length or 0) <= len(text) <= (t.max_length or len(text)) and (
        t.pattern is None or re.search(t.pattern, text) is not None
    )


def strategy_for(t: mi.Type) -> st.SearchStrategy:
    if isinstance(t, mi.StructType):
        return struct_strategy(t)
    if isinstance(t, mi.IntType):
        _only_ge_and_le(t)
        low = -(2**63) if t.ge is None else t.ge
        return st.integers(min_value=low, max_value=2**63 - 1 if t.le is None else t.le)
    if isinstance(t, mi.FloatType):
        _only_ge_and_le(t)
        # JSON has no NaN or inf: msgspec writes them as null, which a float field then refuses (see below).
        return st.floats(min_value=t.ge, max_value=t.le, allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.StrType):
        if t.pattern is not None:
            return st.from_regex(t.pattern, fullmatch=True).filter(lambda text: fits(t, text))
        return st.text(min_size=t.min_length or 0, max_size=min(20, t.max_length or 20))
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(strategy_for(x) for x in t.types))
    if isinstance(t, mi.ListType):
        return st.lists(
            strategy_for(t.item_type), min_size=t.min_length or 0, max_size=min(3, t.max_length or 3)
        )
    if isinstance(t, mi.TupleType):
        return st.tuples(*(strategy_for(x) for x in t.item_types))
    if isinstance(t, mi.DictType):
        return st.dictionaries(strategy_for(t.key_type), strategy_for(t.value_type), max_size=3)
    raise AssertionError(f"add a strategy for {t!r} to tests/test_messages.py")


def struct_strategy(t: mi.StructType) -> st.SearchStrategy:
    fields = {}
    for f in t.fields:
        value = strategy_for(f.type)
        if not f.required:
            if f.default is not msgspec.NODEFAULT:
                default = st.just(f.default)
            elif f.default_factory is not msgspec.NODEFAULT:
                default = st.builds(f.default_factory)
            else:  # an optional field left out when unset (``X | UnsetType = UNSET``)
                default = st.just(msgspec.UNSET)
            value = st.one_of(default, value)
        fields[f.name] = value
    return st.fixed_dictionaries(fields).map(lambda kw: t.cls(**kw))


def message_strategy(cls: type[messages.Message]) -> st.SearchStrategy:
    return struct_strategy(mi.type_info(cls))


def minimal(t: mi.Type):
    """A small valid JSON value of type ``t``, with every field of a struct present."""
    if isinstance(t, mi.StructType):
        return {f.name: minimal(f.type) for f in t.fields}
    if isinstance(t, mi.UnionType):
        return minimal(next((x for x in t.types if not isinstance(x, mi.NoneType)), t.types[0]))
    if isinstance(t, mi.LiteralType):
        return t.values[0]
    if isinstance(t, mi.StrType):
        text = next((x for x in ("x", "0" * 40, "0" * 64, "l" + "0" * 64) if fits(t, x)), None)
        assert text is not None, f"add a value for {t!r} to tests/test_messages.py"
        return text
    if isinstance(t, mi.IntType | mi.FloatType):
        value = 0 if isinstance(t, mi.IntType) else 0.5
        return max(value, t.ge) if t.ge is not None else value
    simple = {mi.BoolType: False, mi.NoneType: None}
    for kind, value in simple.items():
        if isinstance(t, kind):
            return value
    if isinstance(t, mi.ListType):
        return [minimal(t.item_type)]
    if isinstance(t, mi.TupleType):
        return [minimal(x) for x in t.item_types]
    if isinstance(t, mi.DictType):
        return {minimal(t.key_type): minimal(t.value_type)}
    raise AssertionError(f"add a value for {t!r} to tests/test_messages.py")


def sample_json(cls: type[messages.Message]) -> dict:
    """A valid instance of ``cls`` as a JSON object, every field present."""
    obj = minimal(mi.type_info(cls))
    messages.decode(json.dumps(obj), cls)  # it is valid as it stands
    return obj


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_message_round_trips(cls, data):
    msg = data.draw(message_strategy(cls))
    wire = messages.encode(msg)
    assert messages.decode(wire, cls) == msg
    assert messages.decode(wire.decode(), cls) == msg
    assert messages.convert(messages.to_builtins(msg), cls) == msg


def test_there_are_messages_for_every_exchange_the_issue_names():
    names = {cls.__name__ for cls in ALL_MESSAGES}
    assert {"RunSpec", "JoinRequest", "Heartbeat", "GroupAssignment", "StateManifest"} <= names


@pytest.mark.parametrize("cls", VERSIONED, ids=lambda c: c.__name__)
def test_unknown_version_is_refused_naming_the_field(cls):
    obj = sample_json(cls)
    obj["version"] = 2
    with pytest.raises(ProtocolError, match=r"`\$\.version`") as info:
        messages.decode(json.dumps(obj), cls)
    assert str(info.value).startswith(f"{cls.__name__}: ")


WITH_REQUIRED = [cls for cls in ALL_MESSAGES if any(f.required for f in mi.type_info(cls).fields)]


@pytest.mark.parametrize("cls", WITH_REQUIRED, ids=lambda c: c.__name__)
def test_missing_required_field_is_refused_naming_it(cls):
    for name in (f.name for f in mi.type_info(cls).fields if f.required):
        obj = sample_json(cls)
        del obj[name]
        with pytest.raises(ProtocolError, match=f"{cls.__name__}: Object missing required field `{name}`"):
            messages.decode(json.dumps(obj), cls)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_extra_field_is_refused_naming_it(cls):
    obj = sample_json(cls)
    obj["surprise"] = 1
    with pytest.raises(ProtocolError, match=f"{cls.__name__}: Object contains unknown field `surprise`"):
        messages.decode(json.dumps(obj), cls)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_ill_typed_field_is_refused_naming_it(cls):
    for f in mi.type_info(cls).fields:
        obj = sample_json(cls)
        # an array is valid for no scalar, struct or dict field; list fields get an object instead
        wrong = {"x": 1} if isinstance(f.type, mi.ListType) else [1]
        obj[f.name] = wrong
        with pytest.raises(ProtocolError, match=rf"{cls.__name__}: Expected .* - at `\$\.{f.name}`"):
            messages.decode(json.dumps(obj), cls)


def test_nested_ill_typed_field_names_its_path():
    obj = sample_json(messages.RunSpec)
    obj["averaging"] = {"group_size": "four"}
    with pytest.raises(
        ProtocolError, match=r"RunSpec: Expected `int`, got `str` - at `\$\.averaging\.group_size`"
    ):
        messages.decode(json.dumps(obj), messages.RunSpec)


STATE = {"step": 0, "content_hash": "ab" * 32, "size": 1}


@pytest.mark.parametrize(
    ("cls", "field", "value", "problem"),
    [
        (messages.Heartbeat, "step", -1, "Expected `int` >= 0"),
        (messages.Heartbeat, "samples", 2**53 + 1, "Expected `int` <= 9007199254740992"),
        (messages.Heartbeat, "samples_per_s", -0.5, "Expected `float` >= 0.0"),
        (messages.Heartbeat, "bt_port", 0, "Expected `int` >= 1"),
        (messages.Heartbeat, "bt_port", 65536, "Expected `int` <= 65535"),
        (messages.ReadyRequest, "weight", -1, "Expected `int` >= 0"),
        (messages.JoinRequest, "public_key", "AB" * 32, "Expected `str` of 64 lowercase hex characters"),
        (messages.JoinRequest, "public_key", "ab" * 32 + "\n", "Expected `str` of length <= 64"),
        (messages.JoinRequest, "device", "x" * 101, "Expected `str` of length <= 100"),
        (messages.DatasetRegistration, "infohash", "XYZ", "Expected `str` of 40 lowercase hex characters"),
        (messages.DatasetRegistration, "name", "", "Expected `str` of length >= 1"),
        (messages.ModelSpec, "param_hash", "zz", "Expected `str` of 64 lowercase hex characters (or empty)"),
        (messages.StateDeclare, "older", [STATE] * 4, "Expected `array` of length <= 3"),
    ],
)
def test_a_field_out_of_its_range_is_refused_naming_it(cls, field, value, problem):
    """The schemas state what each field may hold; decode and convert (a TOML spec) refuse the rest alike."""
    obj = sample_json(cls)
    obj[field] = value
    expected = f"{cls.__name__}: {problem} - at `$.{field}`"
    with pytest.raises(ProtocolError) as decoded:
        messages.decode(json.dumps(obj), cls)
    with pytest.raises(ProtocolError) as converted:
        messages.convert(obj, cls)
    assert str(decoded.value) == str(converted.value) == expected


def test_the_edges_of_each_range_are_accepted():
    hb = messages.Heartbeat(peer_id="p", step=0, samples=2**53, samples_per_s=1e12, bt_port=65535)
    assert messages.decode(messages.encode(hb), messages.Heartbeat) == hb
    declare = messages.StateDeclare(
        peer_id="p",
        state=messages.StateVersion(step=2**53, content_hash="ab" * 32, size=1 << 42),
        older=[messages.StateVersion(step=0, content_hash="cd" * 32, size=0)] * 3,
    )
    assert messages.decode(messages.encode(declare), messages.StateDeclare) == declare
    unfilled = messages.ModelSpec(recipe="mlp")  # `run create` fills in the parameter hash
    assert messages.decode(messages.encode(unfilled), messages.ModelSpec).param_hash == ""


def test_strict_decoding_does_not_coerce_strings_to_numbers():
    obj = sample_json(messages.Heartbeat)
    obj["step"] = "3"
    with pytest.raises(ProtocolError, match=r"Expected `int`, got `str` - at `\$\.step`"):
        messages.decode(json.dumps(obj), messages.Heartbeat)


def test_non_finite_floats_travel_as_null_and_are_refused_where_a_float_is_required():
    hb = messages.Heartbeat(peer_id="p", step=1, samples=2, samples_per_s=float("nan"), loss=float("inf"))
    wire = messages.encode(hb)
    assert b'"samples_per_s":null' in wire and b'"loss":null' in wire
    with pytest.raises(
        ProtocolError, match=r"Heartbeat: Expected `float`, got `null` - at `\$\.samples_per_s`"
    ):
        messages.decode(wire, messages.Heartbeat)


def test_not_json_and_not_an_object_are_protocol_errors():
    with pytest.raises(ProtocolError, match="JoinRequest is not valid JSON"):
        messages.decode(b"{not json", messages.JoinRequest)
    with pytest.raises(ProtocolError, match=r"JoinRequest: Expected `object`, got `array`"):
        messages.decode(b"[]", messages.JoinRequest)


def test_oversized_message_is_refused_before_parsing():
    limits = Limits(max_json_bytes=100)
    wire = messages.encode(messages.ErrorBody(error="x" * 200))
    with pytest.raises(LimitExceeded, match=r"ErrorBody message is 212 bytes, more than the limit of 100"):
        messages.decode(wire, messages.ErrorBody, limits)


def test_convert_is_strict_too():
    with pytest.raises(ProtocolError, match=r"LeaveRequest: Object missing required field `peer_id`"):
        messages.convert({"version": 1}, messages.LeaveRequest)
    assert messages.convert({"peer_id": "a"}, messages.LeaveRequest) == messages.LeaveRequest(peer_id="a")


def test_replace_returns_a_changed_copy():
    msg = messages.LeaveRequest(peer_id="a")
    assert messages.replace(msg, peer_id="b").peer_id == "b" and msg.peer_id == "a"
    with pytest.raises(AttributeError):
        msg.peer_id = "c"  # frozen
    assert isinstance(msg, msgspec.Struct)


def test_a_compute_share_past_any_share_is_refused_not_shown_as_infinity():
    """Issue 29: a reported compute share of 1e308 showed as "Infinity%" on the run page."""
    from crowdtrain.protocol.errors import ProtocolError
    from crowdtrain.protocol.messages import Heartbeat, decode, encode

    fine = Heartbeat(peer_id="p", step=1, samples=0, samples_per_s=1.0, compute_share=0.97)
    assert decode(encode(fine), Heartbeat).compute_share == 0.97
    with pytest.raises(ProtocolError, match="compute_share"):
        decode(encode(fine).replace(b"0.97", b"1e308"), Heartbeat)
