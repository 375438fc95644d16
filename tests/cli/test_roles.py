"""``kvbridge plan`` and ``kvbridge probe`` pair only a prefill with a decode, by the role
each description carries: two decodes, a worker with itself and decode -> prefill are
refused (exit 1) naming both roles and what to pass instead; prefill -> decode pairs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvbridge.cli.main import main
from kvbridge.cli.roles import RoleError, check_roles, role_of
from kvbridge.connector.common.config import KVRole
from kvbridge.handshake.listener import HandshakeListener, ListenerConfig
from kvbridge.handshake.messages import WorkerDescription


def _describe(tmp: Path, role: str, engine_id: str, block_size: int, kv_role: str) -> Path:
    path = tmp / f"{engine_id}.json"
    kv = json.dumps({"kv_role": kv_role, "engine_id": engine_id})
    argv = ["describe", role, "--block-size", str(block_size), "--kv-transfer-config", kv]
    assert main([*argv, "--out", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def described(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("roles")
    return {
        "prefill": _describe(tmp, "prefill", "p", 32, "kv_producer"),
        "decode": _describe(tmp, "decode", "d", 16, "kv_consumer"),
        "decode2": _describe(tmp, "decode", "d2", 16, "kv_consumer"),
        "both": _describe(tmp, "both", "b", 16, "kv_both"),
    }


def _load(path: Path) -> WorkerDescription:
    return msgspec.json.decode(path.read_bytes(), type=WorkerDescription)


def plan(capsys, *args: object) -> tuple[int, str]:
    rc = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_descriptions_carry_the_role(described):
    assert role_of(_load(described["prefill"])) is KVRole.PRODUCER
    assert role_of(_load(described["decode"])) is KVRole.CONSUMER
    assert role_of(_load(described["both"])) is KVRole.BOTH


def test_prefill_to_decode_pairs(described, capsys):
    rc, text = plan(capsys, described["prefill"], described["decode"])
    assert rc == 0 and text.startswith("PAIRS: p -> d"), text
    # a kv_both worker is either side
    rc, text = plan(capsys, described["both"], described["decode"])
    assert rc == 0 and "PAIRS: b -> d" in text, text
    rc, text = plan(capsys, described["prefill"], described["both"])
    assert rc == 0 and "PAIRS: p -> b" in text, text


def test_two_decodes_are_refused(described, capsys):
    d, d2 = described["decode"], described["decode2"]
    rc, text = plan(capsys, d, d2)
    assert rc == 1, text
    assert f"prefill side {d}: engine d rank 0, decode (kv_consumer)" in text, text
    assert f"decode side {d2}: engine d2 rank 0, decode (kv_consumer)" in text, text
    assert "the prefill side never sends" in text and "other way round" not in text, text
    assert "fix: pass as PREFILL a prefill worker's description" in text, text


def test_a_prefill_with_itself_is_refused(described, capsys):
    p = described["prefill"]
    rc, text = plan(capsys, p, p)
    assert rc == 1, text
    assert "both sides are the same worker" in text, text
    assert f"decode side {p}: engine p rank 0, prefill (kv_producer)" in text, text
    assert "fix: pass as DECODE a decode worker's description" in text, text
    # one kv_both worker on both sides: roles fit, the worker does not
    rc, text = plan(capsys, described["both"], described["both"])
    assert rc == 1 and "both sides are the same worker" in text, text
    assert "never sends" not in text and "never loads (" not in text, text
    assert "fix: pass as DECODE" in text, text


def test_decode_to_prefill_is_refused_with_the_order_to_use(described, capsys):
    p, d = described["prefill"], described["decode"]
    rc, text = plan(capsys, d, p)
    assert rc == 1, text
    assert f"prefill side {d}: engine d rank 0, decode (kv_consumer)" in text, text
    assert f"decode side {p}: engine p rank 0, prefill (kv_producer)" in text, text
    assert f"fix: pass them the other way round: kvbridge plan {p} {d}" in text, text


def test_a_description_without_a_role_still_pairs_and_a_bad_one_is_named(described):
    old = msgspec.structs.replace(_load(described["decode"]), kv_role="")
    assert check_roles(_load(described["prefill"]), old) is None
    bad = msgspec.structs.replace(old, kv_role="kv_reader")
    with pytest.raises(RoleError, match="engine 'd' describes kv_role 'kv_reader'"):
        check_roles(_load(described["prefill"]), bad)


@pytest.fixture
def serving(described) -> Iterator[dict[str, str]]:
    """The prefill's and the decode's descriptions served on side channels."""
    listeners = {}
    try:
        for role in ("prefill", "decode"):
            desc = _load(described[role])
            listeners[role] = HandshakeListener(ListenerConfig(port=0), lambda d=desc: d)
            listeners[role].start()
        yield {role: f"127.0.0.1:{lis.port}" for role, lis in listeners.items()}
    finally:
        for lis in listeners.values():
            lis.close()


def probe(capsys, *args: object) -> tuple[int, str]:
    rc = main(["probe", *map(str, args), "--secret-env", "", "--timeout", "5"])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_probe_pairs_and_refuses_by_role(described, serving, capsys):
    p, d = described["prefill"], described["decode"]
    rc, text = probe(capsys, serving["prefill"], "--as", d)
    assert rc == 0 and "PAIRS: p -> d" in text, text
    rc, text = probe(capsys, serving["decode"], "--as", p, "--as-role", "prefill")
    assert rc == 0 and "PAIRS: p -> d" in text, text
    # the probed decode taken for the prefill side: --as-role says the other way
    rc, text = probe(capsys, serving["decode"], "--as", p)
    assert rc == 1, text
    assert f"prefill side {serving['decode']}: engine d rank 0, decode" in text, text
    assert f"fix: --as {p} describes the prefill side: pass --as-role prefill" in text, text
    # two decodes
    rc, text = probe(capsys, serving["decode"], "--as", described["decode2"])
    assert rc == 1 and "fix: probe a prefill worker's side channel" in text, text
    # the probed prefill with its own description
    rc, text = probe(capsys, serving["prefill"], "--as", p)
    assert rc == 1 and "both sides are the same worker" in text, text
    assert "fix: pass --as a decode worker's description" in text, text
