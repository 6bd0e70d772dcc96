"""The payload rule: JSON values round-trip exactly, everything else converts."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import walspool

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(message=st.dictionaries(st.text(max_size=12), JSON, max_size=6))
def test_json_safe_dicts_round_trip_exactly(tmp_path_factory, message):
    path = tmp_path_factory.mktemp("rt") / "spool.db"
    with walspool.Spool(path, durability="normal") as spool:
        spool.append("s", message)
        (rec,) = spool.records()
    assert rec.message == message
    assert repr(rec.message) == repr(message)  # -0.0, int vs float, key order


# Values of any type take long to generate on a loaded machine; that is no failure.
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.from_type(type).flatmap(st.from_type) | st.binary() | st.datetimes())
def test_any_value_is_accepted(tmp_path_factory, value):
    path = tmp_path_factory.mktemp("any") / "spool.db"
    with walspool.Spool(path, durability="normal") as spool:
        receipt = spool.append("s", {"v": value})
        assert receipt.seq == 1
        (rec,) = spool.records()
    assert "v" in rec.message


class Kind(enum.Enum):
    TEXT = "text"


@dataclasses.dataclass
class Source:
    platform: str
    chat_id: str


class RawUpdate:
    def __init__(self) -> None:
        self.update_id = 7
        self._bot = object()
        self.me = self  # a cycle


class BrokenRepr:
    __slots__ = ()

    def __repr__(self) -> str:
        raise RuntimeError("no")


@dataclasses.dataclass
class Event:
    text: str
    message_type: Kind
    source: Source
    raw_message: object
    timestamp: datetime.datetime


def test_conversion_rule(spool):
    when = datetime.datetime(2026, 11, 29, 12, 0, 0, tzinfo=datetime.UTC)
    uid = uuid.UUID(int=5)
    message = {
        "bytes": b"\x00\xff",
        "buffers": [bytearray(b"\x00\xff"), memoryview(b"\x00\xff")],
        "when": when,
        "day": datetime.date(2026, 1, 2),
        "uuid": uid,
        "dec": decimal.Decimal("1.10"),
        "kind": Kind.TEXT,
        "tuple": (1, 2),
        "set": {3},
        "nan": float("nan"),
        "inf": float("-inf"),
        "surrogate": "a\udc80b",
        "pair": "\ud83d\ude00",
        "keys": {1: "one", (2, 3): "tuple"},
        "broken": BrokenRepr(),
        "event": Event("hi", Kind.TEXT, Source("telegram", "42"), RawUpdate(), when),
    }
    spool.append("s", message)
    (rec,) = spool.records()
    got = rec.message
    assert got["bytes"] == "AP8=" and got["buffers"] == ["AP8=", "AP8="]
    assert got["when"] == "2026-11-29T12:00:00Z"
    assert got["day"] == "2026-01-02"
    assert got["uuid"] == str(uid)
    assert got["dec"] == "1.10"
    assert got["kind"] == "text"
    assert got["tuple"] == [1, 2] and got["set"] == [3]
    assert got["nan"] is None and got["inf"] is None
    assert got["surrogate"] == "a\ufffdb"
    assert got["pair"] == "😀"
    assert got["keys"] == {"1": "one", "(2, 3)": "tuple"}
    assert got["broken"] == "<unrepresentable BrokenRepr>"
    event = got["event"]
    assert event["text"] == "hi" and event["message_type"] == "text"
    assert event["source"] == {"platform": "telegram", "chat_id": "42"}
    assert event["raw_message"]["update_id"] == 7
    assert "_bot" not in event["raw_message"]
    assert isinstance(event["raw_message"]["me"], str)  # the cycle is cut
    assert event["timestamp"] == "2026-11-29T12:00:00Z"


class Named:
    """A dict key msgspec cannot encode, whose ``str`` is not its ``repr``."""

    def __str__(self) -> str:
        return "named key"


@dataclasses.dataclass(slots=True)
class Slotted:
    """A dataclass without ``__dict__``, holding a value msgspec cannot encode."""

    number: int
    other: object


def test_conversion_rule_on_the_slow_path(spool):
    """Values converted one by one (a lone surrogate makes msgspec refuse the message):
    finite floats stay and the others are null, buffers are base64 as bytes are, an
    object with no attributes becomes its repr, a dataclass its fields even without
    ``__dict__``, a non-string key ``str(key)``."""
    bare = object()
    message = {
        "surrogate": "a\udc80",
        "float": 1.5,
        "nan": float("nan"),
        "infinities": [float("inf"), float("-inf"), float("1e999")],
        "buffers": [bytearray(b"ab"), memoryview(b"ab")],
        "bare": bare,
        "slotted": Slotted(7, bare),
        "keys": {Named(): "v"},
    }
    spool.append("s", message)
    (rec,) = spool.records()
    assert rec.message == {
        "surrogate": "a\ufffd",
        "float": 1.5,
        "nan": None,
        "infinities": [None, None, None],
        "buffers": ["YWI=", "YWI="],  # base64, as bytes
        "bare": repr(bare),
        "slotted": {"number": 7, "other": repr(bare)},
        "keys": {"named key": "v"},
    }


def test_a_non_string_key_is_str_of_the_key_on_the_fast_path(spool):
    spool.append("s", {"keys": {Named(): "v"}})
    (rec,) = spool.records()
    assert rec.message == {"keys": {"named key": "v"}}


class Plain:
    """An object msgspec cannot encode, with a public and a private attribute."""

    def __init__(self) -> None:
        self.a = 1
        self._private = 2


def test_objects_on_the_fast_path(spool):
    bare = object()
    spool.append("s", {"o": Plain(), "bare": bare})
    (rec,) = spool.records()
    assert rec.message == {"o": {"a": 1}, "bare": repr(bare)}


def test_nesting_is_cut_at_a_depth_of_32_exactly(spool):
    """The message is level 0: the list at level 32 is stored as its repr."""
    deep: list = []
    cur = deep
    for _ in range(40):
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    spool.append("s", {"surrogate": "\udc80", "deep": deep})  # the slow path cuts
    (rec,) = spool.records()
    value, levels = rec.message["deep"], 0
    while isinstance(value, list):
        value, levels = value[0], levels + 1
    assert levels == 31
    assert value == "[" * 9 + "[]" + "]" * 9


def test_non_dict_messages(spool):
    spool.append("s", "plain text")
    spool.append("s", [1, "two"])
    spool.append("s", None)
    assert [r.message for r in spool.records()] == ["plain text", [1, "two"], None]


def test_deep_nesting_is_cut_not_raised(spool):
    deep: list = []
    cur = deep
    for _ in range(5000):
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    spool.append("s", {"deep": deep})
    (rec,) = spool.records()
    assert isinstance(rec.message["deep"], list)


def _nested_at(depth: int, value: object) -> dict:
    """A message holding ``value`` at ``depth`` (the message is level 0, ``"deep"`` level
    1, each list one level more), and a lone surrogate that sends it down the slow path."""
    for _ in range(depth - 1):
        value = [value]
    return {"surrogate": "\udc80", "deep": value}


def _unwrap(message: dict, depth: int) -> object:
    value = message["deep"]
    for _ in range(depth - 1):
        (value,) = value
    return value


class Nested(enum.Enum):
    PAIR = (("x",),)


@dataclasses.dataclass
class Holder:
    items: list


def test_an_enums_value_and_an_objects_fields_are_one_level_further_down(spool):
    """At level 30 an enum's value sits at 31 (a list) and its inner tuple at 32 (cut, a
    repr); a dataclass's fields dict sits at 31 and the list in it at 32 (cut)."""
    spool.append("s", _nested_at(30, Nested.PAIR))
    spool.append("s", _nested_at(30, Holder(["x"])))
    enum_rec, object_rec = spool.records()
    assert _unwrap(enum_rec.message, 30) == ["('x',)"]
    assert _unwrap(object_rec.message, 30) == {"items": "['x']"}


