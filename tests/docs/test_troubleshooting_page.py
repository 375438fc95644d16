"""docs/troubleshooting.md has an entry (a ``### `ClassName` `` heading) for every error class
kvbridge defines, found by importing every module of its packages, and for every code a
side-channel listener may answer with; and no entry for a class that no longer exists."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import kvbridge.connector
import kvbridge.examples
import kvbridge.handshake
import kvbridge.layouts
from kvbridge.connector.common.config import ConfigError, KVTransferConfig
from kvbridge.handshake.errors import ErrorCode
from kvbridge.layouts.errors import KVBridgeError

PAGE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
PACKAGES = (kvbridge.layouts, kvbridge.handshake, kvbridge.connector, kvbridge.examples)
HEADING = re.compile(r"^### `(\w+)`$", re.MULTILINE)


def modules() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            names.append(info.name)
    return names


def error_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined (not imported) in kvbridge's modules, public or not
    re-exported: a user meets it by its name in a traceback either way."""
    found: dict[str, type[BaseException]] = {}
    for name in modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == name
                and not attr.startswith("_")
            ):
                assert attr not in found or found[attr] is obj, f"two error classes {attr}"
                found[attr] = obj
    return found


@pytest.fixture(scope="module")
def classes() -> dict[str, type[BaseException]]:
    return error_classes()


def test_the_walk_finds_the_errors_of_every_layer(classes: dict[str, type]) -> None:
    # a walk that silently found nothing would pass the checks below
    for name in (
        "KVBridgeError",
        "ConfigError",
        "IncompatiblePeerError",
        "TransferError",
        "ParamsSignatureError",
        "ExternalLayoutError",
        "HTTPFailure",
    ):
        assert name in classes
    assert sum(issubclass(c, KVBridgeError) for c in classes.values()) >= 30


def test_every_error_class_has_an_entry(classes: dict[str, type]) -> None:
    documented = set(HEADING.findall(PAGE.read_text()))
    missing = sorted(set(classes) - documented)
    assert not missing, f"docs/troubleshooting.md has no '### `Name`' entry for {missing}"


def test_every_entry_names_an_existing_error_class(classes: dict[str, type]) -> None:
    stale = sorted(set(HEADING.findall(PAGE.read_text())) - set(classes))
    assert not stale, f"docs/troubleshooting.md has entries for classes that are gone: {stale}"


def test_every_entry_says_what_to_do() -> None:
    page = PAGE.read_text()
    headings = set(HEADING.findall(page))
    for section in re.split(r"^### ", page, flags=re.MULTILINE)[1:]:
        name, _, body = section.partition("\n")
        text = " ".join(body.split())
        if see := re.match(r"See `(\w+)`", text):  # shares an entry with its base class
            assert see[1] in headings, f"{name}: refers to {see[1]}, which has no entry"
            continue
        assert len(text) > 60, f"{name}: the entry is too short to give a cause and a fix"
        assert re.search(r"\*\*Fix:\*\*|\| fix \|", text), f"{name}: no fix"


def test_every_listener_error_code_is_listed() -> None:
    page = PAGE.read_text()
    peer_error = page.split("### `PeerError`", 1)[1].split("\n### ", 1)[0]
    for code in ErrorCode:
        assert f"| `{code.value}` |" in peer_error, code


@pytest.mark.parametrize(
    "raw",
    [
        {"kv_role": "kv_producer", "engine_id": "p", "extra": {"transfer_mod": "push"}},
        {"kv_role": "kv_producer", "engine_id": "p", "extra": {"nixl_progress_us": "1000"}},
        {"kv_role": "kv_producer", "engine_id": "p", "heartbeat_s": 30},
        {"kv_role": "kv_producer", "engine_id": "p", "kv_buffer_device": "gpu"},
        {"engine_id": "p"},
        {"kv_role": "kv_producer", "engine_id": "p", "extra": {"warm_peers": ["h:1"]}},
        {"kv_role": "kv_producer", "engine_id": "p", "extra": {"max_peer_block_size": 64}},
    ],
)
def test_the_config_errors_quoted_on_the_page_are_the_real_ones(raw: dict) -> None:
    # the page quotes messages up to an ellipsis or the closing backtick: the first 40
    # characters of the real message must be there, or the page misleads
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_dict(raw)
    assert str(info.value)[:40] in PAGE.read_text(), str(info.value)
