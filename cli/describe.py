"""``kvbridge describe``: the description a worker built from the example server's
arguments publishes, computed offline.

What a running worker computes when it registers its cache (the model's buffers, the
host mirror NIXL would move instead, the gather arena, the role and transfer mode), with
nothing a second process could notice::

    no NIXL agent       ``agent_name`` and ``nixl_metadata`` are empty
    no listener         ``side_channel_host``/``port`` are what the config says it
                        would bind (``kv_ip``, ``kv_port``); nothing is bound
    no scheduler        no secret check, no warning about a missing secret

so it runs beside a worker of the same configuration. Region addresses are this
process's, which a plan never reads (``tests/cli/test_describe.py`` holds it equal to a
live worker's description but for those fields).
"""

from __future__ import annotations

import argparse

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.worker.prefill.gather_arena import PAGE_BYTES
from kvbridge.connector.worker.staging.arenas import slot_region
from kvbridge.connector.worker.staging.host_stage import host_stage_for
from kvbridge.examples.runner import ModelRunner, RunnerConfig
from kvbridge.examples.worker_setup import transfer_config
from kvbridge.handshake.compat import compat_hash
from kvbridge.handshake.description import WorkerIdentity, describe
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.region import KVRegion, MemoryKind
from kvbridge.layouts.specs import dtype_name


class DescribeError(KVBridgeError):
    """Arguments that describe no connector (role ``both`` without a kv-transfer-config)."""


def offline_description(args: argparse.Namespace) -> WorkerDescription:
    """The description the example server started with ``args`` would publish (as
    :class:`~kvbridge.connector.worker.worker.KVBridgeWorker` builds it, rank 0 of 1,
    no repacker), built without binding, NIXL or a scheduler."""
    runner_config = RunnerConfig.from_args(args)
    config = transfer_config(args, runner_config.device)
    if config is None:
        raise DescribeError(
            "--role both without --kv-transfer-config runs no connector, so there is "
            "nothing to describe: pass the role (kvbridge describe prefill|decode ...)"
        )
    runner = ModelRunner(runner_config)
    mc = runner.model_config
    buffers = runner.buffers
    stage = host_stage_for(config.kv_buffer_device, buffers, ConnectorMetrics())
    moved = stage.host_buffers if stage is not None else buffers
    identity = WorkerIdentity(
        engine_id=config.engine_id,
        agent_name="",
        model_name=mc.name,
        dtype=dtype_name(mc.dtype),
        num_layers=buffers.config.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_size=mc.head_size,
    )
    extra = config.extra
    rewrites_in_place = True  # the example engine never runs a request on a held block
    return describe(
        identity,
        moved,
        nixl_metadata=b"",
        compat_hash=compat_hash(identity, moved.config),
        side_channel_host=config.kv_ip,
        side_channel_port=config.kv_port,
        rewrites_in_place=rewrites_in_place,
        transfer_mode=extra.transfer_mode,
        rewrites_on_save=extra.rewrite_on_save and rewrites_in_place,
        gather=_gather_pages(config, moved),
        kv_role=config.kv_role.value,
    )


def _gather_pages(config: KVTransferConfig, moved: KVCacheBuffers) -> KVRegion | None:
    """The gather arena's pages as the worker advertises them (``extra.gather_mib``:
    whole pages of ``PAGE_BYTES``, where NIXL moves the cache), at address 0."""
    if not config.extra.gather_bytes:
        return None
    pages = config.extra.gather_bytes // PAGE_BYTES
    if pages < 1:  # as the worker's open_arena refuses it
        raise KVBridgeError(
            f"extra.gather_mib: {config.extra.gather_bytes} B is less than one {PAGE_BYTES} B page"
        )
    arena = KVRegion(
        name="staging",
        base_addr=0,
        block_bytes=pages * PAGE_BYTES,
        block_stride_bytes=pages * PAGE_BYTES,
        num_blocks=1,
        memory_kind=MemoryKind.VRAM if moved.device.type == "cuda" else MemoryKind.DRAM,
        device_id=moved.device.index or 0,
    )
    return slot_region(arena, PAGE_BYTES)
