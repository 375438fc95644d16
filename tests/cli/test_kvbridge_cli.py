"""The ``kvbridge`` command against real processes: ``kvbridge serve`` starts a prefill
(block 32) and a decode (block 16) with a shared secret; ``kvbridge probe`` handshakes
with their side channels (and saves their descriptions), ``kvbridge plan`` pairs the
descriptions, and every refusal says which field, both values and the fix, with the exit
status telling which case it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvbridge.cli.main import main
from kvbridge.cli.pairing import load_description, pair, request_cost
from kvbridge.examples.check import complete, scrape
from kvbridge.examples.launch import Proc, worker_args
from tests.ports import dead_port

pytestmark = pytest.mark.integration
SECRET = "cli-test-secret-0123456789abcdef"
KVBRIDGE = [sys.executable, "-m", "kvbridge.cli"]


def kvbridge(*args: str, secret: str | None = SECRET, timeout_s: float = 60) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_SECRET"}
    if secret is not None:
        env["KVBRIDGE_SECRET"] = secret
    out = subprocess.run(
        [*KVBRIDGE, *args], capture_output=True, text=True, env=env, timeout=timeout_s
    )
    return out.returncode, out.stdout + out.stderr


def in_process(capsys, *args: str) -> tuple[int, str]:
    """``kvbridge ARGS`` in this process (commands that talk to no server)."""
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("cli")
    procs = {}
    for role, block in (("prefill", 32), ("decode", 16)):
        kv = {
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "engine_id": f"{role}-{uuid.uuid4().hex[:6]}",
            "kv_port": 0,
            "secret": SECRET,
        }
        args = worker_args(role, kv, block)[2:]  # kvbridge serve takes the role first
        procs[role] = Proc(role, [*KVBRIDGE, "serve", role, "--port", "0", *args], logs / role)
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_healthy()
        yield procs, logs
    finally:
        for p in procs.values():
            p.kill()


def _side_channel(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['kv_port']}"


@pytest.fixture(scope="module")
def saved(workers) -> dict[str, Path]:
    procs, logs = workers
    out = {}
    for role, proc in procs.items():
        path = logs / f"{role}.json"
        rc, text = kvbridge("probe", _side_channel(proc), "--save", str(path), "--timeout", "10")
        assert rc == 0, text
        assert f"engine {proc.ready['engine_id']} rank 0/1" in text, text
        assert f"blocks {32 if role == 'prefill' else 16} tokens" in text, text
        out[role] = path
    return out


def test_probe_pairs_a_decode_config_with_a_running_prefill(workers, saved):
    procs, _ = workers
    rc, text = kvbridge(
        "probe", _side_channel(procs["prefill"]), "--as", str(saved["decode"]), "--timeout", "10",
        "--prompt-tokens", "100",
    )  # fmt: skip
    assert rc == 0, text
    assert "PAIRS" in text and "chunk 16 tok, 2/remote block, 1/local block" in text, text


def test_plan_counts_descriptors_and_bytes_per_request(saved):
    rc, text = kvbridge(
        "plan", str(saved["prefill"]), str(saved["decode"]), "--prompt-tokens", "100"
    )
    assert rc == 0, text
    # 99 tokens loaded over 16-token wire chunks: 7 chunks in each full-attention group
    lines = [line for line in text.splitlines() if line.strip().startswith("group 0:")]
    assert lines and lines[-1].strip().startswith("group 0: 7 chunks (99 tokens)"), text
    assert "total:" in text


def test_plan_refuses_a_mismatch_naming_field_values_and_fix(saved, tmp_path, capsys):
    push = json.loads(saved["decode"].read_text()) | {"transfer_mode": "push"}
    (tmp_path / "push.json").write_text(json.dumps(push))
    rc, text = in_process(capsys, "plan", str(saved["prefill"]), str(tmp_path / "push.json"))
    assert rc == 1, text
    assert "REFUSED" in text and "transfer_mode: decode='push' prefill='pull'" in text, text
    assert "fix: set extra.transfer_mode to the same value" in text, text
    other = json.loads(saved["decode"].read_text()) | {"head_size": 999}
    (tmp_path / "other.json").write_text(json.dumps(other))
    rc, text = in_process(capsys, "plan", str(saved["prefill"]), str(tmp_path / "other.json"))
    assert rc == 1 and "head_size: decode=999 prefill=" in text, text


def test_probe_without_the_secret_or_at_a_dead_port_is_unreachable(workers):
    procs, _ = workers
    address = _side_channel(procs["prefill"])
    rc, text = kvbridge("probe", address, "--timeout", "1", "--retries", "0", secret=None)
    assert rc == 3 and "UNREACHABLE" in text, text
    wrong = "another-secret-0123456789abcdef"
    rc, text = kvbridge("probe", address, "--timeout", "1", "--retries", "0", secret=wrong)
    assert rc == 3 and "UNREACHABLE" in text, text
    with dead_port() as port:
        rc, text = kvbridge("probe", f"127.0.0.1:{port}", "--timeout", "0.5", "--retries", "0")
    assert rc == 3 and "no handshake reply" in text, text


def test_bad_input_exits_2(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    rc, text = in_process(capsys, "plan", str(tmp_path / "x.json"), str(tmp_path / "x.json"))
    assert rc == 2 and "not a kvbridge worker description" in text, text
    rc, text = in_process(capsys, "probe", "nohost")
    assert rc == 2 and "HOST:PORT" in text, text
    # kvbridge bench's bad input: tests/cli/test_bench_cli.py


@pytest.mark.parametrize("prompt_tokens", [23, 100])
def test_the_plan_predicts_what_one_request_moves(workers, saved, prompt_tokens):
    """``kvbridge plan``'s per-request figures equal what decode then reads for a
    request of that many prompt tokens (descriptors and bytes on decode's /metrics)."""
    procs, _ = workers
    pairing = pair(load_description(saved["prefill"]), load_description(saved["decode"]))
    costs = request_cost(pairing, prompt_tokens)
    prompt = [1 + (7 * i + prompt_tokens) % 250 for i in range(prompt_tokens)]
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    first = complete(
        procs["prefill"].url,
        {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout_s=60,
    )
    before = scrape(procs["decode"].url)
    out = complete(
        procs["decode"].url, {**body, "kv_transfer_params": first["kv_transfer_params"]}, 60
    )
    after = scrape(procs["decode"].url)
    assert out["usage"]["loaded_tokens"] == prompt_tokens - 1

    def grew(name: str) -> float:
        return after[f"kvbridge_{name}_total"] - before[f"kvbridge_{name}_total"]

    assert grew("descriptors_posted") == sum(c.descriptors for c in costs), costs
    assert grew("bytes_read") == sum(c.bytes for c in costs), costs
