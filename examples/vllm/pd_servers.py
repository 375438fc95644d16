"""The servers of a P/D run: a prefill and a decode vLLM server (kvbridge or vLLM's
NixlConnector), vllm-router in front of them, and a single reference server.

:func:`start_pd` starts them on free loopback ports and waits until each answers;
``kvbridge.examples.vllm.run_pd`` (``scripts/run_vllm_pd.sh``), the vLLM tests and
``scripts/bench_vllm.py`` use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.examples.vllm.models import (
    DTYPE,
    MAX_POSITIONS,
    REPO_ROOT,
    SERVER_ARGS,
    ensure_model,
)
from kvbridge.examples.vllm.procs import Service, start_all, stop_all
from kvbridge.examples.vllm.servers import (
    CONNECTORS,
    ServerSpec,
    router_service,
    vllm_service,
    with_engine_nice,
)


@dataclass
class PDServers:
    """A running reference server (optional), prefill, decode and vllm-router."""

    model_name: str
    connector: str
    prefill: Service
    decode: Service
    router: Service | None
    reference: Service | None
    log_dir: Path
    start_s: float = 0.0  # wall time until everything was healthy
    ready_s: dict[str, float] = field(default_factory=dict)

    @property
    def services(self) -> list[Service]:
        return [s for s in (self.router, self.prefill, self.decode, self.reference) if s]

    @property
    def router_url(self) -> str:
        assert self.router is not None
        return self.router.url

    @property
    def prefill_url(self) -> str:
        return self.prefill.url

    @property
    def decode_url(self) -> str:
        return self.decode.url

    @property
    def reference_url(self) -> str | None:
        return self.reference.url if self.reference else None

    def dead(self) -> list[str]:
        """Names of services whose process has exited."""
        return [s.name for s in self.services if s.proc is not None and not s.alive()]

    def close(self, timeout_s: float = 30.0) -> None:
        stop_all(self.services, timeout_s)

    def __enter__(self) -> PDServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_log_dir(tag: str) -> Path:
    return REPO_ROOT / "out" / "vllm-pd" / f"{time.strftime('%Y%m%d-%H%M%S')}-{tag}"


def _model_args(model: str) -> tuple[str, ...]:
    """``SERVER_ARGS`` of ``model`` on vLLM's CPU build (none on other platforms)."""
    if model not in SERVER_ARGS:
        return ()
    from vllm.platforms import current_platform

    return SERVER_ARGS[model] if current_platform.is_cpu() else ()


def start_pd(
    *,
    connector: str = "kvbridge",
    model: str = "tiny-llama",
    prefill_block_size: int = 32,
    decode_block_size: int = 32,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    kv_extra: dict[str, Any] | None = None,
    with_reference: bool = True,
    max_model_len: int = MAX_POSITIONS,
    enforce_eager: bool = False,
    start_timeout_s: float = 600.0,
    router_timeout_s: float = 120.0,
    log_dir: Path | None = None,
    model_root: Path | None = None,
    extra_args: tuple[str, ...] = (),
    progress: bool = True,
    failure_policy: str = "recompute",
) -> PDServers:
    """Start prefill, decode (and a reference server) together, then vllm-router in
    front of them (the ``router`` extra).

    The reference server has no connector and decode's block size. ``failure_policy`` is
    vLLM's ``kv_load_failure_policy`` on prefill and decode (vLLM's default is "fail").
    Raises
    :class:`~kvbridge.examples.vllm.procs.ServiceError` (after stopping everything) when a server
    does not come up within ``start_timeout_s``.
    """
    if connector not in CONNECTORS:
        raise ValueError(f"CONNECTOR must be one of {CONNECTORS}, not {connector!r}")
    model_dir = ensure_model(model, model_root)
    tag = f"{connector}-{model}-{prefill_block_size}to{decode_block_size}"
    if (prefill_tp, decode_tp) != (1, 1):
        tag += f"-tp{prefill_tp}to{decode_tp}"
    log_dir = Path(log_dir) if log_dir else default_log_dir(tag)
    given = kv_extra
    kv_extra = with_engine_nice(kv_extra, connector, prefill_tp + decode_tp + with_reference)
    if progress and kv_extra is not given:
        print("  more busy engine threads than cores: extra.engine_thread_nice=19", flush=True)
    common = dict(
        model=model_dir,
        dtype=DTYPE,
        max_model_len=max_model_len,
        served_model_name=model,
        enforce_eager=enforce_eager,
        extra_args=(*_model_args(model), *extra_args),
    )
    specs = [
        ServerSpec(
            "prefill",
            block_size=prefill_block_size,
            tensor_parallel_size=prefill_tp,
            connector=connector,
            role="prefill",
            kv_extra=kv_extra,
            failure_policy=failure_policy,
            **common,
        ),
        ServerSpec(
            "decode",
            block_size=decode_block_size,
            tensor_parallel_size=decode_tp,
            connector=connector,
            role="decode",
            kv_extra=kv_extra,
            failure_policy=failure_policy,
            **common,
        ),
    ]
    if with_reference:
        specs.append(ServerSpec("reference", block_size=decode_block_size, **common))
    services = [vllm_service(spec, log_dir, slot=i) for i, spec in enumerate(specs)]
    by_name = {s.name: s for s in services}
    router: Service | None = None
    t0 = time.monotonic()

    def report(svc: Service) -> None:
        if progress:
            print(f"  {svc.name} healthy at {svc.url} after {svc.ready_s:.1f} s", flush=True)

    try:
        if progress:
            print(f"starting {', '.join(by_name)} (logs in {log_dir})", flush=True)
        start_all(services, start_timeout_s, on_ready=report)
        router = router_service(
            [by_name["prefill"].url], [by_name["decode"].url], log_dir, timeout_s=router_timeout_s
        )
        start_all([router], 60.0, on_ready=report)
    except BaseException:
        # engines still starting up may take a while to honour SIGTERM: short grace
        stop_all([*services, *([router] if router else [])], timeout_s=5.0)
        raise
    pd = PDServers(
        model_name=model,
        connector=connector,
        prefill=by_name["prefill"],
        decode=by_name["decode"],
        router=router,
        reference=by_name.get("reference"),
        log_dir=log_dir,
    )
    pd.start_s = time.monotonic() - t0
    pd.ready_s = {s.name: s.ready_s or 0.0 for s in pd.services}
    return pd


# -- the check ---------------------------------------------------------------------------
