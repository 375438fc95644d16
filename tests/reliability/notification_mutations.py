"""Mutations of kvbridge's notifications, derived from their msgspec types.

A :class:`Mutation` changes one field of one message type (or the message's bytes as a
whole) to a value a healthy peer never sends: integers at the int64 / uint64 edges and
one past the decoder's bounds, NaN and infinite floats, empty, 60 KB, non-ASCII and
foreign strings (another request's id), lists of extreme ints, emptied lists, lists made
as large as a notification allows, a field left out or of the wrong type, an unknown
tag, truncated and random bytes. The sites come from ``msgspec.inspect`` over
``Notification``, so a field added to a message is fuzzed without a change here
(``test_every_field_of_every_message_is_a_site``).

A mutation is applied to a base message's builtins form (``msgspec.to_builtins``: a
dict with the tag field ``"type"`` holding the class name; array-like structs as lists)
and re-encoded with ``msgspec.msgpack.encode``, so that values the Struct types refuse
can be sent at all::

    base Prepare ──to_builtins──> {"type": "Prepare", "request_id": ..., "rewrites":
                                   [[group_id, [layout, ...], [layout, ...]]], ...}
    site "rewrites[0].src.num_chunks", value 2**64 - 1 ──> set, encode ──> bytes

A list the base holds empty (``Push.staged`` in a plain push) gets one element of the
item type's defaults first, so nested fields are reached whatever the base.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

from kvbridge.connector.common.notifications import (
    MAX_NOTIFICATION_BYTES,
    Notification,
    NotificationError,
    decode_notification,
)

INT_EDGES = (2**63 - 1, 2**63, 2**64 - 1, -(2**63), -1, 0)
FLOAT_EDGES = (math.inf, -math.inf, math.nan, -1.0, 1e300)
HUGE_BYTES = 60_000  # a huge field: the largest that leaves the message one notification
NON_ASCII = "zä-キー-🔑-\u202e-\u0000"
# a string that the encoding turns into invalid UTF-8 (msgspec cannot encode such a str)
BAD_UTF8 = "\x01bad-utf8\x01"
TAG = "type"  # msgspec's tag field for tag=True Structs; the tag value is the class name
MISSING = object()  # a value that deletes the field

# every message type, by tag
MESSAGE_TYPES: dict[str, mi.StructType] = {
    t.tag: t
    for t in mi.type_info(Notification).types  # type: ignore[attr-defined]
}
RAW = "<message>"  # the site of mutations of the message as a whole


@dataclass(frozen=True)
class Context:
    """What a mutation may name: the request the message is about and another one."""

    request_id: str
    foreign_id: str


Value = Callable[[Context, Any], Any]  # (context, current value) -> new value


@dataclass(frozen=True)
class Mutation:
    """``value`` put at ``path`` of a ``type_name`` message (``path`` () with ``raw``:
    the encoded message's bytes are changed instead)."""

    type_name: str
    site: str  # "rewrites[0].src.num_chunks", or RAW
    label: str  # the value, as a reader of the figures wants it
    path: tuple[str | int, ...]
    types: tuple[Any, ...]  # msgspec.inspect type of each step's value (to fill gaps)
    value: Value | None = None
    raw: Callable[[bytes, random.Random], bytes] | None = None

    @property
    def key(self) -> str:
        return f"{self.type_name}.{self.site}={self.label}"

    def names(self, ctx: Context) -> set[str]:
        """Request ids this mutation may name besides the message's own."""
        return {ctx.foreign_id} if "foreign" in self.label else set()


@dataclass(frozen=True)
class Mutant:
    """One mutated message, encoded; ``decodable``: it passes ``decode_notification``
    (its values lie inside the decoder's bounds: what the code after the decoder sees);
    ``decoder_raised``: the decoder raised something other than ``NotificationError``
    (the exception's type name), which no caller of it expects."""

    mutation: Mutation
    data: bytes
    decodable: bool
    decoder_raised: str = ""


# -- the sites ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    name: str
    path: tuple[str | int, ...]
    types: tuple[Any, ...]
    required: bool


def sites(struct: mi.StructType) -> list[Site]:
    """Every field of a message, nested ones (``rewrites[0].src.layout``) included."""
    return list(_walk(struct, "", (), ()))


def _walk(struct: mi.StructType, prefix: str, path: tuple, types: tuple) -> Iterator[Site]:
    for i, f in enumerate(struct.fields):
        step = i if struct.array_like else f.encode_name
        name = f"{prefix}.{f.name}" if prefix else f.name
        here, here_types = (*path, step), (*types, f.type)
        yield Site(name, here, here_types, f.required)
        yield from _inside(f.type, name, here, here_types)


def _inside(tp: Any, name: str, path: tuple, types: tuple) -> Iterator[Site]:
    if isinstance(tp, mi.StructType):
        yield from _walk(tp, name, path, types)
    elif isinstance(tp, mi.ListType) and isinstance(tp.item_type, mi.StructType | mi.ListType):
        item = f"{name}[0]"
        yield Site(item, (*path, 0), (*types, tp.item_type), True)
        yield from _inside(tp.item_type, item, (*path, 0), (*types, tp.item_type))


def default_of(tp: Any) -> Any:
    """The plainest value of an inspect type that its bounds allow."""
    if isinstance(tp, mi.IntType):
        return tp.ge if tp.ge is not None else (tp.gt + 1 if tp.gt is not None else 0)
    if isinstance(tp, mi.FloatType):
        return 0.0
    if isinstance(tp, mi.StrType):
        return "x" * (tp.min_length or 0)
    if isinstance(tp, mi.LiteralType):
        return sorted(tp.values)[0]
    if isinstance(tp, mi.BoolType):
        return False
    if isinstance(tp, mi.ListType):
        return []
    if isinstance(tp, mi.StructType):
        values = [default_of(f.type) for f in tp.fields]
        if tp.array_like:
            return values
        out = {f.encode_name: v for f, v in zip(tp.fields, values, strict=True)}
        return {TAG: tp.tag, **out} if tp.tag is not None else out
    raise TypeError(f"no default for {tp!r}")


# -- the values ---------------------------------------------------------------------------


def _fits(item_bytes: int) -> int:
    """How many items of ``item_bytes`` encoded fill a huge field."""
    return max(1, HUGE_BYTES // max(item_bytes, 1))


def _upper(tp: Any) -> int | float | None:
    if getattr(tp, "le", None) is not None:
        return tp.le
    if getattr(tp, "lt", None) is not None:
        return tp.lt - 1 if isinstance(tp, mi.IntType) else tp.lt
    return None


def _lower(tp: Any) -> int | float | None:
    if getattr(tp, "ge", None) is not None:
        return tp.ge
    if getattr(tp, "gt", None) is not None:
        return tp.gt + 1 if isinstance(tp, mi.IntType) else tp.gt
    return None


def _const(v: Any) -> Value:
    return lambda ctx, cur: v


def values_for(tp: Any) -> list[tuple[str, Value]]:
    """The hostile values of one field of inspect type ``tp``."""
    out: list[tuple[str, Value]] = [("missing", _const(MISSING)), ("nil", _const(None))]
    if isinstance(tp, mi.IntType):
        out += [(f"int {v}", _const(v)) for v in INT_EDGES]
        hi, lo = _upper(tp), _lower(tp)
        if hi is not None:
            out += [(f"bound {hi}", _const(hi)), (f"bound+1 {hi + 1}", _const(hi + 1))]
        if lo is not None and lo > -(2**63):
            out.append((f"bound-1 {lo - 1}", _const(lo - 1)))
        out += [("str '7'", _const("7")), ("float 1.5", _const(1.5)), ("bool", _const(True))]
    elif isinstance(tp, mi.FloatType):
        out += [(f"float {v}", _const(v)) for v in FLOAT_EDGES]
        hi = _upper(tp)
        if hi is not None:
            out += [(f"bound {hi}", _const(float(hi))), (f"bound*2 {2 * hi}", _const(2.0 * hi))]
        out += [("int 2**64-1", _const(2**64 - 1)), ("str '1'", _const("1"))]
    elif isinstance(tp, mi.BoolType):
        out += [("int 0", _const(0)), ("int 2", _const(2)), ("str 'true'", _const("true"))]
    elif isinstance(tp, mi.StrType):
        out += [
            ("empty", _const("")),
            (f"huge {HUGE_BYTES} chars", _const("h" * HUGE_BYTES)),
            ("non-ascii", _const(NON_ASCII)),
            ("invalid utf-8", _const(BAD_UTF8)),
            ("foreign id", lambda ctx, cur: ctx.foreign_id),
            ("int 7", _const(7)),
        ]
        if tp.max_length is not None and tp.max_length < HUGE_BYTES:
            out.append((f"bound+1 {tp.max_length + 1} chars", _const("b" * (tp.max_length + 1))))
    elif isinstance(tp, mi.LiteralType):  # a name from a closed set: another one, or none
        others = sorted(v for v in tp.values if isinstance(v, str))
        out += [
            (
                "another name",
                lambda ctx, cur: (
                    others[(others.index(cur) + 1) % len(others)] if cur in others else others[0]
                ),
            ),
            ("unknown name", _const("XYZ")),
            ("empty", _const("")),
            ("invalid utf-8", _const(BAD_UTF8)),
            ("int 7", _const(7)),
        ]
    elif isinstance(tp, mi.ListType):
        out += _list_values(tp)
    elif isinstance(tp, mi.StructType):
        out += [("empty list", _const([])), ("empty map", _const({})), ("str", _const("x"))]
    return out


def _list_values(tp: mi.ListType) -> list[tuple[str, Value]]:
    item = tp.item_type
    out: list[tuple[str, Value]] = [
        ("emptied", _const([])),
        ("str", _const("x")),
        ("list of nil", _const([None])),
    ]
    if isinstance(item, mi.IntType):
        out += [
            ("extreme ints", _const(list(INT_EDGES))),
            ("[2**64-1]", _const([2**64 - 1])),
            ("[-1]", _const([-1])),
            (f"huge {_fits(9)} x 2**63-1", _const([2**63 - 1] * _fits(9))),
            (f"huge {_fits(1)} x 0", _const([0] * _fits(1))),
            ("repeated", lambda ctx, cur: (cur or [0])[:1] * 4),
        ]
        hi = _upper(item)
        if hi is not None:
            out.append((f"[bound+1 {hi + 1}]", _const([hi + 1])))
    elif isinstance(item, mi.StrType):
        out += [
            ("[huge]", _const(["h" * HUGE_BYTES])),
            ("[foreign id]", lambda ctx, cur: [ctx.foreign_id]),
            ("[non-ascii]", _const([NON_ASCII])),
            ("[invalid utf-8]", _const([BAD_UTF8])),
            (f"huge {_fits(42)} ids", _const([f"id-{i:038d}" for i in range(_fits(42))])),
            ("[int]", _const([1])),
        ]
    else:  # lists of lists and of structs: the base's first item (or a default) repeated
        over = (tp.max_length or 299) + 1
        out += [
            ("huge", lambda ctx, cur: _repeat(cur, item)),
            (f"{over} items", lambda ctx, cur: _repeat(cur, item, over)),
        ]
    return out


def _repeat(cur: Any, item: Any, count: int | None = None) -> list:
    """The first item (or the item type's default) ``count`` times, or as many as make
    the field huge."""
    first = cur[0] if isinstance(cur, list) and cur else default_of(item)
    return [first] * (count or _fits(len(msgspec.msgpack.encode(first))))


# -- mutations of a whole message ---------------------------------------------------------


def _truncate(fraction: float) -> Callable[[bytes, random.Random], bytes]:
    return lambda data, rng: data[: int(len(data) * fraction)]


def _random_bytes(n: int) -> Callable[[bytes, random.Random], bytes]:
    return lambda data, rng: rng.randbytes(n)


def _flip(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data))
    return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1 :]


