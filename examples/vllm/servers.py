"""Launch vLLM OpenAI API servers (and vllm-router in front) as managed subprocesses.

::

    from kvbridge.examples.vllm.servers import ServerSpec, vllm_service, kv_transfer_setup
    from kvbridge.examples.vllm.procs import start_all, stop_all

    spec = ServerSpec("decode", model_dir, block_size=64, connector="nixl", role="decode")
    svc = vllm_service(spec, log_dir)
    try:
        start_all([svc], timeout_s=300)
        ...  # svc.url
    finally:
        stop_all([svc])

Each server runs vLLM's OpenAI API server, ``python -m
vllm.entrypoints.launchers.api_server.entry`` (the ``run_server`` of ``vllm serve``, and what
the deprecated ``vllm.entrypoints.openai.api_server`` forwards to; the ``vllm`` command of
vLLM's CPU wheel stops at start, looking for a distribution named ``vllm``), on a free
loopback port with a small CPU KV cache and offline Hugging Face settings. vLLM finds the
connector by its name alone, ``"kv_connector": "KVBridgeConnector"``, through the installed
kvbridge's plugin (:mod:`kvbridge.connector.vllm.plugin`). Ports for the HTTP server and the
connector's side channel are chosen anew at every (re)launch.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.examples.vllm.models import DTYPE
from kvbridge.examples.vllm.procs import HOST, Launch, Service, free_port

CONNECTORS = ("kvbridge", "nixl")
ROLES = ("prefill", "decode", "both")
_KVBRIDGE_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}

BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per engine
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class KVSetup:
    """What a server needs for one connector: ``--kv-transfer-config`` and extra env."""

    config: dict[str, Any]
    env: dict[str, str]

    def to_json(self) -> str:
        return json.dumps(self.config, separators=(",", ":"), sort_keys=True)


def kv_transfer_setup(
    connector: str,
    role: str,
    *,
    index: int = 0,
    extra: dict[str, Any] | None = None,
    tensor_parallel_size: int = 1,
    host: str = HOST,
    failure_policy: str | None = None,
    engine_id: str | None = None,
    kv_port: int = 0,
) -> KVSetup:
    """The kv-transfer config of server ``role`` (prefill / decode) for ``connector``.

    ``nixl``: vLLM's own NixlConnector (``kv_both``) with its side channel on a free port.
    ``kvbridge``: ``KVBridgeConnector`` (by name: kvbridge's vLLM plugin registers it) as
    producer (prefill) or consumer (decode), its listeners on ephemeral ports (``kv_port``
    0) unless ``kv_port`` gives a base (rank ``r`` of data-parallel rank ``d`` at
    ``kv_port + d * tp + r``), ``extra`` passed through as ``kv_connector_extra_config``.
    ``nixl`` picks a fresh base port on every call.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    if connector == "nixl":
        config: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
        }
        if extra:
            config["kv_connector_extra_config"] = dict(extra)
        if failure_policy is not None:
            config["kv_load_failure_policy"] = failure_policy
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            # vLLM's NixlConnector needs a fixed base port (ranks at base + rank): probed
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port(host, span=tensor_parallel_size)),
        }
        return KVSetup(config, env)
    if connector == "kvbridge":
        config = {
            "kv_connector": "KVBridgeConnector",
            "kv_role": _KVBRIDGE_ROLES[role],
            "engine_id": engine_id or f"{role}-{index}",
            # 0, ephemeral: every rank binds its own; vLLM hands the bound ports from the
            # workers to the scheduler (get_handshake_metadata), which advertises them
            "kv_port": kv_port,
            "kv_buffer_device": "cpu",
            # vLLM 0.32's KVTransferConfig has no kv_ip: kvbridge reads it from the extra
            "kv_connector_extra_config": {"kv_ip": host, **(extra or {})},
        }
        if failure_policy is not None:
            config["kv_load_failure_policy"] = failure_policy
        return KVSetup(config, {})
    raise ValueError(f"connector must be one of {CONNECTORS}, not {connector!r}")


@dataclass
class ServerSpec:
    """One vLLM API server. ``connector``/``role`` unset: a plain single server."""

    name: str
    model: Path
    block_size: int = 32
    dtype: str = DTYPE
    max_model_len: int = 4096
    connector: str | None = None
    role: str | None = None
    index: int = 0
    kv_extra: dict[str, Any] | None = None
    failure_policy: str | None = None  # vLLM's kv_load_failure_policy (recompute / fail)
    tensor_parallel_size: int = 1
    cpus: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; None: cpu_bind(index...)
    served_model_name: str | None = None
    seed: int = 0
    enforce_eager: bool = False
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # kvbridge's side channels on a fixed base port (one per TP x PP x DP rank, probed
    # free at each launch) instead of ephemeral ones
    fixed_kv_port: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(
                f"{self.name}: block size {self.block_size} is not a positive multiple of 32 "
                "(vLLM's CPU attention needs multiples of 32)"
            )
        if (self.connector is None) != (self.role is None):
            raise ValueError(f"{self.name}: give both connector and role, or neither")


