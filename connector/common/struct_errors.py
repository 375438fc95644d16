"""msgspec's validation errors in the words of a config file.

msgspec says ``Expected `int`, got `str` - at `$.extra.nixl_progress_us```; a person wants
the key path, the value they wrote, the type or choices wanted and, for a key that does
not exist, the keys that do. :func:`explain` reads both from the decoded type itself
(``msgspec.inspect``), so no table of fields is kept by hand.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec
import msgspec.inspect as mi

_AT = re.compile(r"^(?P<what>.*?)(?: - at (?P<in_key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<key>[^`]*)`$")
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]*)`, got `(?P<got>[^`]*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")

_MISSING_VALUE = object()

Path = tuple[str | int, ...]


def explain(
    exc: msgspec.ValidationError,
    root: type,
    raw: object,
    *,
    name: str,
    retired: Mapping[str, str] | None = None,
) -> str:
    """What is wrong, for a ``msgspec.convert(raw, root)`` that raised ``exc``.

    ``name`` names the whole document (``kv-transfer-config``); ``retired`` maps a dotted
    key that no longer exists to what to tell whoever still sets it.
    """
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches any text
    what, path = match["what"], _parse(match["path"] or "")
    info = mi.type_info(root)
    if match["in_key"]:  # a mapping key, not a value, is wrong (JSON keys are strings)
        return f"{_dotted(path) or name}: every key must be a string ({what})"
    if unknown := _UNKNOWN.match(what):
        key = _dotted((*path, unknown["key"]))
        if retired and key in retired:
            return f"{key} {retired[key]}"
        known = sorted(_struct_fields(_type_at(info, path)))
        where = f"{_dotted(path)} keys" if path else "keys"
        return f"unknown {name} key {key!r}; known {where}: {known}"
    if missing := _MISSING.match(what):
        full = (*path, missing["key"])
        choices = _choices(_type_at(info, full))
        return f"{_dotted(full)} is required" + (f" (one of {choices})" if choices else "")
    value = _value_at(raw, path)
    if not path:
        shown = name
    elif value is _MISSING_VALUE:
        shown = _dotted(path)
    else:
        shown = f"{_dotted(path)}={value!r}"
    choices = _choices(_type_at(info, path))
    if choices is not None:
        return f"{shown} is not one of {choices}"
    if expected := _EXPECTED.match(what):
        return f"{shown} must be of type {expected['want']} (got {expected['got']})"
    return f"invalid {name}: {shown}: {what}"


def _parse(path: str) -> Path:
    """``.extra.warm_peers[0]`` -> ``("extra", "warm_peers", 0)``."""
    return tuple(key if key else int(index) for key, index in _STEP.findall(path))


def _dotted(path: Path) -> str:
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out


def _type_at(info: mi.Type | None, path: Path) -> mi.Type | None:
    """The type found at ``path`` inside ``info`` (None where the path leaves it)."""
    for step in path:
        if isinstance(info, mi.UnionType):  # ``X | None``: the non-None member
            members = [t for t in info.types if not isinstance(t, mi.NoneType)]
            info = members[0] if len(members) == 1 else None
        if isinstance(info, mi.StructType) and isinstance(step, str):
            info = next((f.type for f in info.fields if f.encode_name == step), None)
        elif isinstance(step, int) and hasattr(info, "item_type"):
            info = info.item_type  # type: ignore[union-attr]
        else:
            return None
    return info


def _struct_fields(info: mi.Type | None) -> list[str]:
    return [f.encode_name for f in info.fields] if isinstance(info, mi.StructType) else []


def _choices(info: mi.Type | None) -> list[object] | None:
    if isinstance(info, mi.EnumType):
        return [member.value for member in info.cls]
    if isinstance(info, mi.LiteralType):
        return list(info.values)
    return None


def _value_at(raw: object, path: Path) -> object:
    for step in path:
        if isinstance(step, str) and isinstance(raw, Mapping) and step in raw:
            raw = raw[step]
        elif isinstance(step, int) and isinstance(raw, list | tuple) and step < len(raw):
            raw = raw[step]
        else:
            return _MISSING_VALUE
    return raw
