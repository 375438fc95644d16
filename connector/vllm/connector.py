"""``KVBridgeConnector``: kvbridge as a vLLM V1 KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.connector.vllm",
                           "kv_role": "kv_producer", "engine_id": "prefill-0",
                           "kv_port": 5600, "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kv_ip": "127.0.0.1",
                                                         "lease_s": 30}}'

This class only routes vLLM's calls to the side it runs on (``scheduler_side`` in the
engine core, ``worker_side`` in each worker); kvbridge's logic lives in ``connector/``.
It supports vLLM's hybrid allocator (``SupportsHMA``): every KV-cache group keeps its
own block list end to end.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvbridge.connector.vllm import model_identity, parallelism, spin_wait, translate
from kvbridge.connector.vllm.stats import KVBridgePromMetrics, KVBridgeStats, own_stats_data

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.vllm.scheduler_side import VLLMSchedulerSide
    from kvbridge.connector.vllm.worker_side import VLLMWorkerSide


# every kvbridge module logs under this name (``logging.getLogger(__name__)`` in the
# ``kvbridge.*`` packages)
KVBRIDGE_LOGGER = "kvbridge"


def _log_through_vllm() -> None:
    """kvbridge's loggers write where vLLM's do (vLLM configures only its own logger)."""
    handlers = logging.getLogger("vllm").handlers
    log = logging.getLogger(KVBRIDGE_LOGGER)
    if not log.handlers and handlers:
        log.handlers = list(handlers)
        log.setLevel(logging.INFO)
        log.propagate = False


P = ParamSpec("P")
R = TypeVar("R")


def _scheduler_hook(method: Callable[P, R]) -> Callable[P, R]:
    """A scheduler hook of vLLM's engine core, timed into the scheduler side's
    ``engine_calls`` (the worker's hooks are timed by the worker, ``engine_call``)."""
    hook = method.__name__

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        self: Any = args[0]  # a KVBridgeConnector on the scheduler side
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self.scheduler_side.engine_calls.observe(hook, time.perf_counter() - start)

    return call


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        config = parallelism.for_this_rank(
            translate.transfer_config(vllm_config.kv_transfer_config),
            vllm_config.parallel_config,
        )
        from vllm.platforms import current_platform

        spin_wait.apply(config.extra.engine_step_wait, cpu_platform=current_platform.is_cpu())
        kv_config = translate.kv_cache_config(kv_cache_config)
        self._scheduler: VLLMSchedulerSide | None = None
        self._worker: VLLMWorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvbridge.connector.vllm.scheduler_side import VLLMSchedulerSide

            self._scheduler = VLLMSchedulerSide(
                config,
                kv_config,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                pp_layers=parallelism.stage_layers(vllm_config),
                single_block_groups=translate.single_block_groups(kv_cache_config),
            )
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            from kvbridge.connector.vllm.worker_side import VLLMWorkerSide

            layout, _ = translate.kv_layout(kv_cache_config)
            self._worker = VLLMWorkerSide(
                config,
                kv_config,
                model_name=str(vllm_config.model_config.model),
                architecture=model_identity.architecture(vllm_config.model_config),
                model_fingerprint=model_identity.served_fingerprint(vllm_config.model_config),
                total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
                layout_hint=layout,
                rank=get_tensor_model_parallel_rank(),
                tp_size=get_tensor_model_parallel_world_size(),
                pp_rank=get_pp_group().rank_in_group,
                pp_layers=parallelism.stage_layers(vllm_config),
                cache_dtype=str(vllm_config.cache_config.cache_dtype),
                model_dtype=vllm_config.model_config.dtype,
            )

    @property
    def scheduler_side(self) -> VLLMSchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker_side(self) -> VLLMWorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        # kv_buffer_device "cpu" with a GPU cache: vLLM's copy_kv_blocks fills the mirror
        self.worker_side.set_host_xfer_buffer_ops(copy_operation)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker_side.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request runs only once its KV is in place

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # pull mode: the forward pass wrote the KV where decode reads it

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving, _ = self.worker_side.transfer_results()
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        sending, recving, failed = self.worker_side.transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_side.worker_meta()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        # the bound side-channel port (kv_port 0: ephemeral), for the scheduler's params
        return self.worker_side.handshake_metadata()

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        if self._worker is not None:
            return self._worker.stats()
        return self.scheduler_side.stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side ---------------------------------------------------------------------

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler_side.set_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """vLLM keys every worker's metadata by ``(pp_rank, tp_rank)``; kvbridge by the
        worker's engine rank, stage-major."""
        tp_size = self.scheduler_side.sched.tp_size
        self.scheduler_side.set_handshake_metadata(
            {pp * tp_size + tp: meta for (pp, tp), meta in metadata.items()}
        )

    @_scheduler_hook
    def on_new_request(self, request: Any) -> None:
        self.scheduler_side.on_new_request(request)

    @_scheduler_hook
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    @_scheduler_hook
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    @_scheduler_hook
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta()

    @_scheduler_hook
    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output.kv_connector_worker_meta)

    @_scheduler_hook
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.scheduler_side.request_finished(request, [block_ids])

    @_scheduler_hook
    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    # -- engine configuration ---------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        from vllm.platforms import current_platform

        return translate.preferred_layout(vllm_config, is_cpu=current_platform.is_cpu())

    # -- stats ------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=own_stats_data(data))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
