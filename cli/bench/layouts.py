"""Benchmark of layouts/: in-place transforms vs a plain torch copy, and descriptor arrays.

For each case (block size x per-layer/cross-layer) the script allocates a realistic KV
cache (32 layers, 8 KV heads, head size 128, fp16 by default) on ``--device``, fills it
with random bytes, and times, interleaved in the same process:

- ``copy``:    ``dst.copy_(src)`` of two fp16 tensors on the same device holding as many
               bytes as the transform moves (the baseline);
- ``permute``: NHD -> HND of the chosen blocks, in place;
- ``split``:   each block rewritten as receiver blocks of 16 tokens (8 for block 16), HND;
- ``merge``:   the inverse of ``split`` (receiver side after load).

GB/s counts the bytes of the blocks once (as for the copy). On a GPU every timed call is
bracketed by ``torch.cuda.synchronize()``. ``--strategy`` forces a rewrite strategy (see
``layouts/staging.py``; default: the device's own), ``--scratch-mib`` its scratch budget
(default: the strategy's). ``--check`` first compares every rewrite byte for byte with
the CPU strategy on a CPU copy of the pool; ``--quick`` (a 64 MiB pool, fewer repeats,
with ``--check``) suits a GPU check script. Descriptor timings build ``block_descriptors``
for 100k random block ids and the full ``descriptor_table`` of a 100k-block region, warm,
median of repeats.

    kvbridge bench layouts [--threads 1] [--repeats 5]
    kvbridge bench layouts --device cuda [--scratch-mib 16]
    kvbridge bench layouts --strategy batched  # GPU path, CPU
    kvbridge bench layouts --device cuda --strategy fused --quick  # one Triton kernel
    TRITON_INTERPRET=1 kvbridge bench layouts --strategy fused --pool-mib 2  # CPU: checks only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.descriptors import block_descriptors, descriptor_table, piece_offsets
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.region import KVRegion, MemoryKind
from kvbridge.layouts.specs import FullAttentionSpec
from kvbridge.layouts.staging import RewriteStrategy
from kvbridge.layouts.transforms import merge_blocks, permute_layout, split_blocks

TARGET_RATIO = 0.5
TARGET_DESCRIPTOR_MS = 10.0


def _median_seconds(fn: Callable[[], object], repeats: int, device=None) -> float:
    """Median wall time of ``fn``; on a GPU the queued work is waited for on both sides."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else None
    fn()  # warm: caches, page faults, lazy init
    times = []
    for _ in range(repeats):
        if sync:
            sync(device)
        start = time.perf_counter()
        fn()
        if sync:
            sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _buffers(args, block_size: int, cross: bool, device: torch.device) -> KVCacheBuffers:
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=args.heads,
        head_size=args.head_size,
        dtype=torch.float16,
    )
    group = KVCacheGroup(
        group_id=0, layer_names=tuple(f"layer.{i}" for i in range(args.layers)), spec=spec
    )
    num_blocks = args.pool_bytes // (spec.page_size_bytes * args.layers)
    config = KVCacheConfig(groups=(group,), num_blocks=num_blocks)
    fmt = CacheFormat(layout=KVLayout.NHD, cross_layer=cross)
    buffers = KVCacheBuffers(config, fmt, device=device)
    gen = torch.Generator().manual_seed(block_size)  # the same bytes on every device
    for t in buffers.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    return buffers


def bench_transforms(args) -> list[tuple]:
    rows = []
    for block_size in args.block_sizes:
        for cross in (False, True):
            rows.extend(_bench_case(args, block_size, cross))
    return rows


def _rewrites(block_size: int, ids: np.ndarray, **options) -> dict[str, Callable]:
    """The timed rewrites, each a function of the buffers."""
    sub = 16 if block_size > 16 else block_size // 2
    return {
        "permute": lambda b: permute_layout(b, 0, ids, KVLayout.HND, **options),
        "split": lambda b: split_blocks(
            b, 0, ids, sub_block_size=sub, to_layout=KVLayout.HND, **options
        ),
        "merge": lambda b: merge_blocks(
            b, 0, ids, sub_block_size=sub, from_layout=KVLayout.HND, **options
        ),
    }


def _check_case(args, block_size: int, cross: bool, buffers, ids: np.ndarray) -> None:
    """Every rewrite, in turn, against the CPU strategy on a CPU copy of the same bytes."""
    reference = _buffers(args, block_size, cross, torch.device("cpu"))
    cpu_rewrites = _rewrites(block_size, ids, strategy=RewriteStrategy.SMALL_SCRATCH)
    for name, rewrite in _rewrites(block_size, ids, **args.options).items():
        cpu_rewrites[name](reference)
        rewrite(buffers)
        for i, (want, got) in enumerate(zip(reference.tensors, buffers.tensors, strict=True)):
            if not torch.equal(want, got.cpu()):
                raise SystemExit(
                    f"check failed: {name} (block {block_size}, cross_layer={cross}) differs "
                    f"from the CPU strategy in tensor {i}"
                )


