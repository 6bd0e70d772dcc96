"""Payload encoding: any message in, JSON text out.

The rule, applied once when a message is appended:

* A value JSON can spell (dicts with string keys, lists, strings, integers of any
  size, finite floats, booleans, None) is stored as it is and reads back equal.
* Anything else is stored as its closest JSON form: bytes as base64 text;
  datetimes, dates and times as ISO 8601 text; UUIDs and Decimals as text; enums
  as their value; subclasses of str, int and float as the value their base type
  holds (whatever the subclass overrides); tuples, sets and frozensets as lists;
  dataclasses and msgspec Structs as objects of their fields; any other object with
  attributes (a platform
  ``MessageEvent``, an SDK update object) as an object of its public attributes,
  nested to a depth of 32 and without following cycles; dict keys that are not
  strings as msgspec writes keys (numbers and enums by value, times as ISO 8601
  text, an object without attributes as its repr), any other as ``str(key)``; NaN
  and infinities as null (JSON has no spelling for them); lone UTF-16 surrogates as
  U+FFFD, as state.db itself scrubs them; and whatever is left as ``repr(value)``.

Decoding has a budget, so a stored payload cannot cost more memory or stack than a
reader can give it: ``decode`` refuses (``OverBudget``, a ``msgspec.DecodeError``)
a payload nested deeper than ``MAX_DEPTH`` or holding more than ``MAX_VALUES``
JSON values, before decoding it. Both are counted on the text, outside its strings,
at the speed of a byte scan. Encoding keeps within them for a message of ordinary
shape; a message deeper or wider than that is stored all the same, and its readers
quarantine (replay) or flag (``show``, ``export``) it rather than decode it.

One field is read, not just converted: a message's ``timestamp`` (a dict key or an
object's attribute) that is a datetime is stored as epoch seconds, a naive one read
once in the appending process's zone, so no later reader, in whatever zone, has to
guess it (``with_epoch_timestamp``).

Reading a record gives back the JSON form, so a converted value does not come back
as its original type. Encoding never raises: a value whose conversion itself fails
(an attribute or ``__iter__`` that raises, say) is stored as its ``repr()``, or as
``"<unrepresentable TYPE>"`` when even that fails. That is the smallest value that
raised, not the message around it: the dict or list holding it keeps every other
field as the rule above converts it.
"""

from __future__ import annotations

import array
import dataclasses
import datetime
import enum
import itertools
import re
from collections.abc import Mapping
from typing import Any

import msgspec

_MAX_DEPTH = 32

#: The deepest nesting of arrays and objects ``decode`` takes: well within the
#: interpreter's recursion limit (1,000) whatever the caller's own depth, so decoding
#: never raises ``RecursionError``.
MAX_DEPTH = 512
#: The most JSON values (each array, object, key and scalar) ``decode`` takes from one
#: payload: about ``MAX_VALUES * VALUE_BYTES`` = 128 MiB of Python objects.
MAX_VALUES = 2_000_000
#: What one decoded value costs in memory, about: a small object, string or number and
#: its slot in its container. ``decoded_bytes`` estimates a payload's cost with it.
VALUE_BYTES = 64

#: A JSON string (its quotes, and escapes within it): what the scans leave out.
_STRINGS = {
    bytes: re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL),
    str: re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL),
}
#: Keeps only the brackets of a text; opening ones become 1, closing ones -1 (as
#: signed bytes), so a running sum is the depth.
_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[{]}")

_encoder = msgspec.json.Encoder(enc_hook=lambda obj: _object_fields(obj))
_decoder = msgspec.json.Decoder()


def encode(message: Any) -> bytes:
    """Return ``message`` as UTF-8 JSON by the module's conversion rule."""
    try:
        return _encoder.encode(message)
    except Exception:  # noqa: BLE001 - the slow path below handles any value
        pass
    try:
        return _encoder.encode(_plain(message, 0, set()))
    except Exception:  # noqa: BLE001 - a value whose own code raises: keep what it says
        return _encoder.encode(_safe_repr(message))


