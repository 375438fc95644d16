"""A naive reference of kvbridge's byte layouts, written from the design text alone.

A helper module for ``tests/layouts`` (imported by the tests; collects no tests itself).

Nothing here imports the code under test's index arithmetic: every byte offset is spelled
out with plain numpy broadcasting over ``(layer, block, token, part, head, dim)`` so that
tests can compare the real views and transforms against it.

Byte layout the reference encodes (one group, arrangement = c chunks x n sub-blocks of
``ts`` tokens, NHD ``[ts, H, D]`` or HND ``[H, ts, D]`` per part)::

    token t -> chunk = t // (n * ts), sub = (t // ts) % n, slot = t % ts
    cross-layer:   buf[b, first*PG + (((chunk*Lg + l)*n + sub)*P + p)*ts*H*D + inner]
    per layer, [K|V] rows:   layer[b, ((chunk*n + sub)*P + p)*ts*H*D + inner]
    per layer, kv split:     layer.flat[p*NB*PG/2 + b*PG/2 + (chunk*n + sub)*ts*H*D + inner]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Arr:
    """The reference's own arrangement: chunks x sub-blocks of ``sub_size`` tokens."""

    num_chunks: int
    sub_size: int
    layout: str  # "NHD" or "HND"


class NaiveLayout:
    """Byte offsets of attention elements in a side's buffers, from first principles."""

    @staticmethod
    def native(block_size: int, kernel_block_size: int, layout: str) -> Arr:
        return Arr(1, kernel_block_size, layout)

    @staticmethod
    def element_bytes(config, fmt, group_id: int, block_ids, arr: Arr):
        """``(tensor_index, byte_offset)`` arrays of shape ``(Lg, N, T, P, H, D)``: where the
        first byte of every element of the group's blocks lives."""
        group = config.groups[group_id]
        spec = group.spec
        names = list(config.layer_names)
        first = names.index(group.layer_names[0])
        lg, l_tot = group.num_layers, len(names)
        page, nb = config.page_size_bytes, config.num_blocks
        bs, heads, dim, isz = spec.block_size, spec.num_kv_heads, spec.head_size, spec.itemsize
        parts = spec.num_kv_parts
        ts = arr.sub_size
        n = bs // (arr.num_chunks * ts)
        assert n * arr.num_chunks * ts == bs

        ids = np.asarray(block_ids, dtype=np.int64)
        lay = np.arange(lg).reshape(-1, 1, 1, 1, 1, 1)
        blk = ids.reshape(1, -1, 1, 1, 1, 1)
        tok = np.arange(bs).reshape(1, 1, -1, 1, 1, 1)
        prt = np.arange(parts).reshape(1, 1, 1, -1, 1, 1)
        hd = np.arange(heads).reshape(1, 1, 1, 1, -1, 1)
        d = np.arange(dim).reshape(1, 1, 1, 1, 1, -1)
        chunk, sub, slot = tok // (n * ts), (tok // ts) % n, tok % ts
        if arr.layout == "NHD":
            inner = (slot * heads + hd) * dim + d
        else:
            inner = (hd * ts + slot) * dim + d
        sub_elems = ts * heads * dim
        if fmt.cross_layer:
            tensor = np.zeros_like(lay)
            elem = (((chunk * lg + lay) * n + sub) * parts + prt) * sub_elems + inner
            byte = blk * page * l_tot + first * page + elem * isz
        elif fmt.packing.value == "kv_split" and parts == 2:
            tensor = first + lay
            half = page // 2
            byte = prt * nb * half + blk * half + ((chunk * n + sub) * sub_elems + inner) * isz
        else:
            tensor = first + lay
            byte = blk * page + (((chunk * n + sub) * parts + prt) * sub_elems + inner) * isz
        shape = np.broadcast_shapes(lay.shape, blk.shape, tok.shape, prt.shape, hd.shape, d.shape)
        return np.broadcast_to(tensor, shape), np.broadcast_to(byte, shape)

    @staticmethod
    def byte_images(buffers) -> list[np.ndarray]:
        """Every tensor of the buffers as a flat uint8 numpy copy."""
        return [t.cpu().contiguous().view(-1).numpy().copy() for t in buffers.tensors]

    @classmethod
    def read(cls, buffers, group_id: int, block_ids, arr: Arr) -> np.ndarray:
        """Token-major ``(layer, token, part, head, dim)`` unsigned ints, read byte by byte."""
        images = cls.byte_images(buffers)
        spec = buffers.config.groups[group_id].spec
        isz = spec.itemsize
        tensor, byte = cls.element_bytes(buffers.config, buffers.format, group_id, block_ids, arr)
        out = np.zeros(byte.shape, dtype=np.uint64)
        for ti, image in enumerate(images):
            mask = tensor == ti
            for k in range(isz):  # little endian
                out[mask] |= image[byte[mask] + k].astype(np.uint64) << np.uint64(8 * k)
        lg, nb, bs = out.shape[:3]
        out = out.reshape(lg, nb * bs, *out.shape[3:])
        return out.astype(_UINT[isz])

    @classmethod
    def touched(cls, buffers, group_id: int, block_ids, arr: Arr) -> list[np.ndarray]:
        """Per tensor, a bool mask of the bytes the group's blocks occupy."""
        images = cls.byte_images(buffers)
        isz = buffers.config.groups[group_id].spec.itemsize
        tensor, byte = cls.element_bytes(buffers.config, buffers.format, group_id, block_ids, arr)
        masks = [np.zeros(im.size, dtype=bool) for im in images]
        for ti, mask in enumerate(masks):
            sel = byte[tensor == ti]
            for k in range(isz):
                mask[sel + k] = True
        return masks