def test_an_enum_holding_a_container_on_the_slow_path(spool):
    spool.append("s", {"surrogate": "\udc80", "kind": Nested.PAIR})
    (rec,) = spool.records()
    assert rec.message == {"surrogate": "\ufffd", "kind": [["x"]]}


class Unprintable:
    """A dict key msgspec cannot write (an object with attributes) whose ``str`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no str")

    def __repr__(self) -> str:
        return "<Unprintable>"


def test_a_key_whose_str_raises_is_its_repr(spool):
    spool.append("s", {"surrogate": "\udc80", "keys": {Unprintable(): "v"}})
    (rec,) = spool.records()
    assert rec.message == {"surrogate": "\ufffd", "keys": {"<Unprintable>": "v"}}


class RaisingFields:
    """An object whose attributes cannot be read: ``__dict__`` itself raises."""

    @property
    def __dict__(self):  # type: ignore[override]
        raise RuntimeError("no fields")

    def __repr__(self) -> str:
        return "<RaisingFields>"


def test_a_value_whose_conversion_raises_is_stored_as_its_repr_and_only_it(spool):
    spool.append("s", {"text": "hi", "event": RaisingFields()})
    (rec,) = spool.records()
    assert rec.message == {"text": "hi", "event": "<RaisingFields>"}


class Hostile:
    """An SDK object whose every attribute access raises (``__class__`` included, so
    even ``isinstance`` against an ABC raises)."""

    def __getattribute__(self, name: str):
        raise RuntimeError(f"no {name}")

    def __repr__(self) -> str:
        return "<Hostile>"


class NamedKey(Plain):
    """A dict key with attributes: msgspec's fast path refuses it, so the message
    takes the slow path; stored as ``str(key)``."""

    def __str__(self) -> str:
        return "named"


@pytest.mark.parametrize(
    ("extra", "stored"),
    [({}, {}), ({"keys": {NamedKey(): 1}}, {"keys": {"named": 1}})],
    ids=["fast", "slow"],
)
def test_a_raising_value_deep_in_a_message_keeps_the_message_around_it(spool, extra, stored):
    """The last resort applies to the smallest value that raised: an assistant message
    keeps its role, content and every readable field, on either path."""
    message = {
        "role": "assistant",
        "content": "calling a tool",
        "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": Hostile()}},
            {"id": "c2", "function": {"name": "g", "arguments": "{}"}},
        ],
        "reasoning": "because",
        **extra,
    }
    spool.append("s", message)
    (rec,) = spool.records()
    assert rec.message == {
        "role": "assistant",
        "content": "calling a tool",
        "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "<Hostile>"}},
            {"id": "c2", "function": {"name": "g", "arguments": "{}"}},
        ],
        "reasoning": "because",
        **stored,
    }


def test_an_object_is_not_cut_when_msgspec_encodes_the_message_in_one_pass(spool):
    """The depth cut belongs to the slow path: an object whose fields msgspec encodes
    (the fast path) is stored whole, past level 32."""
    deep: list = []
    cur = deep
    for _ in range(40):
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    holder = Plain()
    holder.deep = deep  # type: ignore[attr-defined]
    spool.append("s", {"o": holder})
    (rec,) = spool.records()
    assert rec.message == {"o": {"a": 1, "deep": deep}}


def test_a_datetime_timestamp_in_a_dict_is_stored_as_epoch_seconds(spool):
    when = datetime.datetime(2026, 1, 1, 9, 0, tzinfo=datetime.UTC)
    message = {"role": "user", "content": "hi", "timestamp": when}
    spool.append("s", message)
    (rec,) = spool.records()
    assert rec.message == {"role": "user", "content": "hi", "timestamp": when.timestamp()}
    assert message["timestamp"] is when  # the caller's dict is not changed


class StampedEvent:
    """A platform event object: public fields and a datetime ``timestamp``."""

    def __init__(self, when: datetime.datetime) -> None:
        self.text = "hi"
        self.timestamp = when


def test_an_objects_datetime_timestamp_is_stored_as_epoch_seconds(spool):
    when = datetime.datetime(2026, 1, 1, 9, 0, tzinfo=datetime.UTC)
    event = StampedEvent(when)
    spool.append("s", event)
    (rec,) = spool.records()
    assert rec.message == {"text": "hi", "timestamp": when.timestamp()}
    assert event.timestamp is when  # the caller's object is not changed


class IntKind(enum.IntEnum):
    TWO = 2


class SlottedKey:
    """An object without attributes whose ``str`` is not its ``repr``."""

    __slots__ = ()

    def __str__(self) -> str:
        return "str of the key"

    def __repr__(self) -> str:
        return "repr of the key"


KEYS = {
    "enum": Kind.TEXT,
    "int enum": IntKind.TWO,
    "datetime": datetime.datetime(2026, 1, 2, 3, 4),
    "date": datetime.date(2026, 1, 2),
    "uuid": uuid.UUID(int=5),
    "decimal": decimal.Decimal("1.10"),
    "float": 1.5,
    "bool": True,
    "none": None,
    "big int": 2**70,
    "tuple": (1, 2),
    "object without attributes": SlottedKey(),
    "object with attributes": Named(),
}


@pytest.mark.parametrize("case", KEYS)
def test_a_key_is_written_the_same_on_the_fast_and_the_slow_path(spool, case):
    """A lone surrogate elsewhere in a message sends it down the slow path; its keys
    must not change with it."""
    key = KEYS[case]
    spool.append("s", {"keys": {key: 1}})
    spool.append("s", {"keys": {key: 1}, "surrogate": "\udc80"})
    fast, slow = (rec.message["keys"] for rec in spool.records())
    assert fast == slow


@dataclasses.dataclass
class Unset:
    """A dataclass with a field its ``__init__`` does not set and nothing else did, and
    a value msgspec cannot encode (so the slow path reads its fields one by one)."""

    text: str
    other: object
    reply_to: str = dataclasses.field(init=False)


def test_a_dataclass_field_never_set_does_not_lose_the_message(spool):
    """On either path the message keeps its shape; the unset field is left out (the
    fast path) or null (the slow path), never an error that turns it all into a repr."""
    bare = object()
    spool.append("s", {"event": Unset("hi", bare)})
    spool.append("s", {"event": Unset("hi", bare), "surrogate": "\udc80"})
    fast, slow = (rec.message for rec in spool.records())
    assert fast == {"event": {"text": "hi", "other": repr(bare)}}
    assert slow == {
        "event": {"text": "hi", "other": repr(bare), "reply_to": None},
        "surrogate": "\ufffd",
    }


class Role(str):
    """A str subclass such as an SDK's role type: comparing or hashing it raises, and
    so do its ``__str__`` and ``__class__``."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing")

    __hash__ = str.__hash__

    def __str__(self) -> str:
        raise RuntimeError("no str")

    @property
    def __class__(self):  # type: ignore[override]
        raise RuntimeError("no class")


