"""The cache ``kvbridge bench transfer`` moves: its shape (``--layers``, ``--heads``, ...),
the cache formats by code (``x-NHD``, ``bf-NHD``, ``ks-NHD``), the bytes each side fills
it with, and the digest that checks a load."""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, fields

import numpy as np
import torch

from kvbridge.connector.worker.worker import ModelInfo
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers, read_group_token_major
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import FullAttentionSpec


@dataclass(frozen=True, kw_only=True)
class Shape:
    layers: int
    heads: int
    head_size: int
    block_size: int
    tokens: int

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return 2 * self.blocks_per_request + 16  # room to scatter a request's blocks

    @property
    def request_bytes(self) -> int:
        return self.tokens * self.layers * 2 * self.heads * self.head_size * 2  # fp16 K+V

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Shape:
        """From the flags :func:`add_common_args` adds (``--head-size`` -> ``head_size``)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def model(self) -> ModelInfo:
        return ModelInfo(
            model_name="bench", dtype="float16", num_kv_heads=self.heads, head_size=self.head_size
        )

    def buffers(self, fmt: CacheFormat, device: str = "cpu") -> KVCacheBuffers:
        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.heads,
            head_size=self.head_size,
            dtype=torch.float16,
        )
        group = KVCacheGroup(
            group_id=0, layer_names=tuple(f"layer.{i}" for i in range(self.layers)), spec=spec
        )
        config = KVCacheConfig(groups=(group,), num_blocks=self.num_blocks)
        return KVCacheBuffers(config, fmt, device=device)


def parse_format(code: str) -> CacheFormat:
    """``x-NHD``: x cross-layer, bf per-layer blocks_first, ks per-layer kv_split."""
    alloc, layout = code.split("-")
    return CacheFormat(
        layout=KVLayout(layout),
        cross_layer=alloc == "x",
        packing=KVPacking.KV_SPLIT if alloc == "ks" else KVPacking.BLOCKS_FIRST,
    )


def fill(buffers: KVCacheBuffers, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in buffers.tensors:  # generated on the host, then copied where the cache lives
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def kv_digest(
    buffers: KVCacheBuffers, block_ids: list[int], heads: tuple[int, int] | None = None
) -> str:
    """sha256 of the token-major KV of ``block_ids``; ``heads=(first, count)``: of those
    (rank-local) heads only."""
    tm = read_group_token_major(buffers, 0, np.asarray(block_ids))
    if heads is not None:  # (layers, parts, tokens, heads, head_size)
        tm = tm[:, :, :, heads[0] : heads[0] + heads[1]]
    host = tm.contiguous().view(torch.uint8).cpu()  # explicit: the bytes leave the device
    return hashlib.sha256(host.numpy().tobytes()).hexdigest()


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The shape flags :meth:`Shape.from_args` reads (:func:`shape_args` writes them) and
    ``--iterations`` (timed runs per row, median)."""
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iterations", type=int, default=7)


def shape_args(shape: Shape) -> list[str]:
    return [
        f"--layers={shape.layers}",
        f"--heads={shape.heads}",
        f"--head-size={shape.head_size}",
        f"--block-size={shape.block_size}",
        f"--tokens={shape.tokens}",
    ]
