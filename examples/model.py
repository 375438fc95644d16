"""The tiny deterministic model family the example engine serves.

Pre-norm decoder, float32, byte-level vocabulary, weights drawn from a generator seeded by
the model name (so every process builds the same model). Variants::

    tiny-dense         F F F F              F = full attention
    tiny-hybrid        F S F S              S = sliding window (24 tokens)
    tiny-hybrid-state  F M S F M S          M = Mamba-like state layer (state_layer.py)

Attention logits are scaled up (``attn_scale``) so attention is sharp: a wrong or missing
cached block visibly moves the logits and the greedy output.

Layers form KV-cache groups by kind, in the order full attention, sliding window, state
(only kinds the model has); a :class:`SeqInput` carries one block table per group: kernel
block ids for attention groups (``paged_attention``), manager block ids for the state
group (``state_layer``). :class:`ModelCaches` holds one cache view per layer.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from kvbridge.examples import state_layer
from kvbridge.examples.paged_attention import (
    AttentionCache,
    AttentionWeights,
    KVLayout,
    attend,
    paged_attention,
)
from kvbridge.examples.state_layer import StateCache, StateLayerWeights
from kvbridge.examples.tokenizer import VOCAB_SIZE
from kvbridge.layouts.errors import KVBridgeError, LayoutError
from kvbridge.layouts.groups import KVCacheGroup
from kvbridge.layouts.specs import (
    FullAttentionSpec,
    KVCacheKind,
    KVCacheSpec,
    SlidingWindowSpec,
    StateSpec,
)

FULL, SLIDING, STATE = (
    KVCacheKind.FULL_ATTENTION,
    KVCacheKind.SLIDING_WINDOW,
    KVCacheKind.STATE,
)
_GROUP_ORDER = (FULL, SLIDING, STATE)
_VARIANTS: dict[str, tuple[KVCacheKind, ...]] = {
    "tiny-dense": (FULL, FULL, FULL, FULL),
    "tiny-hybrid": (FULL, SLIDING, FULL, SLIDING),
    "tiny-hybrid-state": (FULL, STATE, SLIDING, FULL, STATE, SLIDING),
}
MODEL_NAMES = tuple(_VARIANTS)


class ModelConfigError(KVBridgeError, ValueError):
    """An unknown model name or a config the model cannot be built from."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    layer_kinds: tuple[KVCacheKind, ...]
    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    intermediate_size: int = 128
    sliding_window: int = 24
    state_inner_size: int = 64
    state_size: int = 4
    conv_width: int = 4
    attn_scale: float = 1.0  # 4x the usual head_size**-0.5: sharp attention
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        if name not in _VARIANTS:
            raise ModelConfigError(f"unknown model {name!r}; expected one of {list(_VARIANTS)}")
        return cls(name=name, layer_kinds=_VARIANTS[name])

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    @cached_property
    def group_kinds(self) -> tuple[KVCacheKind, ...]:
        """Kind of each KV-cache group, indexed by group id."""
        return tuple(k for k in _GROUP_ORDER if k in self.layer_kinds)

    @cached_property
    def layer_group_ids(self) -> tuple[int, ...]:
        return tuple(self.group_kinds.index(k) for k in self.layer_kinds)

    def group_layer_ids(self, group_id: int) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.layer_group_ids) if g == group_id)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"layers.{i}" for i in range(self.num_layers))

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return state_layer.state_shapes(
            d_inner=self.state_inner_size, d_state=self.state_size, conv_width=self.conv_width
        )

    def kv_specs(self, block_size: int) -> list[KVCacheSpec]:
        """One spec per layer; state pages are padded to the attention page when they fit."""
        attn = dict(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
        )
        page = FullAttentionSpec(**attn).page_size_bytes
        state = StateSpec(
            block_size=block_size,
            shapes=self.state_shapes,
            dtypes=(self.dtype,) * len(self.state_shapes),
        )
        has_attention = any(k is not STATE for k in self.layer_kinds)
        if has_attention and state.state_bytes <= page:
            state = replace(state, page_size_padded=page)
        by_kind: dict[KVCacheKind, KVCacheSpec] = {
            FULL: FullAttentionSpec(**attn),
            SLIDING: SlidingWindowSpec(**attn, sliding_window=self.sliding_window),
            STATE: state,
        }
        return [by_kind[k] for k in self.layer_kinds]

    def kv_cache_groups(self, block_size: int) -> tuple[KVCacheGroup, ...]:
        specs = self.kv_specs(block_size)
        return tuple(
            KVCacheGroup(
                group_id=g,
                layer_names=tuple(self.layer_names[i] for i in self.group_layer_ids(g)),
                spec=specs[self.group_layer_ids(g)[0]],
            )
            for g in range(len(self.group_kinds))
        )


