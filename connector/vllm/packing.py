"""vLLM's CPU attention pages: their element order, and repacking smaller pages into them.

vLLM's CPU attention hands connectors ``[blocks, H, block_size, 2 * head_size]`` tensors,
but its kernel ``cpu_attn_reshape_and_cache`` stores each block in an order chosen per
instruction set (on x86 without AMX: per head, K transposed ``[head_size, block_size]``,
then V ``[block_size, head_size]``). A page therefore cannot be cut into token chunks by
byte ranges. kvbridge moves such pages whole; a decode block ``r`` times larger than
prefill's receives ``r`` prefill pages side by side, and :class:`CpuAttnRepacker` turns
them into one page of its own (``merge``): it reads the small pages through their element
map and writes K and V back with vLLM's own kernel. A prefill block ``r`` times larger
lands whole in a staging slot, and ``split`` writes the tokens decode loads from it into
decode's blocks the same way. When decode's heads come from several prefill ranks (prefill
TP larger), each rank's staged pages hold only its heads; ``split`` then writes just those
heads of each token, through the element map (the kernel writes every head of a token).

The element map is measured, not assumed: :func:`page_map` runs the kernel on a scratch
block whose values encode each element's index.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

import numpy as np
import torch

from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.groups import KVCacheConfig

_DIGIT_BASE = 64  # small integers are exact in every float dtype the kernel accepts
# vLLM keeps every fp8 cache format in uint8 pages; the map is probed through e4m3, where
# the integers 1..16 are exact (scale 1.0), with K and V in the model's dtype (``source``):
# that dtype picks the kernel's instruction set, and with it the page's order (a bf16
# model on AMX orders an fp8 page as its bf16 pages, not as float32's "vec" path)
_FP8_DIGIT_BASE = 16
_FP8_PROBE = "fp8_e4m3"


def _isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


def _kernel_write(
    key_cache_of: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    kv_cache_dtype: str = "auto",
) -> None:
    """``cpu_attn_reshape_and_cache`` on one layer's ``[blocks, H, B, 2D]`` tensor (K and
    V in ``key``'s dtype; ``kv_cache_dtype``: the cache's fp8 format, if any)."""
    import vllm._custom_ops as ops

    nb, heads, block_size, width = key_cache_of.shape
    d = width // 2
    key_cache, value_cache = key_cache_of.view(nb, heads, 2 * block_size, d).chunk(2, dim=2)
    isa = _isa(key.dtype, block_size, d, kv_cache_dtype)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slots, isa, kv_cache_dtype=kv_cache_dtype
    )


def _write(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    source: torch.dtype | None = None,
) -> None:
    """K and V (``[tokens, H, D]``, the cache's dtype) of tokens ``slots`` into their
    places in one layer ``[blocks, H, B, 2D]``: vLLM's kernel for float pages; for fp8
    (uint8) pages, whose elements are already quantized, the bytes go where the element
    map says (requantizing would need the scale and could change them)."""
    if cache.dtype != torch.uint8:
        _kernel_write(cache, key, value, slots)
        return
    _, heads, block_size, width = cache.shape
    dst = page_map(cache.dtype, block_size, heads, width // 2, source)  # [2, B, H, D]
    by_token = torch.from_numpy(np.ascontiguousarray(dst.transpose(1, 0, 2, 3)))
    page_elems = heads * block_size * width
    where = (slots // block_size).view(-1, 1, 1, 1) * page_elems + by_token[slots % block_size]
    cache.view(-1)[where.reshape(-1)] = torch.stack([key, value], dim=1).reshape(-1)


@lru_cache(maxsize=32)
def page_map(
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    head_size: int,
    source: torch.dtype | None = None,
) -> np.ndarray:
    """Element offset inside one page of every ``(K/V, token, head, dim)`` element.

    Runs vLLM's kernel a few times on a scratch page whose values are the base-64 digits
    of each element's index (exact in fp32, fp16 and bf16), then inverts what it wrote. A
    uint8 page is an fp8 cache: base-16 digits, written from ``source`` (the model's
    dtype, which must be given) and read as e4m3.
    """
    fp8 = dtype == torch.uint8
    if fp8 and source is None:
        raise KVBridgeError(
            "an fp8 (uint8) CPU attention page's order depends on the model's dtype; none was given"
        )
    base = _FP8_DIGIT_BASE if fp8 else _DIGIT_BASE
    source = source if fp8 else dtype
    n = 2 * block_size * num_heads * head_size
    index = torch.arange(n, dtype=torch.int64).view(2, block_size, num_heads, head_size)
    found = torch.zeros(n, dtype=torch.int64)
    page = torch.zeros(1, num_heads, block_size, 2 * head_size, dtype=dtype)
    slots = torch.arange(block_size, dtype=torch.int64)
    scale, passes = 1, 0
    while scale < n:
        digit = (index // scale) % base + 1  # 0 marks an element never written
        page.zero_()
        k, v = digit[0].to(source), digit[1].to(source)
        _kernel_write(page, k, v, slots, _FP8_PROBE if fp8 else "auto")
        written = page.view(torch.float8_e4m3fn) if fp8 else page
        got = written.reshape(-1).to(torch.float64).round().to(torch.int64)
        if got.min() < 1 or got.max() > base:
            raise KVBridgeError(
                f"vLLM's CPU attention kernel left elements unwritten or changed values in a "
                f"{block_size}-token {dtype} page; kvbridge cannot map its element order"
            )
        found += (got - 1) * scale
        scale *= base
        passes += 1
    offsets = np.empty(n, dtype=np.int64)
    offsets[found.numpy()] = np.arange(n)
    if not np.array_equal(np.sort(found.numpy()), np.arange(n)):
        raise KVBridgeError(
            f"vLLM's CPU attention page order for {block_size}-token {dtype} blocks is not a "
            f"permutation ({passes} probes); kvbridge cannot map it"
        )
    return offsets.reshape(2, block_size, num_heads, head_size)


class CpuAttnRepacker:
    """Rebuilds vLLM CPU attention pages from whole remote pages, layer by layer
    (:class:`kvbridge.connector.worker.staging.staged_reads.Repacker`)."""

    def __init__(
        self,
        kv_config: KVCacheConfig,
        tensors: Mapping[str, torch.Tensor],
        source: torch.dtype | None = None,
    ) -> None:
        """``source``: the model's dtype (what vLLM writes K and V from; needed for fp8
        caches, whose page order it decides)."""
        self._layers = {g.group_id: g.layer_names for g in kv_config.groups}
        self._tensors = dict(tensors)
        self._source = source

    def merge(self, group_id: int, block_ids: np.ndarray, remote_block_size: int) -> None:
        ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64))
        for name in self._layers[group_id]:
            repack_layer(self._tensors[name], ids, remote_block_size, self._source)

    def split(
        self,
        group_id: int,
        pages: Sequence[torch.Tensor],
        remote_block_size: int,
        slots: np.ndarray,
        heads: tuple[int, int] | None = None,
        layers: Sequence[str] = (),
    ) -> None:
        names = tuple(layers) or self._layers[group_id]
        if len(pages) != len(names):
            raise KVBridgeError(
                f"group {group_id}: {len(pages)} layers of pages for {len(names)} layers"
            )
        flat = np.asarray(slots, dtype=np.int64).reshape(-1)
        keep = torch.from_numpy(flat >= 0)
        where = torch.from_numpy(flat[flat >= 0])
        for name, layer_pages in zip(names, pages, strict=True):
            cache = self._tensors[name]
            if heads is None or heads == (0, cache.shape[1]):
                split_layer(cache, layer_pages, remote_block_size, keep, where, self._source)
            else:
                split_heads_layer(
                    cache, layer_pages, remote_block_size, keep, where, heads, self._source
                )


def repack_layer(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    remote_block_size: int,
    source: torch.dtype | None = None,
) -> None:
    """Blocks ``block_ids`` of one layer ``[blocks, H, B, 2D]`` each hold ``B / b`` pages
    of ``b = remote_block_size`` tokens side by side; rewrite them as ``B``-token pages."""
    _, heads, block_size, width = cache.shape
    d, b = width // 2, remote_block_size
    if block_size % b:
        raise KVBridgeError(f"{block_size}-token blocks cannot hold {b}-token pages")
    r, n = block_size // b, int(block_ids.numel())
    if n == 0:
        return
    offsets = torch.from_numpy(page_map(cache.dtype, b, heads, d, source).reshape(-1))
    pages = cache.index_select(0, block_ids).reshape(n, r, -1)
    canonical = pages[:, :, offsets].reshape(n, r, 2, b, heads, d)
    key = canonical[:, :, 0].reshape(n * block_size, heads, d).contiguous()
    value = canonical[:, :, 1].reshape(n * block_size, heads, d).contiguous()
    slots = (block_ids.view(-1, 1) * block_size + torch.arange(block_size)).reshape(-1)
    _write(cache, key, value, slots, source)


def _canonical(
    pages: torch.Tensor,
    dtype: torch.dtype,
    block_size: int,
    heads: int,
    head_size: int,
    source: torch.dtype | None = None,
) -> torch.Tensor:
    """``n`` pages of ``block_size`` tokens and ``heads`` heads in the kernel's order
    (uint8 ``[n, page_bytes]``) as ``[n, K/V, token, head, dim]`` elements."""
    n, b = pages.shape[0], block_size
    expected = 2 * b * heads * head_size * dtype.itemsize
    if pages.shape[1] != expected:
        raise KVBridgeError(
            f"{b}-token pages of {pages.shape[1]} B do not match this layer ({expected} B)"
        )
    offsets = torch.from_numpy(page_map(dtype, b, heads, head_size, source).reshape(-1))
    elems = pages.contiguous().view(dtype).reshape(n, -1)
    return elems[:, offsets].reshape(n, 2, b, heads, head_size)


def split_layer(
    cache: torch.Tensor,
    pages: torch.Tensor,
    remote_block_size: int,
    keep: torch.Tensor,
    slots: torch.Tensor,
    source: torch.dtype | None = None,
) -> None:
    """Write tokens of ``n`` larger pages (uint8 ``[n, page_bytes]``, ``b`` tokens each)
    into one layer ``[blocks, H, B, 2D]``: token ``i`` of the flattened ``[n * b]`` goes to
    the next entry of ``slots`` where ``keep[i]``."""
    _, heads, _, width = cache.shape
    d, b, n = width // 2, remote_block_size, pages.shape[0]
    if n == 0 or slots.numel() == 0:
        return
    canonical = _canonical(pages, cache.dtype, b, heads, d, source)
    key = canonical[:, 0].reshape(n * b, heads, d)[keep].contiguous()
    value = canonical[:, 1].reshape(n * b, heads, d)[keep].contiguous()
    _write(cache, key, value, slots, source)


def split_heads_layer(
    cache: torch.Tensor,
    pages: torch.Tensor,
    remote_block_size: int,
    keep: torch.Tensor,
    slots: torch.Tensor,
    heads: tuple[int, int],
    source: torch.dtype | None = None,
) -> None:
    """:func:`split_layer` for pages that hold only heads ``first .. first + count - 1``
    of this layer's ``H``: those heads of each kept token go to their place in its slot's
    page (the element map of an ``H``-head page), the other heads stay as they are."""
    _, num_heads, block_size, width = cache.shape
    first, count = heads
    d, b, n = width // 2, remote_block_size, pages.shape[0]
    if not (0 <= first and count > 0 and first + count <= num_heads):
        raise KVBridgeError(f"heads {first}..{first + count - 1} are not among {num_heads}")
    if n == 0 or slots.numel() == 0:
        return
    if not cache.is_contiguous():
        raise KVBridgeError("a layer's CPU attention cache must be one contiguous tensor")
    canonical = _canonical(pages, cache.dtype, b, count, d, source)  # [n, 2, b, count, D]
    values = canonical.transpose(1, 2).reshape(n * b, 2, count, d)
    dst = page_map(cache.dtype, block_size, num_heads, d, source)[:, :, first : first + count]
    by_token = torch.from_numpy(np.ascontiguousarray(dst.transpose(1, 0, 2, 3)))  # [B, 2, c, D]
    page_elems = num_heads * block_size * width
    where = (slots // block_size).view(-1, 1, 1, 1) * page_elems + by_token[slots % block_size]
    cache.view(-1)[where.reshape(-1)] = values[keep].reshape(-1)
