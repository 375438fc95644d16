"""One vLLM GPU worker's connector, as a benchmark or a test sees it.

:class:`Side` is what a vLLM worker process holds: the cache vLLM's own allocation code
built (``allocation``), filled with seeded bytes, and the adapter's
:class:`VLLMWorkerSide` that ``register_kv_caches`` gave those tensors. The prefill side
runs in its own OS process (``prefill_child.py``), the decode side in the caller's; the
caller rebuilds prefill's bytes from the seed to know what decode must receive.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import torch
from vllm.config.kv_transfer import KVTransferConfig as VLLMTransferConfig

from kvbridge.connector.common.metadata import ConnectorMetadata
from kvbridge.connector.vllm import translate
from kvbridge.connector.vllm.step_metadata import KVBridgeMetadata
from kvbridge.connector.vllm.worker_side import VLLMWorkerSide
from kvbridge.examples.vllm.allocation import Allocation, KVCacheLayout, Model, allocate
from kvbridge.handshake.tp import rank_heads

NUM_BLOCKS = 12
TOTAL_HEADS = 4


@dataclass(frozen=True)
class SideSpec:
    """One side of a pair: vLLM backend, the layout it resolved, block size, TP."""

    backend: str
    layout: str
    block_size: int
    tp_size: int = 1
    rank: int = 0
    mla: bool = False
    dtype: str = "float16"
    head_size: int = 16
    num_layers: int = 3
    num_blocks: int = NUM_BLOCKS
    total_heads: int = TOTAL_HEADS
    mamba_layers: int = 0  # Mamba2 state layers after the attention layers (group 1)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def label(self) -> str:
        mamba = f"-mamba{self.mamba_layers}" if self.mamba_layers else ""
        return f"{self.backend}-{self.layout}-b{self.block_size}-tp{self.tp_size}{mamba}"


def build_allocation(spec: SideSpec) -> Allocation:
    heads = 1 if spec.mla else rank_heads(spec.rank, spec.tp_size, spec.total_heads).count
    model = Model(
        num_layers=spec.num_layers,
        num_kv_heads=heads,
        mla=spec.mla,
        dtype=getattr(torch, spec.dtype),
        head_size=spec.head_size,
        mamba_layers=spec.mamba_layers,
    )
    return allocate(
        model,
        block_size=spec.block_size,
        layout=KVCacheLayout[spec.layout],
        backend_name=spec.backend,
        num_blocks=spec.num_blocks,
    )


def fill(a: Allocation, seed: int) -> None:
    """Seeded random bytes over vLLM's whole backing buffer."""
    raw = next(iter(a.kv_caches.values())).untyped_storage()
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (raw.nbytes(),), dtype=torch.uint8, generator=gen)
    torch.empty(0, dtype=torch.uint8).set_(raw).copy_(data)


def worker_side(spec: SideSpec, a: Allocation, role: str, engine_id: str, mode: str):
    """The adapter's worker side, as ``KVBridgeConnector.__init__`` builds it; a decode
    verifies every load (``extra.verify: "all"``: prefill's digests of every row it moves),
    as the test suite's decodes do (``tests/verified_loads.py``)."""
    extra = {"transfer_mode": mode}
    if role != "kv_producer":  # a decode: it loads, so it reads extra.verify
        extra["verify"] = "all"
    vcfg = VLLMTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_port=0,
        kv_connector_extra_config={
            "kv_ip": "127.0.0.1",
            "handshake_timeout_s": 5.0,
            "extra": extra,
        },
    )
    layout, _ = translate.kv_layout(a.kv_cache_config)
    side = VLLMWorkerSide(
        translate.transfer_config(vcfg),
        translate.kv_cache_config(a.kv_cache_config),
        model_name="tiny",
        total_kv_heads=1 if spec.mla else spec.total_heads,
        layout_hint=layout,
        rank=spec.rank,
        tp_size=spec.tp_size,
        cpu_attention=False,  # a GPU backend's tensors, in CPU memory
    )
    side.register_kv_caches(a.kv_caches)
    return side


def bind(side: VLLMWorkerSide, meta: ConnectorMetadata) -> None:
    side.bind(KVBridgeMetadata(meta))
    side.start_load_kv()
    side.wait_for_save()


def tokens(a: Allocation, block_ids: np.ndarray) -> torch.Tensor:
    """``(layers, tokens, H, C)`` of ``block_ids`` through vLLM's own per-layer views, as
    integers (kernel blocks ``b * r .. b * r + r - 1`` make manager block ``b``)."""
    out = []
    group = a.kv_cache_config.kv_cache_groups[0]
    for name in group.layer_names:
        view = a.kv_caches[name]  # [kernel blocks, H, kb, C]
        r = group.kv_cache_spec.block_size // view.shape[2]
        kernel_ids = (torch.as_tensor(block_ids)[:, None] * r + torch.arange(r)).reshape(-1)
        blocks = view.index_select(0, kernel_ids)
        ints = blocks.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[view.element_size()])
        out.append(ints.permute(0, 2, 1, 3).reshape(-1, view.shape[1], view.shape[3]))
    return torch.stack(out)


def states(a: Allocation, block_id: int) -> list[torch.Tensor]:
    """Every state (conv, SSM) of every Mamba layer in block ``block_id``, as bytes, through
    vLLM's own ``MambaBase.bind_kv_cache`` views of the tensors ``register_kv_caches`` got."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.abstract import MambaBase

    out = []
    for group in a.kv_cache_config.kv_cache_groups[1:]:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            layer = SimpleNamespace(
                get_state_shape=lambda s=spec: s.shapes, get_state_dtype=lambda s=spec: s.dtypes
            )
            MambaBase.bind_kv_cache(layer, a.kv_caches[name])
            out += [state[block_id].contiguous().view(torch.uint8) for state in layer.kv_cache]
    return out
