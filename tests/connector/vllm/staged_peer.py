"""A vLLM worker's connector staging its cache through host memory, as tests see it (not
a test).

``kv_buffer_device: "cpu"`` with a GPU cache stages through a host mirror; here the
cache is in host memory, so the stage is forced (``host_staging=True``, the path a CUDA
cache takes minus the device). The cache is either what vLLM's own allocation code
builds (``kvbridge.examples.vllm.allocation``: per-layer ``[kernel blocks, H, N, C]`` views,
which vLLM's copy operation indexes correctly) or, with ``split=True``, per-layer
``[2, blocks, H, N, D]`` tensors (K and V apart), whose dim 0 vLLM's operation would
index wrongly: kvbridge's copies must serve those. vLLM's operation is recorded
(:class:`~tests.connector.vllm.vllm_copy_ops.RecordingCopyOp`) either way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from vllm.config.kv_transfer import KVTransferConfig as VLLMTransferConfig

from kvbridge.connector.vllm import translate
from kvbridge.connector.vllm.worker_side import VLLMWorkerSide
from kvbridge.examples.vllm.allocation import Allocation
from kvbridge.examples.vllm.layout_peer import SideSpec, build_allocation, fill
from tests.connector.vllm.vllm_copy_ops import RecordingCopyOp, vllm_copy_kv_blocks
from tests.verified_loads import is_decode, verifying

TOTAL_HEADS = 4  # SideSpec's default; TP 1 here


@dataclass(frozen=True)
class StagedSpec:
    """One staged side: vLLM's allocation for ``side``, or K|V-split tensors instead."""

    side: SideSpec
    split: bool = False

    def to_dict(self) -> dict:
        return {"side": asdict(self.side), "split": self.split}

    @classmethod
    def from_dict(cls, data: dict) -> StagedSpec:
        return cls(SideSpec(**data["side"]), data["split"])

    def label(self) -> str:
        return self.side.label() + ("-kvsplit" if self.split else "")


@dataclass
class StagedCache:
    """The tensors ``register_kv_caches`` gets, with vLLM's config for them."""

    spec: StagedSpec
    allocation: Allocation
    kv_caches: dict[str, torch.Tensor]

    def tokens(self, block_ids: np.ndarray) -> torch.Tensor:
        """``(layers, tokens, H, K|V)`` of manager blocks ``block_ids`` as integers."""
        out = []
        for t in self.kv_caches.values():
            r = t.shape[1 if self.spec.split else 0] // self.spec.side.num_blocks
            ids = (torch.as_tensor(block_ids)[:, None] * r + torch.arange(r)).reshape(-1)
            if self.spec.split:  # [2, kernel blocks, H, kb, D] -> [kb blocks, H, kb, 2D]
                k, v = t[0].index_select(0, ids), t[1].index_select(0, ids)
                blocks = torch.cat([k, v], dim=-1)
            else:  # vLLM's view: [kernel blocks, H, kb, C]
                blocks = t.index_select(0, ids)
            ints = blocks.contiguous().view(torch.int16)
            out.append(ints.permute(0, 2, 1, 3).reshape(-1, ints.shape[1], ints.shape[3]))
        return torch.stack(out)


def staged_cache(spec: StagedSpec, seed: int) -> StagedCache:
    """The side's cache filled with seeded bytes (the same seed: the same bytes)."""
    a = build_allocation(spec.side)
    fill(a, seed)
    if not spec.split:
        return StagedCache(spec, a, dict(a.kv_caches))
    gen = torch.Generator().manual_seed(seed)
    caches = {}
    for name, view in a.kv_caches.items():
        kb, width = view.shape[2], view.shape[3]
        shape = (2, view.shape[0], view.shape[1], kb, width // 2)
        data = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen)
        caches[name] = data.view(view.dtype)
    return StagedCache(spec, a, caches)


def staged_side(
    cache: StagedCache,
    role: str,
    engine_id: str,
    mode: str,
    *,
    host_staging: bool | None = True,
    hand_op: bool = True,
) -> tuple[VLLMWorkerSide, RecordingCopyOp]:
    """The adapter's worker side over ``cache``, staged through host memory (None: as
    ``kv_buffer_device`` says), given vLLM's copy operation (recorded) as vLLM's model
    runner gives it: after registration (``hand_op=False``: the test hands it over). A
    decode verifies every load (``tests/verified_loads.py``)."""
    extra = {"kv_ip": "127.0.0.1", "handshake_timeout_s": 5.0, "extra": {"transfer_mode": mode}}
    if is_decode(role):
        extra = verifying(extra)
    vllm_config = VLLMTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_port=0,
        kv_buffer_device="cpu",
        kv_connector_extra_config=extra,
    )
    layout, _ = translate.kv_layout(cache.allocation.kv_cache_config)
    side = VLLMWorkerSide(
        translate.transfer_config(vllm_config),
        translate.kv_cache_config(cache.allocation.kv_cache_config),
        model_name="tiny",
        total_kv_heads=TOTAL_HEADS,
        layout_hint=None if cache.spec.split else layout,
        rank=0,
        tp_size=1,
        cpu_attention=False,
        host_staging=host_staging,
    )
    side.register_kv_caches(cache.kv_caches)
    op = RecordingCopyOp(vllm_copy_kv_blocks())
    if hand_op:
        side.set_host_xfer_buffer_ops(op)
    return side, op
