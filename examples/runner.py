"""Model + KV-cache glue: one variant of the tiny model over one :class:`KVCacheBuffers`.

The runner owns the cache memory the connector registers, turns a request's manager
block ids into the tables the kernels want, and runs a batch::

    manager ids (one list per group)      ->  SeqInput.block_tables
    full / sliding-window group: [3, 7]   ->  kernel ids [6, 7, 14, 15]   (r = 2)
    state group:                 [3, 7]   ->  [3, 7] (states live per manager block)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.examples.device import CPU, add_device_argument, parse_device
from kvbridge.examples.model import ModelCaches, ModelConfig, SeqInput, TinyModel
from kvbridge.examples.paged_attention import AttentionCache
from kvbridge.examples.state_layer import StateCache
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.block_table import kernel_ratio, to_kernel_block_ids
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import KVCacheKind


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """What a worker serves and how it stores its cache (read once from the CLI)."""

    model: str = "tiny-hybrid"
    block_size: int = 16
    kernel_block_size: int | None = None  # None: same as block_size
    layout: KVLayout = KVLayout.NHD
    cross_layer: bool = False
    packing: KVPacking = KVPacking.BLOCKS_FIRST
    num_blocks: int = 512
    device: torch.device = CPU  # a str is parsed (examples/device.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", parse_device(self.device, option="RunnerConfig.device"))
        kernel_ratio(self.block_size, self.kernel_block_size or self.block_size)
        if self.num_blocks <= 0:
            raise LayoutError(f"num_blocks={self.num_blocks} must be positive")

    @property
    def cache_format(self) -> CacheFormat:
        return CacheFormat(
            layout=self.layout,
            kernel_block_size=self.kernel_block_size,
            cross_layer=self.cross_layer,
            packing=self.packing,
        )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="tiny-hybrid")
        parser.add_argument("--block-size", type=int, default=16)
        parser.add_argument("--kernel-block-size", type=int, default=None)
        parser.add_argument("--kv-layout", default="NHD", choices=["NHD", "HND"])
        parser.add_argument("--cross-layers", action="store_true")
        parser.add_argument("--kv-packing", default="blocks_first")
        parser.add_argument("--num-blocks", type=int, default=512)
        add_device_argument(parser, "; holds the weights and the KV cache")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunnerConfig:
        return cls(
            model=args.model,
            block_size=args.block_size,
            kernel_block_size=args.kernel_block_size,
            layout=KVLayout.parse(args.kv_layout),
            cross_layer=args.cross_layers,
            packing=KVPacking.parse(args.kv_packing),
            num_blocks=args.num_blocks,
            device=parse_device(args.device),
        )


class ModelRunner:
    """Weights, cache buffers and per-layer cache views of one worker."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.device = config.device
        self.model = TinyModel.from_name(config.model, config.device)
        mc: ModelConfig = self.model.config
        self.model_config = mc
        groups = mc.kv_cache_groups(config.block_size)
        self.kv_config = KVCacheConfig.uniform(groups, config.num_blocks)
        self.buffers = KVCacheBuffers(self.kv_config, config.cache_format, config.device)
        self.kernel_block_size = config.kernel_block_size or config.block_size
        self.caches = ModelCaches(layers=tuple(self._layer_cache(n) for n in mc.layer_names))
        self.caches.check(mc)
        self.group_kinds: tuple[KVCacheKind, ...] = mc.group_kinds

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_groups(self) -> int:
        return len(self.group_kinds)

    @property
    def has_state(self) -> bool:
        return KVCacheKind.STATE in self.group_kinds

    def _layer_cache(self, layer_name: str) -> AttentionCache | StateCache:
        spec_kind = self.kv_config.group_of(layer_name).kind
        if spec_kind is KVCacheKind.STATE:
            views = self.buffers.state_views(layer_name)
            return StateCache(tensors=tuple(views), block_size=self.block_size)
        k, v = self.buffers.attention_views(layer_name)
        return AttentionCache(
            k=k,
            v=v,
            layout=self.config.layout,
            kernel_block_size=self.kernel_block_size,
            block_size=self.block_size,
        )

    def block_tables(self, block_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, ...]:
        """Per-group manager ids -> the tables ``SeqInput`` wants (see the module doc)."""
        tables = []
        for ids, kind in zip(block_ids, self.group_kinds, strict=True):
            arr = np.asarray(ids, dtype=np.int64)
            if kind is not KVCacheKind.STATE:
                arr = to_kernel_block_ids(arr, self.block_size, self.kernel_block_size)
            tables.append(arr)
        return tuple(tables)

    def execute(self, batch: Sequence[SeqInput]) -> list[torch.Tensor]:
        """Logits ``[T_i, vocab]`` of each sequence's new tokens, on :attr:`device`;
        writes the caches."""
        if not batch:
            return []
        return self.model.forward(batch, self.caches)