RAW_MUTATIONS: list[tuple[str, Callable[[bytes, random.Random], bytes]]] = [
    ("truncated to 1 byte", lambda data, rng: data[:1]),
    ("truncated to half", _truncate(0.5)),
    ("truncated by 1 byte", lambda data, rng: data[:-1]),
    ("empty bytes", lambda data, rng: b""),
    ("random 16 bytes", _random_bytes(16)),
    ("random 2000 bytes", _random_bytes(2000)),
    (f"random {HUGE_BYTES} bytes", _random_bytes(HUGE_BYTES)),
    ("one bit flipped", _flip),
    ("invalid utf-8 in a key", lambda data, rng: data.replace(b"type", b"\xffype", 1)),
    ("msgpack int", lambda data, rng: msgspec.msgpack.encode(7)),
    ("msgpack array", lambda data, rng: msgspec.msgpack.encode([1, "x"])),
]


def _message_values() -> list[tuple[str, tuple, Value]]:
    """(label, path, value) of changes to the message map itself."""
    others = sorted(MESSAGE_TYPES)
    return [
        ("tag unknown", (TAG,), _const("Nope")),
        ("tag missing", (TAG,), _const(MISSING)),
        ("tag int", (TAG,), _const(3)),
        ("tag of another type", (TAG,), lambda ctx, cur: others[(others.index(cur) + 1) % 6]),
        ("unknown field", ("zz_unknown",), _const({"a": [1, 2**64 - 1]})),
        ("deeply nested unknown field", ("zz_unknown",), _const(_nested(500))),
    ]