@dataclass(frozen=True, kw_only=True)
class SeqInput:
    """New tokens of one request and where its cache lives.

    ``token_ids`` are cached at positions ``start_pos ..``; ``block_tables[g]`` is the
    table of KV-cache group ``g``: kernel block ids for attention groups, manager block
    ids for the state group (its entries hold boundary and running states, see
    ``state_layer``). ``state_snapshot = (n, slot)`` also keeps the state after ``n``
    tokens in block ``slot`` (a prefill's handover to its decode).
    """

    token_ids: Sequence[int] | torch.Tensor
    start_pos: int
    block_tables: tuple[np.ndarray, ...]
    state_snapshot: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


LayerCache = AttentionCache | StateCache


@dataclass(frozen=True, kw_only=True)
class ModelCaches:
    """One cache view per layer, in model order."""

    layers: tuple[LayerCache, ...]

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        kernel_block_size: int,
        layout: KVLayout,
        device: torch.device | str = "cpu",
    ) -> ModelCaches:
        """Separate contiguous zeroed tensors per layer (no cross-layer sharing)."""
        state = dict(num_blocks=num_blocks, block_size=block_size, device=device)
        attn = dict(
            state,
            kernel_block_size=kernel_block_size,
            num_kv_heads=config.num_kv_heads,
            head_size=config.head_size,
            layout=layout,
        )
        return cls(
            layers=tuple(
                StateCache.allocate(**state, shapes=config.state_shapes)
                if kind is STATE
                else AttentionCache.allocate(**attn)
                for kind in config.layer_kinds
            )
        )

    def check(self, config: ModelConfig) -> None:
        """Raise :class:`LayoutError` unless the views fit ``config`` layer by layer."""
        if len(self.layers) != config.num_layers:
            raise LayoutError(f"{len(self.layers)} layer caches for {config.num_layers} layers")
        kernel_sizes: dict[int, int] = {}
        for i, (kind, cache) in enumerate(zip(config.layer_kinds, self.layers, strict=True)):
            want = StateCache if kind is STATE else AttentionCache
            if not isinstance(cache, want):
                raise LayoutError(f"layer {i} ({kind.value}) needs a {want.__name__}")
            if isinstance(cache, StateCache):
                cache.check(config.state_shapes)
                continue
            cache.check(num_kv_heads=config.num_kv_heads, head_size=config.head_size)
            group = config.layer_group_ids[i]
            if kernel_sizes.setdefault(group, cache.kernel_block_size) != cache.kernel_block_size:
                raise LayoutError(
                    f"layer {i}: kernel_block_size={cache.kernel_block_size} differs from "
                    f"{kernel_sizes[group]} elsewhere in group {group}; one table serves a group"
                )


@dataclass(frozen=True, kw_only=True)
class LayerWeights:
    mixer_norm: torch.Tensor
    mixer: AttentionWeights | StateLayerWeights
    mlp_norm: torch.Tensor
    w_up: torch.Tensor  # [hidden, 2 * intermediate] (gate | up)
    w_down: torch.Tensor  # [intermediate, hidden]


