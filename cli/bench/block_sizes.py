"""Any pair of block sizes: descriptors per request and the sender's split after save.

::

    kvbridge bench block_sizes [--tokens 2048] [--layers 32] [--heads 8]

Per (prefill block, decode block) pair, for cross-layer and per-layer caches on both
sides, negotiates the real plan and counts the descriptors one request of ``--tokens``
prompt tokens moves (decode loads all but the last). Non-multiple pairs move wire chunks
of ``gcd`` tokens, so the count grows by ``min(blocks) / gcd`` over the equal-size case.

Beside it, the sender's rewrite after save (its blocks cut into the decode's wire chunks,
NHD -> HND) is timed against a plain ``torch`` copy of the same bytes, side by side in
one process (median of ``--repeats``): the price of bridging the sizes on the sender.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np
import torch

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.handshake.compat import compat_hash
from kvbridge.handshake.description import PeerLayout, WorkerIdentity, describe, parse_description
from kvbridge.handshake.plan import negotiate
from kvbridge.handshake.plan_model import Rewrite
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import FullAttentionSpec
from kvbridge.layouts.transforms import rewrite_group

PAIRS = [(64, 64), (64, 32), (80, 32), (96, 64), (528, 64), (48, 32), (32, 48)]


def buffers(block_size: int, fmt: CacheFormat, num_blocks: int, args) -> KVCacheBuffers:
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=args.heads,
        head_size=args.head_size,
        dtype=torch.float16,
    )
    names = tuple(f"l{i}" for i in range(args.layers))
    config = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=names, spec=spec),), num_blocks=num_blocks
    )
    return KVCacheBuffers(config, fmt)


def layout_of(buf: KVCacheBuffers, engine: str, args) -> PeerLayout:
    identity = WorkerIdentity(
        engine_id=engine,
        agent_name=engine,
        model_name="m",
        dtype="float16",
        num_layers=args.layers,
        num_kv_heads=args.heads,
        head_size=args.head_size,
    )
    desc = describe(identity, buf, nixl_metadata=b"", compat_hash=compat_hash(identity, buf.config))
    return parse_description(desc)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def split_vs_copy(block_size: int, end: int, sender: Rewrite, args) -> str:
    """The sender's rewrite of one request's blocks (there and back, halved) against a
    torch copy of the same bytes."""
    num_blocks = -(-end // block_size)
    src = buffers(block_size, CacheFormat(layout=KVLayout.NHD, cross_layer=True), num_blocks, args)
    data = src.tensors[0]
    data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8))
    ids = np.arange(num_blocks)

    def there_and_back() -> None:
        rewrite_group(src, 0, ids, sender.src, sender.dst)
        rewrite_group(src, 0, ids, sender.dst, sender.src)

    t_rewrite = timed(there_and_back, args.repeats) / 2
    out = torch.empty_like(data)
    t_copy = timed(lambda: out.copy_(data), args.repeats)
    return f"{t_rewrite * 1e3:.1f} ms vs {t_copy * 1e3:.1f} ms ({t_copy / t_rewrite:.2f}x)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    add_json_argument(ap)
    args = ap.parse_args(argv)
    rows = []
    end = args.tokens - 1  # decode computes the last prompt token itself
    print(
        f"{args.tokens}-token prompt ({end} tokens loaded), {args.layers} layers, {args.heads} KV "
        f"heads x {args.head_size}, fp16; prefill NHD, decode HND\n"
    )
    print(
        "| prefill / decode block | wire chunk (tokens) | descriptors, cross-layer "
        "| descriptors, per-layer | KiB per descriptor (cross-layer) "
        "| sender split after save vs torch copy |"
    )
    print("|---|---|---|---|---|---|")
    for b_remote, b_local in PAIRS:
        counts, kib, sender = {}, 0.0, None
        for name, cross in (("cross", True), ("per-layer", False)):
            remote = buffers(b_remote, CacheFormat(layout=KVLayout.NHD, cross_layer=cross), 2, args)
            local = buffers(b_local, CacheFormat(layout=KVLayout.HND, cross_layer=cross), 2, args)
            g = negotiate(
                layout_of(local, "decode", args), layout_of(remote, "prefill", args)
            ).groups[0]
            chunks = g.chunks_for_tokens(0, end).size
            counts[name] = chunks * g.descriptors_per_chunk
            if cross:
                kib = g.bytes_per_chunk / g.descriptors_per_chunk / 1024
                sender = g.sender
        ratio = "-" if sender is None else split_vs_copy(b_remote, end, sender, args)
        print(
            f"| {b_remote} / {b_local} | {math.gcd(b_remote, b_local)} | {counts['cross']:,} "
            f"| {counts['per-layer']:,} | {kib:.0f} | {ratio} |"
        )
        rows.append(
            {
                "prefill_block": b_remote,
                "decode_block": b_local,
                "wire_chunk": math.gcd(b_remote, b_local),
                "cross_layer": counts["cross"],
                "per_layer": counts["per-layer"],
                "kib_per_descriptor": kib,
                "split_vs_copy": ratio,
            }
        )
    write_json(args.json, "bench_block_sizes", rows, **vars(args) | {"json": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