def _nested(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


# -- the catalogue ------------------------------------------------------------------------


def catalogue(type_name: str) -> list[Mutation]:
    """Every mutation of one message type: each value of each field, then the message's."""
    struct = MESSAGE_TYPES[type_name]
    out = [
        Mutation(type_name, s.name, label, s.path, s.types, value=value)
        for s in sites(struct)
        for label, value in values_for(s.types[-1])
    ]
    out += [
        Mutation(type_name, RAW, label, path, (None,), value=value)
        for label, path, value in _message_values()
    ]
    out += [Mutation(type_name, RAW, label, (), (), raw=fn) for label, fn in RAW_MUTATIONS]
    return out


def full_catalogue() -> list[Mutation]:
    return [m for t in sorted(MESSAGE_TYPES) for m in catalogue(t)]


def stratified(rng: random.Random, type_names: list[str] | None = None) -> list[Mutation]:
    """One mutation per (type, site), its value drawn with ``rng``: every field of every
    message type once (whole-message mutations count as one site per label)."""
    out = []
    for t in type_names or sorted(MESSAGE_TYPES):
        by_site: dict[str, list[Mutation]] = {}
        for m in catalogue(t):
            key = f"{m.site}:{m.label}" if m.site == RAW else m.site
            by_site.setdefault(key, []).append(m)
        out += [rng.choice(ms) for ms in by_site.values()]
    return out


# -- applying one -------------------------------------------------------------------------


def apply(mutation: Mutation, base: dict, ctx: Context, rng: random.Random) -> Mutant:
    """``base`` (a message's builtins form, tag included) with ``mutation``, encoded."""
    data = msgspec.msgpack.encode(base)
    if mutation.raw is not None:
        data = mutation.raw(data, rng)
    else:
        assert mutation.value is not None
        msg = copy.deepcopy(base)
        _set(msg, mutation.path, mutation.types, mutation.value, ctx)
        data = msgspec.msgpack.encode(msg)
        marker = BAD_UTF8.encode()
        data = data.replace(marker, b"\xff" + marker[1:])
    if len(data) > MAX_NOTIFICATION_BYTES:  # keep it one notification: cut the huge part
        data = data[:MAX_NOTIFICATION_BYTES]
    try:
        decode_notification(data)
    except NotificationError:
        return Mutant(mutation, data, decodable=False)
    except Exception as exc:  # the decoder's own defect: the fuzz reports it
        return Mutant(mutation, data, decodable=False, decoder_raised=type(exc).__name__)
    return Mutant(mutation, data, decodable=True)


def _set(msg: Any, path: tuple, types: tuple, value: Value, ctx: Context) -> None:
    node = msg
    for step, tp in zip(path[:-1], types[:-1], strict=True):
        node = _child(node, step, tp)
    last = path[-1]
    cur = node[last] if _has(node, last) else None
    new = value(ctx, cur)
    if new is MISSING:
        if isinstance(node, dict):
            node.pop(last, None)
        else:
            del node[last:]  # array-like: a short array leaves this field and the rest out
        return
    if isinstance(node, list) and len(node) <= last:
        node.extend(default_of(types[-1]) for _ in range(last + 1 - len(node)))
    node[last] = new


def _has(node: Any, step: str | int) -> bool:
    return step in node if isinstance(node, dict) else len(node) > step


def _child(node: Any, step: str | int, tp: Any) -> Any:
    if isinstance(node, dict):
        if not isinstance(node.get(step), list | dict):
            node[step] = default_of(tp)
        return node[step]
    if len(node) <= step:  # an empty list: one element of the item type's defaults
        node.extend(default_of(tp) for _ in range(step + 1 - len(node)))
    if not isinstance(node[step], list | dict):
        node[step] = default_of(tp)
    return node[step]


def base_of(msg: Notification) -> dict:
    return msgspec.to_builtins(msg)


def synthesized(type_name: str, request_id: str) -> dict:
    """A message of ``type_name`` of the type's defaults, about ``request_id``."""
    out = default_of(MESSAGE_TYPES[type_name])
    if "request_id" in out:
        out["request_id"] = request_id
    if "request_ids" in out:
        out["request_ids"] = [request_id]
    return out
