"""scripts/bench_json.py and scripts/plot_bench.py: what a benchmark writes with --json is
read back checked, and every figure is drawn from it with the values it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.cli.bench.results import BenchJSONError, read_json, write_json
from scripts.plot_bench import main, phase_rows, transfer_series

TRANSFER_ROWS = [
    {"name": "raw NIXL READ, 1 descriptor", "mode": "pull", "x_raw": 1.0},
    {"name": "connector pull x-NHD -> x-NHD, shuffled", "mode": "pull", "x_raw": 0.9},
    {"name": "connector pull x-NHD -> x-HND, shuffled", "mode": "pull", "x_raw": 0.5},
    {"name": "connector push x-NHD -> x-NHD, shuffled", "mode": "push", "x_raw": 0.8},
]
SHAPE = {"layers": 2, "heads": 2, "head_size": 8, "block_size": 16, "tokens": 64}


def write(tmp: Path, bench: str, rows: list[dict], **config: object) -> Path:
    path = tmp / f"{bench}.json"
    write_json(path, bench, rows, **config)
    return path


def test_write_then_read_keeps_rows_and_turns_nan_into_null(tmp_path: Path) -> None:
    path = write(tmp_path, "bench_x", [{"a": 1.5, "b": float("nan"), "c": [float("inf")]}], k=2)
    doc = read_json(path, "bench_x")
    assert doc["rows"] == [{"a": 1.5, "b": None, "c": [None]}]
    assert doc["config"] == {"k": 2}
    assert doc["host"]["cpus"] >= 1 and len(doc["host"]["loadavg"]) == 3
    assert write_json(None, "bench_x", [{"a": 1}]) is None  # no --json: nothing written


def test_read_refuses_another_benchmark_schema_or_no_rows(tmp_path: Path) -> None:
    path = write(tmp_path, "bench_e2e", [{"a": 1}])
    with pytest.raises(BenchJSONError, match="written by 'bench_e2e', expected 'bench_vllm'"):
        read_json(path, "bench_vllm")
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "schema": 99}))
    with pytest.raises(BenchJSONError, match="schema 99"):
        read_json(path, "bench_e2e")
    path.write_text(json.dumps({**doc, "rows": []}))
    with pytest.raises(BenchJSONError, match="no rows"):
        read_json(path, "bench_e2e")
    with pytest.raises(BenchJSONError, match="no rows to write"):
        write_json(path, "bench_e2e", [])


def test_transfer_series_groups_rows_by_format_and_mode(tmp_path: Path) -> None:
    doc = read_json(write(tmp_path, "bench_transfer", TRANSFER_ROWS, shape=SHAPE), "bench_transfer")
    formats, series = transfer_series(doc)
    assert formats == ["x-NHD -> x-NHD, shuffled", "x-NHD -> x-HND, shuffled"]
    assert series == {"pull": [0.9, 0.5], "push": [0.8, None]}


def test_phase_rows_skip_the_single_server_and_fill_missing_phases(tmp_path: Path) -> None:
    rows = [
        {"target": "single", "tokens": 128, "concurrency": 1, "phases_ms": {}},
        {"target": "pull", "tokens": 128, "concurrency": 1, "phases_ms": {"data": 2.0}},
    ]
    doc = read_json(write(tmp_path, "bench_e2e", rows, model="m"), "bench_e2e")
    assert phase_rows(doc) == [
        ("pull, 128 tokens, 1 client(s)", {"peer": 0.0, "prepare": 0.0, "data": 2.0, "finish": 0.0})
    ]


def test_every_figure_is_drawn_as_a_png(tmp_path: Path) -> None:
    e2e = [
        {"target": m, "tokens": 128, "concurrency": 1, "phases_ms": {"peer": 0.1, "data": 2.0}}
        for m in ("single", "pull", "push")
    ]
    vllm = [
        {"connector": c, "length": 256, "concurrency": 1, "ttft_p50_ms": t, "ttft_p90_ms": 2 * t}
        for c, t in (("kvbridge", 100.0), ("nixl", 400.0))
    ]
    tp = [
        {"decode_tp": 2, "prefill_tp": 1, "format": "cross-layer", "kvbridge": 512,
         "per_slice": 32768, "per_head": 131072},
    ]  # fmt: skip
    blocks = [{"prefill_block": 80, "decode_block": 32, "cross_layer": 128, "per_layer": 4096}]
    out = tmp_path / "img"
    argv = [
        "--out", str(out),
        "--transfer", str(write(tmp_path, "bench_transfer", TRANSFER_ROWS, shape=SHAPE)),
        "--e2e", str(write(tmp_path, "bench_e2e", e2e, model="m", prefill_block=32,
                           decode_block=16)),
        "--vllm", str(write(tmp_path, "bench_vllm", vllm, prefill_block=32, decode_block=32,
                            requests=4)),
        "--tp", str(write(tmp_path, "bench_tp", tp, tokens=4096, block_size=16)),
        "--block-sizes", str(write(tmp_path, "bench_block_sizes", blocks, tokens=2048)),
    ]  # fmt: skip
    assert main(argv) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["descriptors.png", "handover_phases.png", "transfer.png", "ttft_vllm.png"]
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_no_input_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "img")])
    assert not (tmp_path / "img").exists()
