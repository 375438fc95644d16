"""KV-cache specs: what one layer keeps per block, and how many bytes that takes.

Four kinds, after vLLM's ``kv_cache_interface``:

- full attention: K and V for every token of the block;
- sliding window: the same page, but only the last ``sliding_window`` tokens are needed;
- MLA: one latent vector per token (no K/V split, one "head");
- state (Mamba-like): a few fixed-size state tensors per request, independent of tokens.

Specs are frozen and keyword-only; sizes are derived, never stored twice.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from kvbridge.layouts.errors import LayoutError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.float16`` -> ``"float16"``)."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise LayoutError(f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire name; raises :class:`LayoutError` naming the choices."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise LayoutError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


class KVCacheKind(enum.Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    STATE = "state"


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise LayoutError(f"{owner}: {name}={value!r} must be a positive integer")


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """K and V of ``block_size`` tokens x ``num_kv_heads`` heads x ``head_size`` per block.

    ``kv_interleaved``: K and V of one (head, token) sit side by side, ``[K | V]`` along
    the innermost axis (the logical "content" axis ``C = head_size_k + head_size_v`` of
    vLLM 0.32's tensors). The block then has one part whose rows are ``2 * head_size``
    wide instead of two parts. vLLM's CPU kernels store such blocks in their own element
    order; that is ``CacheFormat.block_packing``, not this flag.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_interleaved: bool = False

    kind = KVCacheKind.FULL_ATTENTION

    def __post_init__(self) -> None:
        _positive(
            type(self).__name__,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
        )
        dtype_name(self.dtype)

    @property
    def num_kv_parts(self) -> int:
        """2 for separate K and V, 1 for a single latent (MLA) or interleaved K|V."""
        return 1 if self.kv_interleaved else 2

    @property
    def part_head_size(self) -> int:
        """Elements per (head, token) in one part: ``head_size``, doubled when interleaved."""
        return 2 * self.head_size if self.kv_interleaved else self.head_size

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token across heads in one part (K, V, or interleaved K|V)."""
        return self.num_kv_heads * self.part_head_size * self.itemsize

    @property
    def page_size_bytes(self) -> int:
        return self.num_kv_parts * self.block_size * self.token_bytes

    def with_block_size(self, block_size: int) -> AttentionSpec:
        from dataclasses import replace

        return replace(self, block_size=block_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    kind = KVCacheKind.FULL_ATTENTION


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens only: a token sees itself and
    the ``sliding_window - 1`` tokens before it."""

    sliding_window: int
    kind = KVCacheKind.SLIDING_WINDOW

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("SlidingWindowSpec", sliding_window=self.sliding_window)

    def window_start(self, num_tokens: int) -> int:
        """The first token whose KV the token after ``num_tokens`` computed ones reads:
        every earlier token is out of its window. vLLM's rule
        (``SlidingWindowManager.get_num_skipped_tokens``)::

            window 4, 7 tokens computed:  0 1 2 3 [4 5 6] 7   -> window_start(7) == 4
        """
        return max(0, num_tokens - self.sliding_window + 1)


@dataclass(frozen=True, kw_only=True)
class MLASpec(AttentionSpec):
    """One latent of ``head_size`` per token; ``num_kv_heads`` must be 1."""

    num_kv_heads: int = 1
    kind = KVCacheKind.MLA

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads != 1:
            raise LayoutError(f"MLASpec: num_kv_heads={self.num_kv_heads} must be 1")
        if self.kv_interleaved:
            raise LayoutError("MLASpec: a latent cache has no K and V to interleave")

    @property
    def num_kv_parts(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True)
class StateSharding:
    """How an engine shards one state tensor over its tensor-parallel ranks.

    ``dim``: the dimension of the (per-rank) shape that is split over the ranks, rank
    ``r`` of ``tp`` holding the ``r``-th of ``tp`` equal parts; None: the tensor is
    replicated, whole on every rank. ``sections``: the per-rank sizes of sections
    concatenated along ``dim`` that are each split on their own (empty: one section).
    vLLM's Mamba2 conv state concatenates x, B and C along its channel dimension::

        global   [ x: I | B: G*N | C: G*N ]           (conv_dim = I + 2*G*N channels)
        rank r   [ x_r: I/tp | B_r: G*N/tp | C_r: G*N/tp ]  sections (I/tp, G*N/tp, G*N/tp)
    """

    dim: int | None
    sections: tuple[int, ...] = ()

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def section_sizes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The per-rank sections along ``dim`` of a tensor of per-rank ``shape``."""
        assert self.dim is not None
        return self.sections or (shape[self.dim],)

    def check(self, shape: tuple[int, ...], index: int) -> None:
        """Raise :class:`LayoutError` unless this describes a tensor of per-rank ``shape``
        (state tensor ``index``)."""
        if self.dim is None:
            if self.sections:
                raise LayoutError(
                    f"StateSpec: state {index} is replicated (dim None) but has sections "
                    f"{self.sections}; sections only split a sharded dimension"
                )
            return
        if not isinstance(self.dim, int) or not 0 <= self.dim < len(shape):
            raise LayoutError(
                f"StateSpec: state {index} is sharded on dim={self.dim!r}, not a dimension "
                f"of its shape {shape} (0..{len(shape) - 1}, or None for replicated)"
            )
        if any(not isinstance(s, int) or s <= 0 for s in self.sections):
            raise LayoutError(
                f"StateSpec: state {index} sections {self.sections} must be positive integers"
            )
        if self.sections and sum(self.sections) != shape[self.dim]:
            raise LayoutError(
                f"StateSpec: state {index} sections {self.sections} add up to "
                f"{sum(self.sections)}, but its dim {self.dim} holds {shape[self.dim]}"
            )


@dataclass(frozen=True, kw_only=True)
class StateSpec:
    """Fixed-size recurrent state per request (e.g. Mamba conv + ssm states).

    ``block_size`` is the token granularity at which states are kept (a state block holds
    the state after the block's last token). ``page_size_padded`` pads the page up so
    that state layers can share one page size with attention layers. ``shapes`` are one
    rank's; ``sharding`` (one :class:`StateSharding` per state tensor) says how the
    engine splits them over tensor-parallel ranks, None when it does not say (such a
    state moves only between equal TP sizes).
    """

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = field(default=None)
    sharding: tuple[StateSharding, ...] | None = None

    kind = KVCacheKind.STATE

    def __post_init__(self) -> None:
        _positive("StateSpec", block_size=self.block_size)
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise LayoutError(
                f"StateSpec: need one dtype per state shape, got {len(self.shapes)} shapes "
                f"and {len(self.dtypes)} dtypes"
            )
        for shape in self.shapes:
            if not shape or any((not isinstance(d, int)) or d <= 0 for d in shape):
                raise LayoutError(f"StateSpec: state shape {shape} must be positive integers")
        for dtype in self.dtypes:
            dtype_name(dtype)
        if self.sharding is not None:
            if len(self.sharding) != len(self.shapes):
                raise LayoutError(
                    f"StateSpec: sharding describes {len(self.sharding)} state tensors, the "
                    f"spec has {len(self.shapes)} shapes; give one StateSharding per shape"
                )
            for i, (how, shape) in enumerate(zip(self.sharding, self.shapes, strict=True)):
                how.check(shape, i)
        if self.page_size_padded is not None and self.page_size_padded < self.state_bytes:
            raise LayoutError(
                f"StateSpec: page_size_padded={self.page_size_padded} is smaller than the "
                f"{self.state_bytes} bytes the states need"
            )

    @property
    def state_nbytes(self) -> tuple[int, ...]:
        return tuple(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def state_offsets(self) -> tuple[int, ...]:
        """Byte offset of each state in a page: back to back, each aligned to its dtype."""
        offsets, end = [], 0
        for nbytes, dtype in zip(self.state_nbytes, self.dtypes, strict=True):
            end += -end % dtype.itemsize
            offsets.append(end)
            end += nbytes
        return tuple(offsets)

    @property
    def state_bytes(self) -> int:
        """Bytes the states really use (what must cross the wire), alignment gaps included."""
        return self.state_offsets[-1] + self.state_nbytes[-1]

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.state_bytes

    def with_block_size(self, block_size: int) -> StateSpec:
        from dataclasses import replace

        return replace(self, block_size=block_size)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec | StateSpec