def with_epoch_timestamp(message: Any) -> Any:
    """``message`` with a datetime ``timestamp`` replaced by its epoch seconds.

    A dict is copied (the caller's stays as it was); an object becomes its JSON
    form, a dict, with the number in place. Anything else comes back unchanged, and
    so does a message whose fields raise when read: this never raises.
    """
    kind = type(message)  # type(), never __class__, which a value may make raise
    if issubclass(kind, dict):
        try:
            stamp = message.get("timestamp")
        except Exception:  # noqa: BLE001 - a dict whose get raises: no time read
            return message
    elif issubclass(kind, (str, bytes, int, float, list, tuple)) or message is None:
        return message
    else:
        try:
            stamp = getattr(message, "timestamp", None)
        except Exception:  # noqa: BLE001 - an attribute that raises is not a time
            return message
    if not issubclass(type(stamp), datetime.datetime):
        return message
    try:
        # datetime's own method, whatever a subclass made of it; a naive datetime is
        # local time, read here once
        epoch = datetime.datetime.timestamp(stamp)
    except (OverflowError, OSError, ValueError):
        return message
    if issubclass(kind, dict):
        try:
            return {**message, "timestamp": epoch}
        except Exception:  # noqa: BLE001 - a dict whose keys raise: kept as it is
            return message
    plain = decode(encode(message))
    if isinstance(plain, dict):
        plain["timestamp"] = epoch
    return plain


class OverBudget(msgspec.DecodeError):
    """A payload deeper or wider than ``decode`` takes; the message says which."""


def decode(payload: str | bytes) -> Any:
    """Return the JSON value stored in a payload.

    Raises ``OverBudget`` (a ``msgspec.DecodeError``, as for text that is not JSON)
    when the payload is nested deeper than ``MAX_DEPTH`` or holds more than
    ``MAX_VALUES`` values; nothing is decoded then.
    """
    check_budget(payload)
    try:
        return _decoder.decode(payload)
    except RecursionError:  # only a caller already deep in its stack meets this
        raise OverBudget(f"nested too deep to decode here (at most {MAX_DEPTH} levels)") from None


def values_at_most(payload: str | bytes) -> int:
    """An upper bound of the values a payload decodes to, in four byte counts: its
    commas, colons and opening brackets, strings included (so it may count high)."""
    if isinstance(payload, str):
        count = payload.count
        return count(",") + count(":") + count("[") + count("{") + 1
    count_b = payload.count
    return count_b(b",") + count_b(b":") + count_b(b"[") + count_b(b"{") + 1


def decoded_bytes(payload: str | bytes) -> int:
    """About the most memory decoding ``payload`` takes: ``VALUE_BYTES`` per value
    (``values_at_most``) besides the text itself."""
    return VALUE_BYTES * values_at_most(payload)


def check_budget(payload: str | bytes) -> None:
    """Raise ``OverBudget`` if ``payload`` is nested deeper than ``MAX_DEPTH`` or
    holds more than ``MAX_VALUES`` values, counted outside its strings; else nothing.

    A payload whose brackets and separators, strings included, are within both
    limits passes on four byte counts; only others have their strings scanned.
    """
    if isinstance(payload, str):
        opening = payload.count("[") + payload.count("{")
    else:
        opening = payload.count(b"[") + payload.count(b"{")
    if opening <= MAX_DEPTH and values_at_most(payload) <= MAX_VALUES:
        return
    if isinstance(payload, str):
        structure = _STRINGS[str].sub("", payload).encode("utf-8", "surrogatepass")
    else:
        structure = _STRINGS[bytes].sub(b"", payload)
    values = values_at_most(structure)
    if values > MAX_VALUES:
        raise OverBudget(
            f"{values:,} JSON values or more, over the {MAX_VALUES:,} a payload may decode to"
        )
    brackets = structure.translate(_BRACKETS, _NOT_BRACKETS)
    if brackets.count(1) <= MAX_DEPTH:
        return
    depth = max(itertools.accumulate(array.array("b", brackets)), default=0)
    if depth > MAX_DEPTH:
        raise OverBudget(
            f"nested {depth:,} levels deep, over the {MAX_DEPTH} a payload may decode to"
        )


