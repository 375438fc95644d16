"""The digest (``extra.verify``) against a copy of the same bytes, by row size.

A request's rows, contiguous and shuffled over a pool twice their size, digested with
``kvbridge.layouts.digest`` (``row_sums`` + ``fold``) and copied with ``copy_`` on the
same device, at 1, 32 and 256 MiB, for cross-layer rows (one 256 KiB piece a block) and
per-layer rows (a 64 KiB block's K and V pieces, 32 KiB each). ``--baseline FILE`` times
another digest module beside it (an earlier definition, e.g.
``git show REV:layouts/digest.py > FILE``), on the same rows in the same run.

    .venv/bin/python scripts/bench_digest.py [--device cuda] [--baseline /tmp/v1.py]

Figures and what they mean: docs/performance.md, "Verified loads".
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from kvbridge.layouts import digest

SIZES_MIB = (1, 32, 256)
ROWS = (  # name, block bytes, pieces a block
    ("cross-layer 256 KiB", 256 << 10, 1),
    ("per-layer K,V 32 KiB", 64 << 10, 2),
)


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_digest", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _median_ms(
    fns: dict[str, Callable[[], object]], on: torch.Tensor, iterations: int
) -> dict[str, float]:
    """Each of ``fns``' median time, the device's queue drained before and after; taken
    in turns, so that a neighbour's load on a shared machine falls on all of them."""

    def sync() -> None:
        if on.is_cuda:
            torch.cuda.synchronize(on.device)

    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iterations + 1):  # the first round warms caches and allocators
        for key, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}


def _digest(
    module: ModuleType, units: torch.Tensor, offsets: np.ndarray, length: int, rows: np.ndarray
) -> int:
    return module.fold(module.row_sums(units, offsets, length, rows))


def measure(device: str, iterations: int, baseline: ModuleType | None) -> list[dict]:
    out = []
    for name, block_bytes, m in ROWS:
        length = block_bytes // m
        offsets = np.arange(m, dtype=np.int64) * length
        for mib in SIZES_MIB:
            n = max(1, (mib << 20) // block_bytes)
            units = torch.randint(0, 256, (2 * n + 16, block_bytes), dtype=torch.uint8)
            units = units.to(device)
            src = units[:n].reshape(-1)
            dst = torch.empty_like(src)
            shuffled = np.random.default_rng(0).permutation(units.shape[0])[:n]
            for order, blocks in (("contiguous", np.arange(n)), ("shuffled", shuffled)):
                rows = (blocks[:, None] * m + np.arange(m)[None, :]).reshape(-1)
                copy = functools.partial(dst.copy_, src)
                fns: dict[str, Callable[[], object]] = {"copy_ms": copy}
                for key, module in (("digest_ms", digest), ("baseline_ms", baseline)):
                    if module is not None:
                        fns[key] = functools.partial(_digest, module, units, offsets, length, rows)
                record = {"rows": name, "mib": n * block_bytes / 2**20, "order": order}
                out.append(record | _median_ms(fns, units, iterations))
            del units, src, dst
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--iterations", type=int, default=5, help="timed runs each (median)")
    ap.add_argument("--baseline", metavar="FILE", help="another digest module to time beside")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's CPU threads for the copy (default 1: host digests run on one thread)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    baseline = _load(args.baseline) if args.baseline else None
    records = measure(args.device, args.iterations, baseline)
    where = args.device if args.device != "cpu" else f"cpu, copy on {args.threads} thread(s)"
    print(f"digest (version {digest.DIGEST_VERSION}) vs copy_ of the same bytes, {where}")
    head = f"{'rows':<22} {'MiB':>5} {'blocks':<11} {'digest ms':>10}"
    head += f" {'baseline ms':>12}" if baseline else ""
    head += f" {'copy ms':>8} {'x copy':>7}"
    print(head)
    print("-" * len(head))
    for r in records:
        line = f"{r['rows']:<22} {r['mib']:5.0f} {r['order']:<11} {r['digest_ms']:10.2f}"
        line += f" {r['baseline_ms']:12.2f}" if baseline else ""
        line += f" {r['copy_ms']:8.2f} {r['copy_ms'] / r['digest_ms']:7.2f}"
        print(line)
    print("x copy = copy time / digest time (1: the digest takes as long as a copy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