def _to_device(obj, device: torch.device):
    """A copy of a (nested) weights dataclass with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    return type(obj)(**{f.name: _to_device(getattr(obj, f.name), device) for f in fields(obj)})


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class TinyModel:
    """Weights of one variant plus its paged forward and its dense reference."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = c = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)

        def randn(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

        def norm() -> torch.Tensor:
            return 1.0 + randn(c.hidden_size, std=0.1)

        h = c.hidden_size
        embed = randn(c.vocab_size, h, std=1.0)
        layers = []
        for kind in c.layer_kinds:
            mixer: AttentionWeights | StateLayerWeights
            if kind is STATE:
                dims = dict(d_inner=c.state_inner_size, d_state=c.state_size)
                mixer = StateLayerWeights.init(gen, hidden=h, conv_width=c.conv_width, **dims)
            else:
                heads = dict(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads)
                mixer = AttentionWeights.init(gen, hidden=h, head_size=c.head_size, **heads)
            mixer_norm, mlp_norm = norm(), norm()
            w_up = randn(h, 2 * c.intermediate_size, std=h**-0.5)
            w_down = randn(c.intermediate_size, h, std=c.intermediate_size**-0.5)
            layer = LayerWeights(
                mixer_norm=mixer_norm, mixer=mixer, mlp_norm=mlp_norm, w_up=w_up, w_down=w_down
            )
            layers.append(_to_device(layer, self.device))
        self.layers: list[LayerWeights] = layers
        self.embed = embed.to(self.device)
        self.final_norm = norm().to(self.device)
        self.lm_head = randn(c.vocab_size, h, std=2.0 * h**-0.5).to(self.device)

    @classmethod
    def from_name(cls, name: str, device: torch.device | str = "cpu") -> TinyModel:
        return cls(ModelConfig.from_name(name), device)

    def _qkv(self, w: AttentionWeights, h: torch.Tensor, positions: torch.Tensor):
        return w.qkv(
            h, positions, head_size=self.config.head_size, rope_theta=self.config.rope_theta
        )

    def _window(self, layer_id: int) -> int | None:
        kind = self.config.layer_kinds[layer_id]
        return self.config.sliding_window if kind is SLIDING else None

    def _run(self, token_ids: Sequence[int] | torch.Tensor, mixer) -> torch.Tensor:
        """Logits [T, vocab]; ``mixer(layer_id, normed_x)`` supplies attention/state output."""
        if isinstance(token_ids, torch.Tensor):  # np.asarray cannot read a CUDA tensor
            tokens = token_ids.to(self.device, torch.int64)
        else:
            tokens = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=self.device)
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            x = x + mixer(i, _rms_norm(x, layer.mixer_norm))
            gate, up = (_rms_norm(x, layer.mlp_norm) @ layer.w_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.w_down
        return _rms_norm(x, self.final_norm) @ self.lm_head.T

    @torch.inference_mode()
    def forward(self, batch: Sequence[SeqInput], caches: ModelCaches) -> list[torch.Tensor]:
        """Logits [T_i, vocab] of each request's new tokens, run against the paged caches.

        Writes the new tokens' K/V and states into ``caches`` in place.
        """
        caches.check(self.config)
        return [self._forward_one(seq, caches) for seq in batch]

    def _forward_one(self, seq: SeqInput, caches: ModelCaches) -> torch.Tensor:
        c = self.config
        if len(seq.block_tables) != len(c.group_kinds):
            raise LayoutError(
                f"{len(seq.block_tables)} block tables for {len(c.group_kinds)} KV-cache "
                f"groups {[k.value for k in c.group_kinds]}"
            )
        positions = torch.arange(seq.start_pos, seq.start_pos + seq.num_tokens, device=self.device)

        def mixer(i: int, h: torch.Tensor) -> torch.Tensor:
            w, cache = self.layers[i].mixer, caches.layers[i]
            table = seq.block_tables[c.layer_group_ids[i]]
            if isinstance(w, StateLayerWeights):
                assert isinstance(cache, StateCache)
                return state_layer.run_paged(
                    w,
                    cache,
                    h,
                    start_pos=seq.start_pos,
                    block_table=table,
                    snapshot=seq.state_snapshot,
                )
            assert isinstance(cache, AttentionCache)
            q, k, v = self._qkv(w, h, positions)
            out = paged_attention(
                q,
                k,
                v,
                cache=cache,
                block_table=table,
                positions=positions,
                scale=c.attn_scale,
                sliding_window=self._window(i),
            )
            return out.reshape(seq.num_tokens, -1) @ w.wo

        return self._run(seq.token_ids, mixer)

    @torch.inference_mode()
    def reference_logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of the whole sequence without any paging: the ground truth."""
        positions = torch.arange(len(token_ids), device=self.device)

        def mixer(i: int, h: torch.Tensor) -> torch.Tensor:
            w = self.layers[i].mixer
            if isinstance(w, StateLayerWeights):
                return state_layer.scan(w, h, w.zero_states())[0]
            q, k, v = self._qkv(w, h, positions)
            out = attend(
                q,
                k,
                v,
                q_positions=positions,
                k_positions=positions,
                scale=self.config.attn_scale,
                sliding_window=self._window(i),
            )
            return out.reshape(len(positions), -1) @ w.wo

        return self._run(token_ids, mixer)

    def greedy_generate_reference(
        self, prompt_ids: Sequence[int], max_tokens: int, *, eos_id: int | None = None
    ) -> list[int]:
        """Greedy continuation (new tokens only), stopping after ``eos_id`` if given."""
        ids, out = list(prompt_ids), []
        for _ in range(max_tokens):
            token = int(self.reference_logits(ids)[-1].argmax().cpu())
            ids.append(token)
            out.append(token)
            if token == eos_id:
                break
        return out
