"""Descriptors per request across tensor-parallel sizes: head-major wire chunks vs per-head reads.

::

    kvbridge bench tp [--tokens 4096] [--layers 32] [--heads 8]

For each (decode TP, prefill TP) pair and cache format, negotiates the real plans of every
decode rank with every prefill rank it reads (``kvbridge.handshake.tp.sources``) and counts the
descriptors one request moves, summed over decode ranks. Beside it, what reading the same
head slices costs without kvbridge's head-major rewrite after save:

* per (layer, K/V) slice: an HND per-layer cache read in place, where a head slice of one
  K or V block is contiguous (what connectors that read HND blocks per head range post);
* per head: an NHD cache read in place, one descriptor per (block, layer, K/V, head) at
  best (per token even, unless the blocks are HND).

The last format is a prefill that may not rewrite its blocks (vLLM on a GPU): kvbridge then
reads HND blocks in place, one descriptor per (layer, K/V) head slice of a block.

Counts only (pure planning, no transfer); the connector's own NIXL tests move the bytes.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.handshake import tp
from kvbridge.handshake.compat import compat_hash
from kvbridge.handshake.description import PeerLayout, WorkerIdentity, describe, parse_description
from kvbridge.handshake.plan import negotiate
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import FullAttentionSpec

# name -> (format on both sides, whether prefill may rewrite its blocks after save)
FORMATS = {
    "cross-layer": (CacheFormat(layout=KVLayout.NHD, cross_layer=True), True),
    "per-layer": (CacheFormat(layout=KVLayout.HND), True),
    # vLLM on a GPU: its prefix cache may read prefill's blocks, so they are read in place
    "per-layer HND, prefill may not rewrite": (CacheFormat(layout=KVLayout.HND), False),
}


def side(
    fmt: CacheFormat, rank: int, tp_size: int, args: argparse.Namespace, rewrites: bool = True
) -> PeerLayout:
    heads = tp.rank_heads(rank, tp_size, args.heads).count
    spec = FullAttentionSpec(
        block_size=args.block_size,
        num_kv_heads=heads,
        head_size=args.head_size,
        dtype=torch.float16,
    )
    names = tuple(f"l{i}" for i in range(args.layers))
    config = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=names, spec=spec),), num_blocks=2
    )
    buffers = KVCacheBuffers(config, fmt)
    identity = WorkerIdentity(
        engine_id=f"e{tp_size}",
        agent_name=f"e{tp_size}-{rank}",
        model_name="m",
        dtype="float16",
        num_layers=args.layers,
        num_kv_heads=args.heads,
        head_size=args.head_size,
        rank=rank,
        tp_size=tp_size,
    )
    desc = describe(
        identity,
        buffers,
        nixl_metadata=b"",
        compat_hash=compat_hash(identity, config),
        rewrites_in_place=rewrites,
    )
    return parse_description(desc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="the model's KV heads")
    ap.add_argument("--head-size", type=int, default=128)
    add_json_argument(ap)
    args = ap.parse_args(argv)
    blocks = args.tokens // args.block_size
    rows = []
    print(
        f"{args.tokens} tokens, block {args.block_size}, {args.layers} layers, {args.heads} KV "
        f"heads x {args.head_size}, fp16; descriptors per request, all decode ranks together\n"
    )
    print(
        "| decode TP / prefill TP | format (both sides) | kvbridge head-major "
        "| per (layer, K/V) slice | per head | KiB per descriptor (kvbridge) |"
    )
    print("|---|---|---|---|---|---|")
    for d_tp, p_tp in [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (8, 2)]:
        for name, (fmt, rewrites) in FORMATS.items():
            ours = baseline_slices = baseline_heads = 0
            moved = 0
            for d in range(d_tp):
                local = side(fmt, d, d_tp, args)
                for s in tp.sources(d, d_tp, p_tp, args.heads):
                    remote = side(fmt, s.remote_rank, p_tp, args, rewrites)
                    g = negotiate(local, remote).groups[0]
                    n = blocks * (args.block_size // g.wire_tokens) * g.descriptors_per_chunk
                    ours += n
                    moved += blocks * (args.block_size // g.wire_tokens) * g.bytes_per_chunk
                    baseline_slices += blocks * args.layers * 2
                    baseline_heads += blocks * args.layers * 2 * s.num_heads
            print(
                f"| {d_tp} / {p_tp} | {name} | {ours:,} | {baseline_slices:,} | {baseline_heads:,} "
                f"| {moved / ours / 1024:.0f} |"
            )
            rows.append(
                {
                    "decode_tp": d_tp,
                    "prefill_tp": p_tp,
                    "format": name,
                    "kvbridge": ours,
                    "per_slice": baseline_slices,
                    "per_head": baseline_heads,
                    "kib_per_descriptor": moved / ours / 1024,
                }
            )
    write_json(args.json, "bench_tp", rows, **vars(args) | {"json": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
