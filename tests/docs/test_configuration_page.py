"""docs/configuration.md is generated from the configuration code and must stay so: every
key of KVTransferConfig and ExtraConfig documented there (type, default, meaning, who reads
it, vLLM spelling), and the committed page equal to what the generator writes today."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvbridge.connector.common.config import ExtraConfig, KVTransferConfig
from scripts.gen_config_docs import (
    PAGE,
    UndocumentedKeyError,
    collect,
    field_docs,
    main,
    render,
    split_doc,
)


def test_the_committed_page_is_what_the_generator_writes() -> None:
    want = render(collect())
    assert PAGE.read_text() == want, (
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
    )
    assert main(["--check"]) == 0


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(render(collect()).replace("Read by", "read by", 1) + "edited by hand\n")
    assert main(["--check", "--out", str(stale)]) == 1


def test_every_key_of_both_structs_has_its_section_and_row() -> None:
    fields = [f"{n}" for n in KVTransferConfig.__struct_fields__] + [
        f"extra.{n}" for n in ExtraConfig.__struct_fields__
    ]
    keys = {k.path: k for k in collect()}
    assert list(keys) == fields
    page = PAGE.read_text()
    for path, key in keys.items():
        assert f"### `{path}`\n" in page
        assert f"| [`{path}`](#{path.replace('.', '')}) |" in page
        assert key.meaning and key.read_by
        assert key.read_by.split(",")[0].split(" ")[0] in {"prefill", "decode", "both"}


def test_defaults_and_vllm_spellings_come_from_the_code() -> None:
    keys = {k.path: k for k in collect()}
    assert keys["lease_s"].default == f"`{msgspec.json.encode(30.0).decode()}`"
    assert keys["kv_role"].default == "required"
    assert keys["failure_policy"].vllm_spelling.startswith("`kv_load_failure_policy`")
    assert keys["kv_port"].vllm_spelling == "`kv_port` (top level)"
    assert keys["secret"].vllm_spelling == "`kv_connector_extra_config.secret`"
    # VLLM_EXTRA_DEFAULTS in connector/vllm/translate.py
    assert keys["extra.nixl_progress_us"].vllm_default == "`1000`"
    assert keys["extra.idle_progress_ms"].vllm_default == "`5`"
    assert keys["extra.merge_runs"].vllm_default is None


def test_a_field_without_documentation_is_an_error(tmp_path: Path) -> None:
    source = tmp_path / "config.py"
    source.write_text(
        "class C:\n"
        "    a: int = 1\n"
        '    """Documented.\n    Read by: both."""\n'
        "    b: int = 2\n"
        "    c: int = 3\n"
        '    """No reader named."""\n'
    )
    docs = field_docs(source, "C")
    assert set(docs) == {"a", "c"}
    assert split_doc("a", docs["a"]) == ("Documented.", "both")
    with pytest.raises(UndocumentedKeyError, match="b: no docstring"):
        split_doc("b", docs.get("b"))
    with pytest.raises(UndocumentedKeyError, match="c: its docstring's last line"):
        split_doc("c", docs["c"])
