"""vLLM's worker-side connector calls, mapped onto :class:`KVBridgeWorker`.

vLLM allocates the KV tensors; ``kvbridge.layouts.external`` describes them (or refuses them with
the layer, shape and strides at fault) and kvbridge registers that memory with NIXL as it
is. Loads are asynchronous (decode requests wait in ``WAITING_FOR_REMOTE_KVS``), so the
per-layer hooks have nothing to do; the forward pass itself is the "save".
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvbridge.connector.common.config import ConfigError, KVTransferConfig
from kvbridge.connector.common.metadata import WorkerOutput
from kvbridge.connector.vllm.packing import CpuAttnRepacker
from kvbridge.connector.vllm.stats import CounterDelta, KVBridgeStats, PeerDelta, engine_call_data
from kvbridge.connector.vllm.step_metadata import (
    KVBridgeHandshakeMetadata,
    KVBridgeMetadata,
    KVBridgeWorkerMetadata,
)
from kvbridge.connector.vllm.translate import kv_element_format
from kvbridge.connector.worker.engine_thread import lower_calling_thread_priority
from kvbridge.connector.worker.staging.engine_copies import CopyBlocksOp, engine_copies_for
from kvbridge.connector.worker.worker import KVBridgeWorker, ModelInfo
from kvbridge.layouts.external import adopt_kv_caches
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import AttentionSpec

logger = logging.getLogger(__name__)


class VLLMWorkerSide:
    def __init__(
        self,
        config: KVTransferConfig,
        kv_config: KVCacheConfig,
        *,
        model_name: str,
        total_kv_heads: int,
        architecture: str = "",
        model_fingerprint: str = "",
        layout_hint: KVLayout | None,
        rank: int,
        tp_size: int,
        pp_rank: int = 0,
        pp_layers: Sequence[tuple[int, int]] = (),
        cpu_attention: bool | None = None,
        host_staging: bool | None = None,
        cache_dtype: str = "auto",
        model_dtype: torch.dtype | None = None,
    ) -> None:
        """One tensor-parallel rank of pipeline stage ``pp_rank`` (``pp_layers``: the model
        layers ``[first, end)`` of every stage; empty without pipeline parallelism): its
        side channel listens on ``kv_port + pp_rank * tp_size + rank`` (0: an ephemeral
        port, reported by :meth:`handshake_metadata`) and its caches hold its stage's
        layers and its share of the model's ``total_kv_heads`` KV heads.
        ``cpu_attention``: whether vLLM's CPU attention (engine-packed pages) wrote the
        caches; None asks vLLM's platform (its CPU build runs CPU attention). False reads
        CPU-memory caches as a GPU backend's views describe them (the GPU tier on CPU).
        ``host_staging``: see :class:`KVBridgeWorker` (True stages a cache in host memory
        through a host mirror: the ``kv_buffer_device: "cpu"`` GPU path, tested on CPU).
        ``cache_dtype``: vLLM's ``--kv-cache-dtype``; its element format is what the
        handshake compares (:func:`~kvbridge.connector.vllm.translate.kv_element_format`).
        ``architecture`` / ``model_fingerprint``: what names the model to the handshake
        beside its shapes (:mod:`kvbridge.connector.vllm.model_identity`); ``model_name``
        (the ``--model`` path) only names it in logs. ``model_dtype``: what vLLM writes K
        and V from; with an fp8 cache it picks the CPU attention kernel's instruction set,
        and with it the page order."""
        self.kv_config = kv_config
        self.layout_hint = layout_hint
        self._cpu_attention = cpu_attention
        self._engine_nice = config.extra.engine_thread_nice
        self._cache_dtype, self._model_dtype = cache_dtype, model_dtype
        if config.extra.rewrite_on_save:
            raise ConfigError(
                "extra.rewrite_on_save=true cannot apply under vLLM: its prefix cache lets new "
                "requests read a kept request's blocks, so kvbridge never rewrites them in "
                "place (readers read them as vLLM wrote them); remove the key"
            )
        spec = next((g.spec for g in kv_config.groups if isinstance(g.spec, AttentionSpec)), None)
        if spec is None:
            raise ConfigError(
                f"KV-cache groups {[g.spec.kind.value for g in kv_config.groups]}: kvbridge "
                f"moves state (Mamba) groups beside attention groups, not alone"
            )
        self.worker = KVBridgeWorker(
            config,
            ModelInfo(
                model_name=model_name,
                dtype=kv_element_format(cache_dtype, spec.dtype),
                num_kv_heads=total_kv_heads,
                head_size=spec.head_size,
                architecture=architecture,
                model_fingerprint=model_fingerprint,
            ),
            rank=rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_layers=pp_layers,
            # vLLM's prefix cache lets new requests read a finished request's blocks while
            # decode still holds them: they must stay exactly as vLLM wrote them
            rewrites_in_place=False,
            host_staging=host_staging,
        )
        self._freed: set[str] = set()  # released by the scheduler: vLLM must free them
        self._refused: set[str] = set()  # loads the scheduler side failed: vLLM recomputes
        self._output = WorkerOutput()
        self._delta = CounterDelta()
        self._peers = PeerDelta()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        # Layers that share another layer's cache (no spec of their own) are not in the
        # groups and are not transferred separately.
        tensors = {n: kv_caches[n] for n in self.kv_config.layer_names if n in kv_caches}
        packing = block_packing(
            self.kv_config,
            tensors,
            cpu_attention=self._cpu_attention,
            source=self._model_dtype,
            cache_dtype=self._cache_dtype,
        )
        buffers = adopt_kv_caches(
            self.kv_config,
            tensors,
            layout_hint=self.layout_hint,
            block_packing=packing,
            packed_heads_major=bool(packing) and heads_major(self.kv_config, self._model_dtype),
        )
        if packing:
            self.worker.set_repacker(CpuAttnRepacker(self.kv_config, tensors, self._model_dtype))
        else:  # staged through host memory: a mirror vLLM's copy operation can fill
            self.worker.set_engine_copies(functools.partial(engine_copies_for, tensors))
        logger.info(
            "kvbridge adopted %d KV-cache tensors (%s, %s%s, %d blocks, %d B pages, %s)",
            len(buffers.tensors),
            "cross-layer" if buffers.format.cross_layer else buffers.format.packing.value,
            buffers.format.layout.value,
            f", packed {buffers.format.block_packing}" if buffers.format.block_packing else "",
            buffers.config.num_blocks,
            buffers.config.page_size_bytes,
            ", ".join(f"g{g.group_id}={g.spec.kind.value}" for g in buffers.config.groups),
        )
        self.worker.register_kv_caches(buffers)
        if self._engine_nice:  # after kvbridge's threads started: they keep their priority
            lower_calling_thread_priority(self._engine_nice)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        """vLLM's ``copy_kv_blocks``, handed over right after ``register_kv_caches``: the
        host stage (if any) copies blocks with it when the layout allows."""
        self.worker.set_host_copy_op(copy_operation)

    @property
    def host_copy_path(self) -> str | None:
        """``"vllm"``, ``"kvbridge"``, or None when the cache is not staged."""
        return self.worker.host_copy_path

    def handshake_metadata(self) -> KVBridgeHandshakeMetadata | None:
        """This rank's bound side-channel port; None before ``register_kv_caches``."""
        port = self.worker.side_channel_port
        return KVBridgeHandshakeMetadata(self.worker.engine_rank, port) if port else None

    def bind(self, metadata: Any) -> None:
        if not isinstance(metadata, KVBridgeMetadata):
            raise TypeError(f"expected KVBridgeMetadata, got {type(metadata).__name__}")
        self._freed.update(metadata.meta.reqs_freed)
        self._refused.update(metadata.refused)
        self.worker.bind_connector_metadata(metadata.meta)

    def start_load_kv(self) -> None:
        self.worker.start_load_kv()

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for vLLM; failed loads (and
        those the scheduler side refused) are also 'finished receiving' so vLLM releases
        them from the wait state. A failing load (``failure_policy: fail``, transfers of
        it may still land) is failed only: vLLM ends the request with an error and keeps
        its blocks until the load's own failed report, which finishes it. (With several
        ranks vLLM's ``KVOutputAggregator`` holds a failed id back until every rank
        reported it finished: the error then waits for the transfers.)"""
        out = self.worker.get_finished()
        self._output = out
        failed = {f.request_id for f in out.failed_loads} | self._refused
        failing = {f.request_id for f in out.failing_loads}
        sending = set(out.finished_sending) | self._freed
        self._freed, self._refused = set(), set()
        return sending, set(out.finished_recving) | failed, failed | failing

    def worker_meta(self) -> KVBridgeWorkerMetadata | None:
        out, self._output = self._output, WorkerOutput()
        empty = not (
            out.finished_sending
            or out.finished_recving
            or out.failed_loads
            or out.failing_loads
            or out.expired_leases
        )
        return None if empty else KVBridgeWorkerMetadata(out)

    def stats(self) -> KVBridgeStats | None:
        metrics = self.worker.metrics
        data: dict[str, Any] = {
            **self._delta.take(metrics.counters()),
            **engine_call_data(metrics.engine_calls),
            **self._peers.take(metrics.peer_states, metrics.peer_failures),
        }
        return KVBridgeStats(data=data) if data else None

    def shutdown(self) -> None:
        self.worker.shutdown()


def heads_major(kv_config: KVCacheConfig, source: torch.dtype | None = None) -> bool:
    """Whether vLLM's CPU attention keeps each head of a page in one contiguous run, heads
    in order and each in the same order inside its run (measured with its kernel,
    :func:`kvbridge.connector.vllm.packing.page_map`); then a tensor-parallel reader can take a
    slice of the heads as one byte range, and that slice is a page of fewer heads.
    ``source``: the model's dtype (an fp8 page's order depends on it)."""
    from kvbridge.connector.vllm.packing import page_map

    for g in kv_config.groups:
        spec = g.spec
        if not isinstance(spec, AttentionSpec):
            continue  # a state page is moved whole (equal TP sizes)
        offsets = page_map(spec.dtype, spec.block_size, spec.num_kv_heads, spec.head_size, source)
        per_head = offsets.size // spec.num_kv_heads
        by_head = np.moveaxis(offsets, 2, 0).reshape(spec.num_kv_heads, -1)
        if not np.array_equal(np.sort(by_head[0]), np.arange(per_head)):
            return False
        # every head in the same order inside its run: a slice of the heads is a page of
        # fewer heads (what a rank of another TP size holds)
        steps = np.arange(spec.num_kv_heads).reshape(-1, 1) * per_head
        if not np.array_equal(by_head - steps, np.broadcast_to(by_head[0], by_head.shape)):
            return False
    return True


def block_packing(
    kv_config: KVCacheConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    cpu_attention: bool | None = None,
    source: torch.dtype | None = None,
    cache_dtype: str = "auto",
) -> str:
    """vLLM's id for the element order inside its CPU attention blocks ("" elsewhere).

    vLLM's CPU attention shows a ``[blocks, H, block_size, 2 * head_size]`` tensor but its
    kernels (``cpu_attn_reshape_and_cache``) store each head's K transposed,
    ``[head_size, block_size]``, followed by V ``[block_size, head_size]``, in an order
    chosen per instruction set. Such blocks are byte-identical only to blocks of the same
    size and instruction set, which the id names. The set is the one vLLM picks: from the
    model's dtype (``source``) and ``cache_dtype`` (an fp8 cache's uint8 pages say
    neither).
    """
    if cpu_attention is None:
        from vllm.platforms import current_platform

        cpu_attention = current_platform.is_cpu()
    if not any(t.device.type == "cpu" for t in tensors.values()) or not cpu_attention:
        return ""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isas = set()
    for g in kv_config.groups:
        spec = g.spec
        if isinstance(spec, AttentionSpec):
            dtype = source if spec.dtype == torch.uint8 and source is not None else spec.dtype
            kv = cache_dtype if spec.dtype == torch.uint8 else None
            isas.add(f"{_get_attn_isa(dtype, spec.block_size, spec.head_size, kv)}")
    return "vllm-cpu-attn:" + "+".join(sorted(isas))