class Count(int):
    def __int__(self) -> int:
        return -1


class Ratio(float):
    pass


class Stamp(datetime.datetime):
    def timestamp(self) -> float:
        raise RuntimeError("no timestamp")


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_str_int_and_float_subclasses_keep_their_values(spool, slow):
    """A role held in a str subclass stays the role (it was stored as ``{}``, and with a
    raising ``__class__`` the whole message as its repr); int and float subclasses keep
    their numbers as their base types hold them, whatever the subclass overrides."""
    extra = {"keys": {NamedKey(): 1}} if slow else {}
    spool.append(
        "s",
        {
            "role": Role("assistant"),
            "n": Count(5),
            "r": Ratio(0.5),
            "l": [Role("x\udc80")],
            **extra,
        },
    )
    (rec,) = spool.records()
    assert {k: v for k, v in rec.message.items() if k != "keys"} == {
        "role": "assistant", "n": 5, "r": 0.5, "l": ["x\ufffd"]
    }  # fmt: skip


def test_a_timestamp_whose_methods_raise_is_kept_as_any_value(spool):
    """A datetime subclass overriding ``timestamp`` is read with datetime's own method;
    a timestamp whose ``__class__`` raises is not a time; neither makes append raise."""
    when = Stamp(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    spool.append("s", {"role": "user", "content": "a", "timestamp": when})
    spool.append("s", {"role": "user", "content": "b", "timestamp": Role("soon")})
    first, second = spool.records()
    assert first.message["timestamp"] == 1767323045.0  # 2026-01-02T03:04:05Z
    assert second.message == {"role": "user", "content": "b", "timestamp": "soon"}
