"""Generate ``docs/configuration.md`` from the configuration code, the one source.

Every key of :class:`KVTransferConfig` and its ``extra`` (:class:`ExtraConfig`) is listed
with its type and default (``msgspec.inspect``), its meaning and the side that reads it (the
field's docstring, whose last line is ``Read by: ...``), and its spelling and default inside
vLLM (``connector/vllm/translate.py``: the top-level keys and ``VLLM_EXTRA_DEFAULTS``, read
from the source so that vLLM need not be installed)::

    python scripts/gen_config_docs.py            # rewrite docs/configuration.md
    python scripts/gen_config_docs.py --check    # exit 1 if the page is stale

A field without a docstring, or without its ``Read by:`` line, is an error
(``tests/docs/test_configuration_page.py`` runs both).
"""

from __future__ import annotations

import argparse
import ast
import enum
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

ROOT = Path(__file__).resolve().parent.parent
CONFIG_SOURCE = ROOT / "connector" / "common" / "config.py"
TRANSLATE_SOURCE = ROOT / "connector" / "vllm" / "translate.py"
PAGE = ROOT / "docs" / "configuration.md"
READ_BY = "Read by:"


class UndocumentedKeyError(Exception):
    """A configuration key has no docstring, or its docstring no ``Read by:`` line."""


@dataclass(frozen=True)
class Key:
    path: str  # "lease_s", "extra.transfer_mode"
    type: str
    default: str
    required: bool
    meaning: str
    read_by: str
    vllm_spelling: str
    vllm_default: str | None  # where it differs from the default


def field_docs(source: Path, class_name: str) -> dict[str, str]:
    """Each field's docstring (the string literal right after the annotated field)."""
    tree = ast.parse(source.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            docs: dict[str, str] = {}
            body = node.body
            for stmt, after in zip(body, [*body[1:], None], strict=True):
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                if (
                    isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                ):
                    docs[stmt.target.id] = after.value.value
            return docs
    raise UndocumentedKeyError(f"class {class_name} not found in {source}")


def module_literal(source: Path, name: str) -> Any:
    """A module-level constant of ``source`` (a literal), without importing the module."""
    for node in ast.parse(source.read_text()).body:
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and target.id == name:
            return ast.literal_eval(value)
    raise UndocumentedKeyError(f"{name} not found in {source}")


def type_name(t: mi.Type) -> str:
    if isinstance(t, mi.StrType):
        return "string"
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.IntType):
        return "int"
    if isinstance(t, mi.FloatType):
        return "number"
    if isinstance(t, mi.NoneType):
        return "null"
    if isinstance(t, mi.EnumType):
        return " \\| ".join(f'`"{m.value}"`' for m in t.cls)
    if isinstance(t, mi.UnionType):
        return " or ".join(type_name(x) for x in t.types)
    if isinstance(t, mi.VarTupleType | mi.ListType):
        return f"list of {type_name(t.item_type)}"
    if isinstance(t, mi.StructType):
        return "object"
    raise UndocumentedKeyError(f"no name for type {t!r}; teach gen_config_docs.type_name")


def render_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, msgspec.Struct):
        return "(see below)"
    return f"`{msgspec.json.encode(value).decode()}`"


def split_doc(path: str, doc: str | None) -> tuple[str, str]:
    if not doc:
        raise UndocumentedKeyError(f"{path}: no docstring under the field in {CONFIG_SOURCE}")
    lines = [line.strip() for line in doc.strip().splitlines()]
    if not lines[-1].startswith(READ_BY):
        raise UndocumentedKeyError(f"{path}: its docstring's last line must be '{READ_BY} ...'")
    meaning = " ".join(line for line in lines[:-1] if line)
    if not meaning:
        raise UndocumentedKeyError(f"{path}: its docstring says only who reads it")
    return meaning.replace("``", "`"), lines[-1][len(READ_BY) :].strip().rstrip(".")


