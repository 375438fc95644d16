"""Draw the benchmarks' ``--json`` results as PNGs (for ``docs/performance.md``).

::

    .venv/bin/python scripts/plot_bench.py --out docs/img \\
        --transfer transfer.json --e2e e2e.json --vllm vllm.json --tp tp.json \\
        --block-sizes block_sizes.json

Each input is optional; each given one draws its figure(s):

- ``--transfer`` (``scripts/bench_transfer.py --json``): ``transfer.png``, the connector's
  time as a multiple of raw NIXL's (READ for pull, WRITE for push), by format and mode.
- ``--vllm`` (``scripts/bench_vllm.py --json``): ``ttft_vllm.png``, TTFT p50 (bar) and p90
  (tick) of kvbridge and vLLM's NixlConnector on the same vLLM servers.
- ``--e2e`` (``scripts/bench_e2e.py --json``): ``handover_phases.png``, decode's mean load
  time per phase (peer, prepare, data, finish), pull and push.
- ``--tp`` and ``--block-sizes`` (``scripts/bench_tp.py --json``,
  ``scripts/bench_block_sizes.py --json``): ``descriptors.png``, descriptors per request.

Needs matplotlib (the ``plot`` extra: ``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from kvbridge.cli.bench.results import read_json

Doc = dict[str, Any]
PHASES = ("peer", "prepare", "data", "finish")
MODE_COLORS = {"pull": "#1f77b4", "push": "#ff7f0e"}


def _machine(doc: Doc) -> str:
    host = doc["host"]
    load = host["loadavg"][0]
    return f"{doc['created'][:10]}, {host['cpus']} CPUs, load average {load:.1f}"


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {path}")
    return path


def transfer_series(doc: Doc) -> tuple[list[str], dict[str, list[float | None]]]:
    """Formats (row names without the mode) in table order, and x raw per mode."""
    formats: list[str] = []
    by: dict[tuple[str, str], float] = {}
    for row in doc["rows"]:
        name = row["name"]
        if not name.startswith("connector "):
            continue  # the raw and torch rows are the baselines
        mode, _, fmt = name.removeprefix("connector ").partition(" ")
        if fmt not in formats:
            formats.append(fmt)
        by[(mode, fmt)] = row["x_raw"]
    modes = sorted({m for m, _ in by}, key=lambda m: (m != "pull", m))
    return formats, {m: [by.get((m, f)) for f in formats] for m in modes}


def plot_transfer(doc: Doc, out: Path) -> Path:
    formats, series = transfer_series(doc)
    shape = doc["config"]["shape"]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(formats) + 1.8))
    height = 0.8 / max(len(series), 1)
    for i, (mode, values) in enumerate(series.items()):
        ys = [k + i * height for k in range(len(formats))]
        xs = [v if v is not None else 0.0 for v in values]
        ax.barh(ys, xs, height=height, label=mode, color=MODE_COLORS.get(mode))
        for y, v in zip(ys, values, strict=True):
            if v is not None:
                ax.text(v + 0.01, y, f"{v:.2f}x", va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    ax.set_yticks([k + height * (len(series) - 1) / 2 for k in range(len(formats))], formats)
    ax.invert_yaxis()
    ax.set_xlabel("x raw NIXL (raw time / connector time; 1 = as fast as one raw descriptor)")
    mib = shape["layers"] * shape["heads"] * shape["head_size"] * 2 * 2 * shape["tokens"] / 2**20
    ax.set_title(
        f"Connector vs raw NIXL, {mib:.0f} MiB request (block {shape['block_size']})\n"
        f"{_machine(doc)}",
        fontsize=10,
    )
    ax.legend(loc="lower right")
    return _save(fig, out / "transfer.png")


def plot_vllm(doc: Doc, out: Path) -> Path:
    rows = doc["rows"]
    points = sorted({(r["length"], r["concurrency"]) for r in rows})
    connectors = [c for c in ("kvbridge", "nixl") if any(r["connector"] == c for r in rows)]
    labels = {"kvbridge": "kvbridge", "nixl": "vLLM NixlConnector"}
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(points) + 2), 4))
    width = 0.8 / len(connectors)
    for i, c in enumerate(connectors):
        got = {(r["length"], r["concurrency"]): r for r in rows if r["connector"] == c}
        xs = [k + i * width for k in range(len(points))]
        p50 = [got[p]["ttft_p50_ms"] if p in got else 0.0 for p in points]
        p90 = [got[p]["ttft_p90_ms"] if p in got else 0.0 for p in points]
        ax.bar(xs, p50, width=width, label=f"{labels[c]} p50")
        ax.scatter(xs, p90, marker="_", s=300, color="black", zorder=3)
    ax.scatter([], [], marker="_", s=300, color="black", label="p90")
    ax.set_xticks(
        [k + width * (len(connectors) - 1) / 2 for k in range(len(points))],
        [f"{n} tokens\n{c} client{'s' if c > 1 else ''}" for n, c in points],
    )
    ax.set_yscale("log")
    ax.set_ylabel("TTFT through the router (ms, log)")
    cfg = doc["config"]
    ax.set_title(
        f"vLLM CPU, prefill block {cfg['prefill_block']} -> decode {cfg['decode_block']}, "
        f"{cfg['requests']} requests a point\n{_machine(doc)}",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    return _save(fig, out / "ttft_vllm.png")


def phase_rows(doc: Doc) -> list[tuple[str, dict[str, float]]]:
    """(label, mean ms per phase) for every P/D point, in the file's order."""
    out = []
    for r in doc["rows"]:
        if r["target"] == "single":
            continue
        label = f"{r['target']}, {r['tokens']} tokens, {r['concurrency']} client(s)"
        out.append((label, {p: r["phases_ms"].get(p, 0.0) for p in PHASES}))
    return out