class _Fields(dict):  # type: ignore[type-arg]
    """An object's fields as the hook returns them. msgspec writes it as an object
    in a value's place; in a key's place it hands it back to the hook, which then
    gives up, so the slow path writes that key as ``str(key)``."""


def _object_fields(obj: Any) -> Any:
    """msgspec's hook for types it cannot encode natively."""
    kind = type(obj)  # never obj.__class__, which a value may make raise
    if issubclass(kind, _Fields):
        raise TypeError("an object as a dict key")
    if issubclass(kind, (str, int, float)):  # a subclass msgspec does not write natively
        return _base_value(obj)
    try:
        fields = _public_attributes(obj)
    except Exception:  # noqa: BLE001 - attributes that raise when read: this value only
        return _safe_repr(obj)
    if fields is not None:
        return _Fields(fields)
    return _safe_repr(obj)


def _base_value(obj: str | int | float) -> str | int | float:
    """A ``str``, ``int`` or ``float`` subclass's value as its base type holds it, read
    with the base type's own methods: whatever the subclass overrides (``__eq__``,
    ``__str__``, attributes that raise) does not change what is stored."""
    if issubclass(type(obj), str):
        return _scrub(str.__str__(obj))
    if issubclass(type(obj), int):
        return int.__int__(obj)
    return float.__float__(obj)


def _public_attributes(obj: Any) -> dict[str, Any] | None:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(obj, type):
        return {k: v for k, v in attrs.items() if isinstance(k, str) and not k.startswith("_")}
    return None


def _safe_repr(obj: Any) -> str:
    try:
        return _scrub(repr(obj))
    except Exception:  # noqa: BLE001 - a broken __repr__ must not lose the message
        return f"<unrepresentable {type(obj).__qualname__}>"


def _scrub(text: str) -> str:
    """Replace lone surrogates, which UTF-8 cannot carry, with U+FFFD."""
    try:
        text.encode()
    except UnicodeEncodeError:
        # UTF-16 joins surrogate pairs into their character and marks each lone
        # surrogate with a single U+FFFD.
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text


def _plain(value: Any, depth: int, active: set[int]) -> Any:
    """Convert ``value`` into JSON-safe Python values (the slow, general path); a
    value whose conversion raises becomes its repr, and only that value."""
    try:
        return _convert(value, depth, active)
    except Exception:  # noqa: BLE001 - its own code raised: keep what it says
        return _safe_repr(value)


def _convert(value: Any, depth: int, active: set[int]) -> Any:
    kind = type(value)  # never value.__class__, which a value may make raise
    if value is None or kind in (bool, int, float):
        return value  # the encoder writes NaN and infinities as null
    if kind is str:
        return _scrub(value)
    if issubclass(kind, enum.Enum):
        if depth >= _MAX_DEPTH:
            return _safe_repr(value)
        return _plain(value.value, depth + 1, active)
    if issubclass(kind, (str, int, float)):
        return _base_value(value)
    if depth >= _MAX_DEPTH or id(value) in active:
        return _safe_repr(value)
    active.add(id(value))
    try:
        if issubclass(kind, Mapping):
            return {_key(k): _plain(v, depth + 1, active) for k, v in value.items()}
        if issubclass(kind, (list, tuple, set, frozenset)):
            return [_plain(v, depth + 1, active) for v in value]
        try:
            native = msgspec.to_builtins(value, enc_hook=_refuse)
        except Exception:  # noqa: BLE001 - not a type msgspec knows natively
            native = _public_attributes(value)
            if native is None:
                return _safe_repr(value)
        return _plain(native, depth + 1, active)
    finally:
        active.discard(id(value))


def _key(key: Any) -> str:
    """A dict key as the fast path writes it, so a key does not depend on the path taken:
    msgspec's own form where it has one (an enum's value, an ISO time), else ``str(key)``."""
    if isinstance(key, str):
        return _scrub(key)
    try:
        return next(iter(_decoder.decode(_encoder.encode({key: None}))))
    except Exception:  # noqa: BLE001 - not a key msgspec writes: str(key) below
        pass
    try:
        return _scrub(str(key))
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the message
        return _safe_repr(key)


def _refuse(obj: Any) -> Any:
    raise TypeError(type(obj).__qualname__)
