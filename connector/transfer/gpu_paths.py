"""Whether UCX's settings leave GPU memory between processes of one host off CUDA IPC.

Two settings do, and neither fails: the transfer runs, 100-2,000x slower.

- ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n`` (or ``auto``, UCX's default, between GPUs that
  NVLink does not join): a READ (UCX GET) of another process's GPU memory
  runs as *software emulation* over TCP loopback (a 256 MiB raw READ on one H100: 487 ms,
  0.55 GB/s; with CUDA IPC 0.19 ms). kvbridge's UCX backends set it to ``y``
  (``nixl_calls.UCX_ENGINE_CONFIG``) unless the environment says otherwise. WRITE (push)
  is not affected.
- ``UCX_TLS`` without ``cuda_ipc`` (nor ``cuda`` or ``all``), or excluding it
  (``^cuda_ipc``): READ and WRITE of GPU memory both go through host memory.

:func:`slow_gpu_path` reads them as UCX will (the environment wins over kvbridge's own
setting); the NIXL engine warns once per process when it registers GPU memory under one.
A timed probe at the handshake would also catch what the settings cannot say (a host
whose GPUs UCX cannot map to each other); that needs a GPU and is not built.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

logger = logging.getLogger(__name__)

_OFF = frozenset({"n", "no", "off", "0"})  # UCX's ON_OFF_AUTO values that mean off
_AUTO = frozenset({"auto", "try", "maybe"})  # UCX's default: GET zero-copy over NVLink only
_CARRIES_IPC = frozenset({"all", "cuda", "cuda_ipc"})  # UCX_TLS names that include cuda_ipc
_warned: set[str] = set()  # reasons already logged in this process


def slow_gpu_path(environ: Mapping[str, str]) -> str | None:
    """Why GPU memory between processes of this host would not move over CUDA IPC under
    ``environ``'s UCX settings (None: nothing in them says so)."""
    zcopy = environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    if zcopy is not None and zcopy.lower() in _OFF | _AUTO:
        where = "" if zcopy.lower() in _OFF else " between GPUs not joined by NVLink"
        return (
            f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={zcopy} in the environment (it overrides "
            f"kvbridge's y): a READ of another process's GPU memory{where} runs as UCX "
            f"software emulation over TCP (0.55 GB/s on an H100, against 1,399 GB/s over "
            f"CUDA IPC); unset it, or use extra.transfer_mode 'push' (WRITE is not affected)"
        )
    tls = environ.get("UCX_TLS")
    if not tls:
        return None
    names = [n for n in tls.split(",") if n]  # UCX's names are case-sensitive
    if names and names[0].startswith("^"):
        excluded = {names[0][1:], *names[1:]}
        left_out = bool(excluded & {"cuda", "cuda_ipc"})
    else:
        left_out = not _CARRIES_IPC & set(names)
    if not left_out:
        return None
    return (
        f"UCX_TLS={tls} leaves out cuda_ipc: READs and WRITEs of GPU memory between "
        f"processes of this host go through host memory; add cuda_ipc to UCX_TLS"
    )


def warn_slow_gpu_path(environ: Mapping[str, str]) -> str | None:
    """Log :func:`slow_gpu_path`'s reason, once per process per reason; returns it."""
    reason = slow_gpu_path(environ)
    if reason is not None and reason not in _warned:
        _warned.add(reason)
        logger.warning("kvbridge registered GPU memory, but %s", reason)
    return reason