def cpu_bind(slot: int, tensor_parallel_size: int = 1) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for server number ``slot``: one core per TP rank.

    Servers are spread round-robin over the cores this process may use, so that servers
    started together do not all pin their OpenMP threads to the same core (vLLM's "auto"
    binding gives every server every core, and on a small machine they then spin against
    each other). TP > 1 gets "a|b|..." (vLLM refuses TP without one list per rank here).
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    first = slot * tensor_parallel_size
    return "|".join(str(cores[(first + r) % len(cores)]) for r in range(tensor_parallel_size))


def with_engine_nice(
    kv_extra: dict[str, Any] | None, connector: str, busy_threads: int
) -> dict[str, Any] | None:
    """``kv_extra`` plus kvbridge's ``extra.engine_thread_nice`` = 19 when the servers
    started together have more busy-waiting engine threads (one per TP rank) than this
    process may use cores: vLLM's workers spin between steps, and on a shared core they
    starved the transfer threads (decode loads stuck in ``reading`` for 30 s; see
    ``connector/worker/engine_thread.py``). A value the caller set wins; other connectors get
    ``kv_extra`` unchanged."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if connector != "kvbridge" or busy_threads <= cores:
        return kv_extra
    extra = dict((kv_extra or {}).get("extra", {}))
    extra.setdefault("engine_thread_nice", 19)
    return {**(kv_extra or {}), "extra": extra}


def vllm_plan(spec: ServerSpec, slot: int = 0) -> Callable[[], Launch]:
    """A launch plan for ``spec``: each call picks fresh ports."""

    def plan() -> Launch:
        port = free_port()  # vLLM's --port cannot report an ephemeral one: probed
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            str(spec.model),
            "--served-model-name",
            spec.served_model_name or spec.model.name,
            "--host",
            HOST,
            "--port",
            str(port),
            "--block-size",
            str(spec.block_size),
            "--seed",
            str(spec.seed),
            "--dtype",
            spec.dtype,
            "--max-model-len",
            str(spec.max_model_len),
        ]
        if spec.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
        if spec.data_parallel_size > 1:
            argv += ["--data-parallel-size", str(spec.data_parallel_size)]
        if spec.pipeline_parallel_size > 1:
            argv += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
        workers = spec.tensor_parallel_size * spec.data_parallel_size * spec.pipeline_parallel_size
        if spec.enforce_eager:
            argv.append("--enforce-eager")
        env = {
            **BASE_ENV,
            "VLLM_CPU_OMP_THREADS_BIND": spec.cpus or cpu_bind(slot, workers),
        }
        details: dict[str, object] = {"block_size": spec.block_size}
        if spec.connector is not None:
            assert spec.role is not None
            kv = kv_transfer_setup(
                spec.connector,
                spec.role,
                index=spec.index,
                extra=spec.kv_extra,
                tensor_parallel_size=spec.tensor_parallel_size,
                failure_policy=spec.failure_policy,
                engine_id=spec.name,  # unique among the servers started together
                kv_port=free_port(span=workers) if spec.fixed_kv_port else 0,
            )
            argv += ["--kv-transfer-config", kv.to_json()]
            env.update(kv.env)
            details["kv_transfer_config"] = kv.config
            details["kv_env"] = kv.env
        argv += list(spec.extra_args)
        # arguments for every server of a run, e.g. "--gpu-memory-utilization 0.25" when
        # three servers share one GPU (scripts/gpu_check.sh)
        argv += shlex.split(os.environ.get("KVBRIDGE_VLLM_SERVER_ARGS", ""))
        env.update(spec.env)
        return Launch(argv=argv, env=env, port=port, details=details)

    return plan


def vllm_service(spec: ServerSpec, log_dir: Path, slot: int = 0) -> Service:
    return Service(spec.name, vllm_plan(spec, slot), log_dir)


def router_service(
    prefill_urls: list[str],
    decode_urls: list[str],
    log_dir: Path,
    *,
    name: str = "router",
    timeout_s: float = 120.0,
    policy: str = "round_robin",
) -> Service:
    """vllm-router in P/D mode (``python -m kvbridge.examples.router``, the ``router``
    extra) in front of the given prefill and decode servers; ``timeout_s`` bounds both its
    start (it listens once every worker answers ``/health``) and each request."""

    ready_file = Path(log_dir) / f"{name}.ready.json"

    def plan() -> Launch:
        ready_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "kvbridge.examples.router", "--host", HOST]
        argv += ["--port", "0"]  # the held ephemeral port comes back in the ready file
        argv += ["--ready-file", str(ready_file), "--policy", policy]
        argv += ["--startup-timeout", str(timeout_s)]
        for url in prefill_urls:
            argv += ["--prefill", url]
        for url in decode_urls:
            argv += ["--decode", url]
        argv += ["--", "--request-timeout-secs", str(max(1, round(timeout_s)))]
        env = {"PYTHONUNBUFFERED": "1"}
        return Launch(argv=argv, env=env, port=0, ready_file=ready_file)

    return Service(name, plan, log_dir)
