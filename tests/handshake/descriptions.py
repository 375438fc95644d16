"""A small valid WorkerDescription for handshake tests (shared, one place)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.handshake.messages import PROTOCOL_VERSION, WorkerDescription


def make_description(
    engine_id: str = "prefill-0", rank: int = 0, **overrides: Any
) -> WorkerDescription:
    description = WorkerDescription(
        protocol_version=PROTOCOL_VERSION,
        engine_id=engine_id,
        agent_name=f"{engine_id}-agent-{rank}",
        rank=rank,
        tp_size=1,
        model_name="tiny",
        dtype="float16",
        num_layers=2,
        num_kv_heads=2,
        head_size=64,
        compat_hash="abc",
        block_size=16,
        kernel_block_size=16,
        kv_layout="NHD",
        kv_packing="kv_split",
        cross_layer=False,
        groups=[],
        regions=[],
        nixl_metadata=f"md-{engine_id}-{rank}".encode(),
    )
    return msgspec.structs.replace(description, **overrides) if overrides else description
