"""Which of vLLM's parallel layouts kvbridge serves, and where each rank listens.

kvbridge's peers are ``(engine_id, rank)``, ``rank`` the worker's engine rank
(``pp_rank * tensor_parallel_size + tp_rank``), and rank ``r`` of an engine listens on
``kv_port + r``. vLLM's layouts map onto that as follows:

- **Tensor parallel**: served, equal and different sizes on the two sides.
- **Data parallel**: served. vLLM appends ``_dp{index}`` to the engine id of each DP rank
  (``v1/engine/core.py``), so every DP rank is an engine of its own, and each offsets its
  side-channel ports by ``data_parallel_index * tensor_parallel_size *
  pipeline_parallel_size``: N DP ranks on one host start from one ``kv_port`` without
  colliding (vLLM's NixlConnector offsets its one
  port by the DP index alike). The params a DP rank hands out name its engine id and its
  own ports, so a decode reads from the DP rank that prefilled. With ``kv_port`` 0 every
  rank binds an ephemeral port and advertises it, DP or not.
- **Pipeline parallel**: served, equal and different sizes and layer splits on the two
  sides. Each stage registers only its layers (vLLM's ``get_pp_indices``, which
  ``VLLM_PP_LAYER_PARTITION`` overrides); the params list every prefill stage's layers, a
  decode stage reads from the prefill stages whose layers overlap its own exactly the
  layers both hold (:mod:`kvbridge.handshake.layer_window`), and each prefill rank waits
  for the Dones of every decode stage that overlaps it (:mod:`kvbridge.connector.worker.routing`).
- **Decode context parallel**, **prefill context parallel**: refused at startup by name.
  Each context-parallel rank keeps only a share of the tokens, while kvbridge moves whole
  blocks of consecutive tokens; serving them would read the wrong tokens, so the engine
  does not start.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.connector.common.config import ConfigError, KVTransferConfig

# vLLM ParallelConfig fields kvbridge refuses above 1, and the flag that sets each
_REFUSED = {
    "decode_context_parallel_size": (
        "--decode-context-parallel-size",
        "each decode context-parallel rank keeps only its share of every request's "
        "tokens, while kvbridge moves whole blocks of consecutive tokens",
    ),
    "prefill_context_parallel_size": (
        "--prefill-context-parallel-size",
        "each prefill context-parallel rank keeps only its share of every request's "
        "tokens, while kvbridge moves whole blocks of consecutive tokens",
    ),
}


def check_parallelism(parallel_config: Any) -> None:
    """``ConfigError`` naming the flag when vLLM runs a parallel layout kvbridge cannot
    serve (see the module docstring)."""
    for name, (flag, why) in _REFUSED.items():
        size = int(getattr(parallel_config, name, 1) or 1)
        if size > 1:
            raise ConfigError(
                f"{name}={size} ({flag}): kvbridge does not serve it, because {why}; "
                f"start vLLM with {flag} 1 (tensor, pipeline and data parallel are served)"
            )


def _ranks(parallel_config: Any) -> int:
    """Workers of one DP rank: every TP rank of every pipeline stage."""
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    return int(parallel_config.tensor_parallel_size) * pp


def data_parallel_port_offset(parallel_config: Any) -> int:
    """How far this DP rank's side-channel ports lie from ``kv_port``: one port per worker
    (TP rank of a pipeline stage) of every DP rank before it."""
    index = int(getattr(parallel_config, "data_parallel_index", 0) or 0)
    return index * _ranks(parallel_config)


def stage_layers(vllm_config: Any) -> list[tuple[int, int]]:
    """The model layers ``[first, end)`` each pipeline stage holds, as vLLM splits them
    (``get_pp_indices``); empty without pipeline parallelism."""
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp == 1:
        return []
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    return [get_pp_indices(total, stage, pp) for stage in range(pp)]


def for_this_rank(config: KVTransferConfig, parallel_config: Any) -> KVTransferConfig:
    """``config`` with ``kv_port`` moved past the ports of the DP ranks before this one (a
    ``kv_port`` of 0 stays 0: every rank binds an ephemeral port and advertises it)."""
    check_parallelism(parallel_config)
    offset = data_parallel_port_offset(parallel_config)
    if not config.kv_port or not offset:
        return config
    port = config.kv_port + offset
    last = port + _ranks(parallel_config) - 1
    if last > 65535:
        raise ConfigError(
            f"kv_port={config.kv_port} with data parallel rank "
            f"{parallel_config.data_parallel_index} x {_ranks(parallel_config)} workers "
            f"(tensor x pipeline parallel) puts this rank's side channels at "
            f"{port}..{last}, past 65535; choose a lower kv_port, or kv_port 0 (ephemeral)"
        )
    return msgspec.structs.replace(config, kv_port=port)