def _bench_case(args, block_size: int, cross: bool) -> list[tuple]:
    buffers = _buffers(args, block_size, cross, args.device)
    n = buffers.config.num_blocks
    ids = np.random.default_rng(0).permutation(n)[: int(n * 0.75)]  # scattered, random order
    if args.check:
        _check_case(args, block_size, cross, buffers, ids)
    moved = ids.size * buffers.group_block_bytes(0)
    src = torch.randint(-1000, 1000, (moved // 2,), dtype=torch.int16).view(torch.float16)
    src = src.to(args.device)
    dst = torch.empty_like(src)
    ops = {"copy": lambda: dst.copy_(src)}
    for name, rewrite in _rewrites(block_size, ids, **args.options).items():
        ops[name] = lambda rewrite=rewrite: rewrite(buffers)
    # interleave the ops so that machine noise hits them alike; keep each op's best round
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(args.rounds):
        for name, fn in ops.items():
            times[name].append(_median_seconds(fn, args.repeats, args.device))
    copy_s = min(times["copy"])
    kind = "cross-layer" if cross else "per-layer"
    return [
        (
            block_size,
            kind,
            name,
            ids.size,
            moved,
            moved / min(times[name]) / 1e9,
            moved / copy_s / 1e9,
            copy_s / min(times[name]),
        )
        for name in ("permute", "split", "merge")
    ]


def bench_descriptors(args) -> list[tuple]:
    n = 100_000
    region = KVRegion(
        name="bench",
        base_addr=0x7F00_0000_0000,
        block_bytes=2 << 20,
        block_stride_bytes=2 << 20,
        num_blocks=n,
        memory_kind=MemoryKind.DRAM,
    )
    ids = np.random.default_rng(1).permutation(n)
    offsets = piece_offsets(region, 4)
    cases = {
        "block_descriptors(100k ids)": lambda: block_descriptors(region, ids),
        "block_descriptors(100k ids x 4 pieces)": lambda: block_descriptors(
            region, ids, offsets=offsets, length=region.block_bytes // 4
        ),
        "descriptor_table(100k blocks)": lambda: descriptor_table(region),
    }
    return [(name, _median_seconds(fn, args.repeats * 4) * 1e3) for name, fn in cases.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--pool-mib", type=int, default=512, help="KV pool size per case")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (best kept)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--strategy",
        choices=["auto", *(s.value for s in RewriteStrategy)],
        default="auto",
        help="rewrite strategy (auto: the device's own)",
    )
    parser.add_argument(
        "--scratch-mib", type=float, default=None, help="scratch budget (default: the strategy's)"
    )
    parser.add_argument("--check", action="store_true", help="compare with the CPU strategy")
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB pool, 2 rounds of 2, with --check"
    )
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.pool_mib, args.rounds, args.repeats, args.check = 64, 2, 2, True
    args.pool_bytes = args.pool_mib << 20
    args.device = torch.device(args.device)
    strategy = (
        RewriteStrategy.for_device(args.device)
        if args.strategy == "auto"
        else RewriteStrategy.parse(args.strategy)
    )
    budget = None if args.scratch_mib is None else int(args.scratch_mib * 2**20)
    args.options = {"strategy": strategy, "scratch_budget_bytes": budget}
    torch.set_num_threads(args.threads)

    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, {args.layers} layers x "
        f"{args.heads} heads x {args.head_size} fp16, pool {args.pool_mib} MiB per case"
    )
    print(
        f"device {_device_name(args.device)}, strategy {strategy.value}"
        f"{' (auto)' if args.strategy == 'auto' else ''}, scratch budget "
        f"{_budget_text(strategy, budget)}{', checked' if args.check else ''}"
    )
    print(
        f"{'block':>5} {'alloc':<11} {'op':<8} {'blocks':>6} {'MiB':>6} "
        f"{'GB/s':>6} {'copy GB/s':>9} {'x copy':>6}"
    )
    worst, rows = float("inf"), []
    for bs, kind, op, nblk, moved, gbs, copy_gbs, ratio in bench_transforms(args):
        worst = min(worst, ratio)
        flag = "" if ratio >= TARGET_RATIO else "  < target"
        print(
            f"{bs:>5} {kind:<11} {op:<8} {nblk:>6} {moved / 2**20:>6.0f} "
            f"{gbs:>6.2f} {copy_gbs:>9.2f} {ratio:>6.2f}{flag}"
        )
        rows.append(
            {
                "block_size": bs,
                "alloc": kind,
                "op": op,
                "blocks": nblk,
                "bytes": moved,
                "gb_per_s": gbs,
                "copy_gb_per_s": copy_gbs,
                "x_copy": ratio,
            }
        )
    print(f"worst transform / copy ratio: {worst:.2f} (target >= {TARGET_RATIO})")
    print()
    slowest = 0.0
    for name, ms in bench_descriptors(args):
        slowest = max(slowest, ms)
        print(f"{name:<42} {ms:8.2f} ms")
        rows.append({"op": name, "ms": ms})
    print(f"slowest descriptor build: {slowest:.2f} ms (target < {TARGET_DESCRIPTOR_MS} ms)")
    config = {
        "device": str(args.device),
        "strategy": strategy.value,
        "scratch_budget_bytes": budget,
        **{k: getattr(args, k) for k in ("threads", "layers", "heads", "head_size", "pool_mib")},
        **{k: getattr(args, k) for k in ("block_sizes", "repeats", "rounds", "check")},
    }
    write_json(args.json, "bench_layouts", rows, **config)
    return 0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _budget_text(strategy: RewriteStrategy, budget: int | None) -> str:
    if budget is not None:
        return f"{budget / 2**20:g} MiB"
    if strategy is RewriteStrategy.SMALL_SCRATCH:
        return "one group block (default)"
    return f"{strategy.default_budget_bytes(0) / 2**20:g} MiB (default)"


if __name__ == "__main__":
    sys.exit(main())
