"""The field codec of the typed wire messages (workers/messages.py): each field checked against
its type hint on construction (lists become tuples, ...), written to msgpack-ready values, and
read back from a peer's with the same checks. `Record` is a typed value nested in a message."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, TypeVar

from pdserve.workers.kv.events import KVEvent, KVEventKind

UINT64_MAX = (1 << 64) - 1


class Record:
    """A typed value nested inside a message (a frozen dataclass, checked like a
    message's fields); on the wire, the array of its field values in order."""

    def __post_init__(self) -> None:
        check_fields(self)


# -- field types -------------------------------------------------------------------

T = TypeVar("T")


def _per_class(fn: typing.Callable[[type], T]) -> typing.Callable[[type], T]:
    """`functools.cache` for a function of a class (typed: mypy does not take classes as Hashable)."""
    cache: dict[type, T] = {}

    def cached(cls: type) -> T:
        if cls not in cache:
            cache[cls] = fn(cls)
        return cache[cls]

    return cached


@_per_class
def fields_of(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(cls)


@_per_class
def hints_of(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@_per_class
def _field_specs(cls: type) -> tuple[tuple[str, Any, str], ...]:
    """(name, type hint, name for errors) of each field: computed once per class, used per message."""
    hints = hints_of(cls)
    return tuple((f.name, hints[f.name], f"{cls.__name__}.{f.name}") for f in fields_of(cls))


@_per_class
def version_of(cls: type) -> int:
    (version,) = (f.default for f in fields_of(cls) if f.name == "version")
    return int(version)  # type: ignore[arg-type]


def check_fields(obj: Any) -> None:
    """Check every field of a message or record against its type hint (lists become tuples, ...)."""
    for name, ok, hint, where in _field_checks(type(obj)):
        value = getattr(obj, name)
        if ok(value):  # the common case: already the declared type, nothing to convert
            continue
        checked = _check(where, hint, value)
        if checked is not value:
            object.__setattr__(obj, name, checked)


# Fast field checks. Why: a token delta has 14 fields and the gateway builds one per token per
# request; `_check`'s generic walk (typing.get_origin per field, per value) was most of a
# TokenDeltaBatch's decode time. Each predicate is True only where `_check` would return the value
# unchanged; anything else (a list to convert, an int for a float, a bad value) goes to `_check`.
_Ok = typing.Callable[[Any], bool]


def _ok_for(hint: Any) -> _Ok:
    if hint is int:
        return lambda v: type(v) is int and _INT64_MIN <= v <= UINT64_MAX
    if hint in (str, bool, float):
        return lambda v: type(v) is hint
    if isinstance(hint, type) and issubclass(hint, (Record, enum.Enum)):
        return lambda v: type(v) is hint
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            inner = _ok_for(args[0])
            return lambda v: v is None or inner(v)
    if hint == _EVENT_TUPLE:  # a snapshot holds every cached block: ~10x faster than the full check
        return lambda v: type(v) is tuple and all(map(_event_ok, v))
    if origin is tuple:
        item = _ok_for(typing.get_args(hint)[0])
        return lambda v: type(v) is tuple and all(map(item, v))
    return lambda v: False  # the rest: always the full check


def _event_ok(e: Any) -> bool:
    """A KVEvent as `_check_event` would return it unchanged."""
    return (type(e) is KVEvent and type(e.kind) is KVEventKind and type(e.block_hash) is int
            and 0 <= e.block_hash <= UINT64_MAX
            and (e.parent_hash is None or (type(e.parent_hash) is int and 0 <= e.parent_hash <= UINT64_MAX)))


@_per_class
def _field_checks(cls: type) -> tuple[tuple[str, _Ok, Any, str], ...]:
    return tuple((name, _ok_for(hint), hint, where) for name, hint, where in _field_specs(cls))


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


_INT64_MIN = -(1 << 63)
_INT_TUPLE = tuple[int, ...]
_EVENT_TUPLE = tuple[KVEvent, ...]


def _check(where: str, hint: Any, value: Any) -> Any:
    """`value` if it is a `hint` (lists become tuples, enum values become members); else ValueError."""
    # Fast paths first: every header and ack goes through here.
    # `type(...) is`, not isinstance: a bool must not pass as an int, nor an IntEnum.
    if hint is int:
        if type(value) is int and _INT64_MIN <= value <= UINT64_MAX:
            return value
    elif hint is str or hint is bool:
        if type(value) is hint:
            return value
    elif hint == _INT_TUPLE and type(value) in (tuple, list) and all(type(x) is int for x in value):
        if not value or (_INT64_MIN <= min(value) and max(value) <= UINT64_MAX):
            return value if type(value) is tuple else tuple(value)
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(where, inner, value)
    if origin is tuple:
        inner, _ = typing.get_args(hint)  # tuple[X, ...]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a sequence, got {type(value).__name__}")
        items = tuple(_check(f"{where}[{i}]", inner, v) for i, v in enumerate(value))
        return value if isinstance(value, tuple) and all(a is b for a, b in zip(items, value)) else items
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, hint):
            return value
        try:
            return hint(value)
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not one of {[m.value for m in hint]}") from None
    if hint is KVEvent:
        return _check_event(where, value)
    if isinstance(hint, type) and issubclass(hint, Record):
        if type(value) is not hint:
            raise ValueError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value  # checked when it was built
    if hint is float and type(value) is int:
        return float(value)
    # `type(...) is`, not isinstance: a bool must not pass as an int, nor an IntEnum.
    if hint is int and type(value) is int:
        raise ValueError(f"{where}: {value} does not fit in 64 bits")
    if hint in (bool, str, float) and type(value) is hint:
        return value
    raise ValueError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")


def _check_event(where: str, value: Any) -> KVEvent:
    if not isinstance(value, KVEvent):
        raise ValueError(f"{where}: expected KVEvent, got {type(value).__name__}")
    kind = _check(f"{where}.kind", KVEventKind, value.kind)
    for name in ("block_hash", "parent_hash"):
        h = getattr(value, name)
        if not (h is None and name == "parent_hash") and not (type(h) is int and 0 <= h <= UINT64_MAX):
            raise ValueError(f"{where}.{name}: expected a 64-bit unsigned hash, got {h!r}")
    return value if kind is value.kind else KVEvent(kind, value.block_hash, value.parent_hash)


_PLAIN = frozenset((str, int, float, bool, type(None), bytes))  # written by msgpack as they are


def to_wire(value: Any) -> Any:
    if type(value) in _PLAIN:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):  # msgpack writes tuples as arrays; convert only what msgpack cannot write
        return [to_wire(v) for v in value] if value and isinstance(value[0], (enum.Enum, KVEvent, Record)) else value
    if isinstance(value, KVEvent):
        return [value.kind.value, value.block_hash, value.parent_hash]
    if isinstance(value, Record):
        return [to_wire(getattr(value, name)) for name, _, _ in _field_specs(type(value))]
    return value


def from_wire(where: str, hint: Any, value: Any) -> Any:
    """Wire shapes back to field shapes, where they differ (events, records); types are checked after."""
    read = _reader(hint)
    return value if read is None else read(where, value)


_Read = typing.Callable[[str, Any], Any]
_readers: dict[Any, _Read | None] = {}


def _reader(hint: Any) -> _Read | None:
    """The function that turns `hint`'s wire shape into its field shape, made once per hint
    (None: the wire shape is the field shape). Per message only the fields that need it are
    touched (a token delta's records), without walking every hint again."""
    if hint not in _readers:
        _readers[hint] = _make_reader(hint)
    return _readers[hint]


def _make_reader(hint: Any) -> _Read | None:
    if hint == _EVENT_TUPLE:
        def events(where: str, value: Any) -> Any:
            if not isinstance(value, list):
                return value
            return [_read_event(f"{where}[{i}]", v) for i, v in enumerate(value)]
        return events
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        read = _reader(inner)
        return None if read is None else (lambda where, value: None if value is None else read(where, value))
    if origin is tuple:
        inner = typing.get_args(hint)[0]
        if not (isinstance(inner, type) and issubclass(inner, Record) or typing.get_origin(inner) is not None):
            return lambda where, value: tuple(value) if type(value) is list else value  # checked as a tuple
        item = _reader(inner)

        def items(where: str, value: Any) -> Any:
            if not isinstance(value, list) or item is None:
                return value
            return tuple(item(f"{where}[{i}]", v) for i, v in enumerate(value))
        return items
    if isinstance(hint, type) and issubclass(hint, Record):
        specs = _field_specs(hint)
        reads = [(i, read, name) for i, (name, h, _) in enumerate(specs) if (read := _reader(h)) is not None]

        def record(where: str, value: Any) -> Any:
            if value is None:
                return None  # the field check says what is wrong
            if not (isinstance(value, list) and len(value) == len(specs)):
                raise ValueError(f"{where}: expected the {len(specs)} fields of {hint.__name__} as an array")
            for i, read, name in reads:  # only the fields whose wire shape differs
                value[i] = read(f"{where}.{name}", value[i])
            return hint(*value)
        return record
    if hint is KVEvent:
        return lambda where, value: None if value is None else _read_event(where, value)
    return None


def _read_event(where: str, value: Any) -> KVEvent:
    if not (isinstance(value, list) and len(value) == 3):
        raise ValueError(f"{where}: expected [kind, block_hash, parent_hash]")
    return KVEvent(_check(f"{where}.kind", KVEventKind, value[0]), value[1], value[2])