def as_uint(t: torch.Tensor) -> np.ndarray:
    """Bits of any tensor as unsigned numpy ints of the same width."""
    int_of = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(int_of[t.element_size()]).numpy().view(_UINT[t.element_size()])


@st.composite
def attention_cases(draw, *, max_layers: int = 4, max_blocks: int = 6):
    """A random single-group attention side plus a random unique block id list."""
    from kvbridge.layouts.layout import KVLayout, KVPacking

    dtype = draw(st.sampled_from(DTYPES))
    mla = draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else False
    heads = 1 if mla else draw(st.integers(1, 4))
    head_size = draw(st.integers(1, 16))
    num_layers = draw(st.integers(1, max_layers))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    kernel = draw(st.sampled_from(divisors(block_size)))
    layout = draw(st.sampled_from([KVLayout.NHD, KVLayout.HND]))
    packing = draw(st.sampled_from([KVPacking.KV_SPLIT, KVPacking.BLOCKS_FIRST]))
    cross = draw(st.booleans())
    num_blocks = draw(st.integers(1, max_blocks))
    ids = draw(
        st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=num_blocks, unique=True)
    )
    return dict(
        dtype=dtype,
        mla=mla,
        heads=heads,
        head_size=head_size,
        num_layers=num_layers,
        block_size=block_size,
        kernel=kernel,
        layout=layout,
        packing=packing,
        cross=cross,
        num_blocks=num_blocks,
        block_ids=ids,
    )


def rewrite_case(
    cross: bool,
    block_size: int,
    kernel: int,
    packing,
    *,
    heads: int = 4,
    head_size: int = 64,
    num_blocks: int = 40,
) -> dict:
    """A bf16 3-layer NHD side for the rewrite strategy tests (``build_side``'s case)."""
    from kvbridge.layouts.layout import KVLayout

    return dict(
        dtype=torch.bfloat16,
        mla=False,
        heads=heads,
        head_size=head_size,
        num_layers=3,
        block_size=block_size,
        kernel=kernel,
        layout=KVLayout.NHD,
        packing=packing,
        cross=cross,
        num_blocks=num_blocks,
        block_ids=[],
    )


def build_side(case: dict, *, seed: int = 0):
    """KVCacheBuffers for an :func:`attention_cases` case, filled with random bytes."""
    from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
    from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
    from kvbridge.layouts.specs import FullAttentionSpec, MLASpec

    if case["mla"]:
        spec = MLASpec(
            block_size=case["block_size"], head_size=case["head_size"], dtype=case["dtype"]
        )
    else:
        spec = FullAttentionSpec(
            block_size=case["block_size"],
            num_kv_heads=case["heads"],
            head_size=case["head_size"],
            dtype=case["dtype"],
        )
    group = KVCacheGroup(
        group_id=0,
        layer_names=tuple(f"layer.{i}" for i in range(case["num_layers"])),
        spec=spec,
    )
    config = KVCacheConfig(groups=(group,), num_blocks=case["num_blocks"])
    fmt = CacheFormat(
        layout=case["layout"],
        kernel_block_size=case["kernel"],
        cross_layer=case["cross"],
        packing=case["packing"],
    )
    buffers = KVCacheBuffers(config, fmt)
    fill_random(buffers, seed)
    return buffers


def fill_random(buffers, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in buffers.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