def plot_phases(doc: Doc, out: Path) -> Path:
    rows = phase_rows(doc)
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.8))
    left = [0.0] * len(rows)
    for phase in PHASES:
        widths = [ph[phase] for _, ph in rows]
        ax.barh(range(len(rows)), widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("decode's mean load time per phase (ms)")
    cfg = doc["config"]
    ax.set_title(
        f"Where a load's time goes: {cfg['model']}, prefill block {cfg['prefill_block']} -> "
        f"decode {cfg['decode_block']}\n{_machine(doc)}",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, out / "handover_phases.png")


def _bars(ax: Axes, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([k + i * width for k in range(len(labels))], values, width=width, label=name)
    ax.set_xticks([k + width * (len(series) - 1) / 2 for k in range(len(labels))], labels)
    ax.set_yscale("log")
    ax.set_ylim(top=max(max(v) for v in series.values()) * 40)  # room for the legend
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="upper left")


def plot_descriptors(tp: Doc | None, blocks: Doc | None, out: Path) -> Path:
    docs = [d for d in (tp, blocks) if d is not None]
    fig, axes = plt.subplots(1, len(docs), figsize=(6.5 * len(docs), 4.2), squeeze=False)
    panels = iter(axes[0])
    if tp is not None:
        ax = next(panels)
        rows = [r for r in tp["rows"] if r["format"] == "cross-layer"]
        labels = [f"{r['prefill_tp']} -> {r['decode_tp']}" for r in rows]
        _bars(
            ax,
            labels,
            {
                "kvbridge (head-major)": [r["kvbridge"] for r in rows],
                "per (layer, K/V) slice": [r["per_slice"] for r in rows],
                "per head": [r["per_head"] for r in rows],
            },
            "descriptors per request (log)",
        )
        cfg = tp["config"]
        ax.set_xlabel("prefill TP -> decode TP")
        ax.set_title(
            f"Across TP sizes: {cfg['tokens']} tokens, block {cfg['block_size']}, cross-layer",
            fontsize=10,
        )
    if blocks is not None:
        ax = next(panels)
        rows = blocks["rows"]
        labels = [f"{r['prefill_block']} -> {r['decode_block']}" for r in rows]
        _bars(
            ax,
            labels,
            {
                "cross-layer": [r["cross_layer"] for r in rows],
                "per-layer": [r["per_layer"] for r in rows],
            },
            "descriptors per request (log)",
        )
        ax.set_xlabel("prefill block -> decode block (tokens)")
        ax.set_title(
            f"Block sizes, {blocks['config']['tokens']}-token prompt (gcd = wire chunk)",
            fontsize=10,
        )
    return _save(fig, out / "descriptors.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for the PNGs")
    ap.add_argument("--transfer", type=Path, help="scripts/bench_transfer.py --json output")
    ap.add_argument("--vllm", type=Path, help="scripts/bench_vllm.py --json output")
    ap.add_argument("--e2e", type=Path, help="scripts/bench_e2e.py --json output")
    ap.add_argument("--tp", type=Path, help="scripts/bench_tp.py --json output")
    ap.add_argument("--block-sizes", type=Path, help="scripts/bench_block_sizes.py --json output")
    args = ap.parse_args(argv)
    if not (args.transfer or args.vllm or args.e2e or args.tp or args.block_sizes):
        ap.error("give at least one results file (--transfer, --vllm, --e2e, --tp, ...)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.transfer:
        plot_transfer(read_json(args.transfer, "bench_transfer"), args.out)
    if args.vllm:
        plot_vllm(read_json(args.vllm, "bench_vllm"), args.out)
    if args.e2e:
        plot_phases(read_json(args.e2e, "bench_e2e"), args.out)
    if args.tp or args.block_sizes:
        tp = read_json(args.tp, "bench_tp") if args.tp else None
        blocks = read_json(args.block_sizes, "bench_block_sizes") if args.block_sizes else None
        plot_descriptors(tp, blocks, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
