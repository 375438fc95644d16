"""How kvbridge calls NIXL's Python API: exceptions and status strings mapped to ours in
one place each, NIXL's names for memory kinds and operations, the progress-thread delay
the wrapper does not expose (NIXL_NOTES.md: its zero delay spins a core per agent), the
agent built from our config (its UCX backend with TCP connects made non-blocking unless
the environment says otherwise: :data:`UCX_ENGINE_CONFIG`), and a transfer request by
index or by runs. Only ``kvbridge.connector.transfer.nixl_engine`` uses this module."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import nixl._bindings as nixl_bindings
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from kvbridge.connector.transfer.errors import PeerDisconnectedError, TransferError
from kvbridge.connector.transfer.nixl_config import NixlEngineConfig, ProgressMode
from kvbridge.connector.transfer.transport import DescList, XferOp, XferState
from kvbridge.connector.transfer.xfer_rows import XferRows
from kvbridge.layouts.region import MemoryKind

# NIXL's exceptions share no base class besides Exception; collect them once.
_NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    obj
    for name, obj in vars(nixl_bindings).items()
    if name.startswith("nixl") and name.endswith("Error") and isinstance(obj, type)
)
_HINTS: dict[str, str] = {
    "nixlNotFoundError": "a descriptor outside registered memory, or an unknown/removed peer",
    "nixlNotAllowedError": "different metadata under a loaded agent name; give each "
    "process incarnation a unique agent name",
    "nixlMismatchError": "corrupt or foreign metadata",
    "nixlRemoteDisconnectError": "the peer process is gone",
}
logger = logging.getLogger(__name__)

# UCX settings of kvbridge's own UCX backends (NIXL's "engine_config": KEY=VALUE pairs
# without the UCX_ prefix, each skipped when the environment sets UCX_<KEY>; nothing else
# in the process sees them). TCP_CONN_NB: UCX's default (n) connects a TCP endpoint with a
# blocking connect() inside add_remote_agent, under NIXL's agent lock; a peer whose
# address drops packets held that call 134 s (the kernel's SYN retries), and every other
# NIXL call of the agent with it. With y the add returns in milliseconds and an unreachable
# peer fails its first transfer instead (docs/nixl-holds.md). Only TCP connects this way:
# RDMA and cuda_ipc lanes wire up without a blocking connect.
# CUDA_IPC_ENABLE_GET_ZCOPY: UCX's default leaves a GET from another process's GPU memory
# to "software emulation" over TCP loopback (a raw 256 MiB READ on one H100: 0.55 GB/s);
# with y it is a cuda_ipc zero-copy (1,399 GB/s), as a PUT already is. decode pulls (READ)
# by default, so on a host whose GPUs prefill and decode this is the load path.
# UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n in the environment turns it off (docs/gpu-memory.md).
UCX_ENGINE_CONFIG = "TCP_CONN_NB=y,CUDA_IPC_ENABLE_GET_ZCOPY=y"  # NIXL splits at ","
_BACKEND_PARAMS = {"UCX": {"engine_config": UCX_ENGINE_CONFIG}}

NIXL_MEM = {MemoryKind.DRAM: "DRAM", MemoryKind.VRAM: "VRAM"}
NIXL_OPS = {XferOp.READ: "READ", XferOp.WRITE: "WRITE"}
_STATES = {"DONE": XferState.DONE, "PROC": XferState.PENDING}
LOCAL = "NIXL_INIT_AGENT"


def translate(exc: Exception, what: str, default: type[TransferError]) -> TransferError:
    """The one place a NIXL exception becomes ours."""
    name = type(exc).__name__
    cls = PeerDisconnectedError if name == "nixlRemoteDisconnectError" else default
    hint = _HINTS.get(name)
    return cls(f"{what}: NIXL raised {name}: {exc}" + (f" ({hint})" if hint else ""))


def to_state(status: str, what: str) -> XferState:
    """The one place a NIXL status string becomes an ``XferState``."""
    state = _STATES.get(status)
    if state is None:
        raise TransferError(f"{what}: NIXL reported state {status!r}")
    return state


@contextlib.contextmanager
def progress_delay(delay_us: int) -> Iterator[None]:
    """The wrapper builds the bindings' agent config with ``pthrDelay = 0`` (a spinning
    progress thread, NIXL_NOTES.md) and offers no setting: set it on the config object
    on its way into the bindings' constructor, for this one construction."""
    if delay_us <= 0:
        yield
        return
    bindings = nixl_agent.__init__.__globals__["nixlBind"]  # the module the wrapper calls
    real = bindings.nixlAgent

    def with_delay(name: str, agent_config: object) -> object:
        agent_config.pthrDelay = delay_us  # type: ignore[attr-defined]
        return real(name, agent_config)

    bindings.nixlAgent = with_delay
    try:
        yield
    finally:
        bindings.nixlAgent = real


