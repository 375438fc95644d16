"""Every benchmark runs, as a user starts it: ``kvbridge bench NAME ... --json PATH``.

Benchmarks are not timed here (speed is measured by running them, docs/performance.md);
what is checked is that each one still runs against the code it measures and writes rows
with figures in them. Three had rotted unseen (a wrapped engine the agent gate could not
reach, a field the worker no longer reports, block ids sent without their group), because
only their ``--help`` ran in CI. Each run is as small as the benchmark allows; ``vllm``
starts real vLLM servers for minutes and is run by hand (its command is in
docs/performance.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvbridge.cli.bench import BENCHMARKS

Rows = list[dict[str, Any]]


def _positive(rows: Rows, *keys: str, where: str = "") -> None:
    """Every row (with ``where`` among its keys, if given) has each of ``keys`` > 0."""
    picked = [r for r in rows if not where or where in r]
    assert picked, f"no row has {where!r}"
    for row in picked:
        for key in keys:
            assert isinstance(row[key], int | float) and row[key] > 0, (key, row)


def _transfer(rows: Rows) -> None:
    names = [r["name"] for r in rows]
    assert "raw NIXL READ, 1 descriptor" in names and "raw NIXL WRITE, 1 descriptor" in names
    loads = [r for r in rows if r["name"].startswith(("connector", "1:2"))]
    assert {("push" in r["name"]) for r in loads} == {False, True}, names  # both modes ran
    _positive(rows, "seconds", "x_raw")
    assert all(r.get("bytes_ok") is not False for r in rows)
    for r in loads:  # transfer: where each load's time went
        if r["name"].startswith("connector"):
            phases = r["phases_ms"]
            assert set(phases) == {"peer", "prepare", "data", "finish", "rest"}, r
            assert phases["data"] > 0 and min(phases.values()) > -0.5, r


def _e2e(rows: Rows) -> None:
    assert {r["target"] for r in rows} == {"single", "pull", "push"}
    _positive(rows, "ttft_p50_ms")
    _positive([r for r in rows if r["target"] != "single"], "load_ms", "bytes_per_req")


# name -> (arguments, what its rows must hold)
RUNS: dict[str, tuple[list[str], Callable[[Rows], object]]] = {
    "block_sizes": (
        ["--tokens", "64", "--layers", "2", "--repeats", "1"],
        lambda rows: _positive(rows, "kib_per_descriptor"),
    ),
    "handshake": (
        ["--iterations", "5", "--warmup", "1", "--clients", "2", "--per-client", "2"],
        lambda rows: (
            _positive(rows, "p50_ms", "p99_ms", where="p50_ms"),
            _positive(rows, "handshakes_per_s", where="handshakes_per_s"),
        ),
    ),
    "layouts": (
        "--layers 2 --pool-mib 4 --repeats 1 --rounds 1 --block-sizes 16".split(),
        lambda rows: (
            _positive(rows, "gb_per_s", "copy_gb_per_s", "x_copy", where="gb_per_s"),
            _positive(rows, "ms", where="ms"),
        ),
    ),
    "scheduler": (
        ["--requests", "20", "--churn", "5", "--steps", "5"],
        lambda rows: _positive(rows, "us_per_request_step"),
    ),
    "tp": (["--tokens", "64", "--layers", "2"], lambda rows: _positive(rows, "kvbridge")),
    "tp_transfer": (
        ["--layers", "2", "--tokens", "64", "--iterations", "2", "--pairs", "1:2", "--push"],
        _transfer,
    ),
    "transfer": (["--layers", "2", "--tokens", "64", "--iterations", "2"], _transfer),
    "e2e": (["--lengths", "32", "--concurrency", "1", "--requests", "2"], _e2e),
    "vllm_layouts": (
        ["--layers", "2", "--tokens", "64", "--iterations", "2"],
        lambda rows: _positive(rows, "load_ms", "raw_ms", "x_raw"),
    ),
    "multihost": (
        "--rates 100mbit --modes pull --large-tokens 64 --small-tokens 16 --layers 2 "
        "--iterations 2".split(),
        lambda rows: _positive(rows, "seconds", "raw_seconds", "on_link"),
    ),
}
BY_HAND = {"vllm": "starts vLLM servers for minutes (docs/performance.md has its command)"}
NEEDS_ROOT = {"multihost"}  # network namespaces


def test_every_benchmark_is_run_here_or_says_why_not():
    assert set(RUNS) | set(BY_HAND) == set(BENCHMARKS)
    assert not set(RUNS) & set(BY_HAND)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_benchmark_runs_and_writes_its_figures(name: str, tmp_path: Path):
    if name in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip(f"{name}: network namespaces need root")
    if name == "vllm_layouts":
        pytest.importorskip("vllm", reason="vllm_layouts allocates through vLLM")
    args, check = RUNS[name]
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "kvbridge.cli", "bench", name, *args, "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, f"{' '.join(cmd)}: rc {run.returncode}\n{run.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert doc["rows"], f"{name}: no rows"
    check(doc["rows"])