def collect() -> list[Key]:
    from kvbridge.connector.common.config import ExtraConfig, KVTransferConfig

    top_level = set(module_literal(TRANSLATE_SOURCE, "_TOP_LEVEL"))
    vllm_extra_defaults = module_literal(TRANSLATE_SOURCE, "VLLM_EXTRA_DEFAULTS")
    keys: list[Key] = []
    for cls, prefix in ((KVTransferConfig, ""), (ExtraConfig, "extra.")):
        docs = field_docs(CONFIG_SOURCE, cls.__name__)
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        for field in info.fields:
            path = prefix + field.name
            meaning, read_by = split_doc(path, docs.get(field.name))
            if field.default is not mi.NODEFAULT:
                default = render_value(field.default)
            elif field.default_factory is not mi.NODEFAULT:
                default = render_value(field.default_factory())
            else:
                default = "required"
            vllm_default = None
            if prefix:
                spelling = f"`kv_connector_extra_config.extra.{field.name}`"
                if field.name in vllm_extra_defaults:
                    vllm_default = render_value(vllm_extra_defaults[field.name])
            elif field.name in top_level:
                spelling = f"`{field.name}` (top level)"
            elif field.name == "failure_policy":
                spelling = "`kv_load_failure_policy` (top level)"
                vllm_default = '`"fail"` (vLLM\'s own default)'
            else:
                spelling = f"`kv_connector_extra_config.{field.name}`"
            if field.name == "kv_buffer_device":
                vllm_default = "vLLM's default, the platform's device type"
            keys.append(
                Key(
                    path=path,
                    type=type_name(field.type),
                    default=default,
                    required=field.required,
                    meaning=meaning,
                    read_by=read_by,
                    vllm_spelling=spelling,
                    vllm_default=vllm_default,
                )
            )
    return keys


HEADER = """\
<!-- Generated by scripts/gen_config_docs.py from connector/common/config.py and
     connector/vllm/translate.py. Do not edit: change the field's docstring and run
     `python scripts/gen_config_docs.py`. tests/docs/ fails when this page is stale. -->

# Configuration

One JSON object configures a worker, in kvbridge's spelling (`--kv-transfer-config` of the
example servers, `KVTransferConfig.from_json` for your own engine):

```json
{"kv_role": "kv_producer", "engine_id": "prefill-0", "kv_port": 5600,
 "failure_policy": "recompute", "lease_s": 30, "extra": {"transfer_mode": "pull"}}
```

One typed decoder reads it (msgspec Structs `KVTransferConfig` and `ExtraConfig` in
`connector/common/config.py`). An unknown key is an error naming its path and the known
keys (`unknown kv-transfer-config key 'extra.transfer_mod'; known extra keys: [...]`), a
value of the wrong type one naming the key and the type wanted, a value out of range one
naming the key and the range: see [Troubleshooting](troubleshooting.md#configerror).

**Inside vLLM** the same keys are spelled differently: `kv_role`, `engine_id`, `kv_port`
and `kv_buffer_device` are fields of vLLM's own `--kv-transfer-config`, the failure policy
is vLLM's `kv_load_failure_policy` (vLLM applies it, kvbridge follows), and every other key
goes in `kv_connector_extra_config`. Setting one of vLLM's own keys inside
`kv_connector_extra_config` is an error naming where it belongs.

"Read by" says which worker acts on the key: prefill (`kv_producer`), decode
(`kv_consumer`) or both; a `kv_both` worker reads them all.
"""


def render(keys: list[Key]) -> str:
    out = [HEADER, "## Keys", ""]
    out += ["| key | type | default | read by |", "|---|---|---|---|"]
    for k in keys:
        anchor = k.path.replace(".", "")  # the heading's slug, on GitHub and in mkdocs
        out.append(f"| [`{k.path}`](#{anchor}) | {k.type} | {k.default} | {k.read_by} |")
    for section, prefix in (("Top level", ""), ("`extra`", "extra.")):
        out += ["", f"## {section}", ""]
        for k in keys:
            if (prefix and not k.path.startswith(prefix)) or (
                not prefix and k.path.startswith("extra.")
            ):
                continue
            out += [f"### `{k.path}`", "", k.meaning, ""]
            out.append(f"- type: {k.type}; default: {k.default}")
            out.append(f"- read by: {k.read_by}")
            vllm = f"- in vLLM: {k.vllm_spelling}"
            if k.vllm_default:
                vllm += f"; default there: {k.vllm_default}"
            out += [vllm, ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    text = render(collect())
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