# A NIXL call this slow is logged: NIXL's calls are meant to return at once, and the
# thread that makes them (often the engine's step) waits as long. A call that waits on the
# peer (e.g. a UCX wire-up that needs the peer's worker to answer) shows up here by name.
SLOW_CALL_S = 1.0


def _schedstat() -> tuple[float, float] | None:
    """The calling thread's seconds on a CPU and runnable-but-waiting for one, from
    ``/proc/thread-self/schedstat`` (None where there is none)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            on_cpu, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def _where_the_time_went(took: float, before: tuple[float, float] | None) -> str:
    """Why a call was slow, from the thread's scheduler figures: on a CPU (NIXL worked),
    runnable but waiting for a CPU (starved: other threads, or a lowered priority), or
    asleep (blocked on a lock, a socket, the peer)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0
    after = _schedstat() if before is not None else None
    if before is None or after is None:
        return f"thread {threading.current_thread().name}, nice {nice}"
    on_cpu, waiting = after[0] - before[0], after[1] - before[1]
    asleep = max(0.0, took - on_cpu - waiting)
    return (
        f"thread {threading.current_thread().name}, nice {nice}: {on_cpu:.2f} s on a CPU, "
        f"{waiting:.2f} s runnable waiting for one, {asleep:.2f} s blocked"
    )


@contextlib.contextmanager
def nixl_call(
    what: str,
    default: type[TransferError] = TransferError,
    *,
    slow_s: float | None = SLOW_CALL_S,
    clock: Callable[[], float] = time.monotonic,
    diagnose: bool = False,
) -> Iterator[None]:
    """Translate NIXL's exceptions for ``what``; log the call when it takes ``slow_s`` or
    more (None: never, for calls whose time grows with their size, e.g. registering a
    cache). ``diagnose``: the log also says where the time went (on a CPU, waiting for
    one, blocked), at the cost of two reads of ``/proc``: for the calls that may wait on
    a peer (adding, connecting, removing one), not for the per-transfer ones."""
    before = _schedstat() if diagnose else None
    start = clock()
    try:
        yield
    except _NIXL_ERRORS as exc:
        raise translate(exc, what, default) from exc
    finally:
        took = clock() - start
        if slow_s is not None and took >= slow_s:
            logger.warning(
                "NIXL call %s took %.1f s (%s; the calling thread waited as long)",
                what,
                took,
                _where_the_time_went(took, before),
            )


def new_agent(config: NixlEngineConfig) -> nixl_agent:
    """The NIXL agent ``config`` describes; ``TransferError`` when a backend is missing."""
    name = config.agent_name
    threaded = config.progress is not ProgressMode.PROGRESS_THREAD_OFF
    nixl_config = nixl_agent_config(
        enable_prog_thread=threaded,
        capture_telemetry=config.capture_telemetry,
        backends=[],  # created below, each with kvbridge's parameters
        # NIXL's own progress thread (or another of ours) runs beside the owner's calls:
        # lock the API
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if threaded or config.shared else None,
    )
    delay_us = (
        config.progress_delay_us if config.progress is ProgressMode.PROGRESS_THREAD_DELAY else 0
    )
    with nixl_call(f"agent {name!r}: create", slow_s=None), progress_delay(delay_us):
        agent = nixl_agent(name, nixl_config)
        for backend in config.backends:
            if backend in agent.plugin_list:
                agent.create_backend(backend, dict(_BACKEND_PARAMS.get(backend, {})))
    missing = set(config.backends) - set(agent.backends)
    if missing:
        raise TransferError(
            f"agent {name!r}: backends {sorted(missing)} unavailable; "
            f"plugins present: {sorted(agent.plugin_list)}"
        )
    return agent


def make_xfer(
    agent: nixl_agent,
    op: XferOp,
    local: DescList,
    remote: DescList,
    rows: XferRows,
    notif: bytes,
) -> object:
    """NIXL's request for one transfer: by index through the prepared lists, or one
    descriptor per run through lists built here (``rows.runs``). Raises NIXL's errors."""
    if rows.runs is None:
        return agent.make_prepped_xfer(
            NIXL_OPS[op], local._native, rows.local_idx, remote._native, rows.remote_idx, notif
        )
    local_runs, remote_runs = rows.runs
    return agent.initialize_xfer(
        NIXL_OPS[op],
        agent.get_xfer_descs(local_runs, NIXL_MEM[local.memory_kind]),
        agent.get_xfer_descs(remote_runs, NIXL_MEM[remote.memory_kind]),
        remote.peer,
        notif,
    )
