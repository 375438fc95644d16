"""A READ at the handshake: the first READ's fixed cost paid before the first load, and a
READ path far below the memory's speed named (docs/gpu-memory.md, "The READ probe").

Two things about a decode's READs that nothing reports until a load is slow:

- the first READ from a peer's GPU memory maps it through CUDA IPC (~10 ms on an H100),
  inside the first load that READs it;
- UCX may run a READ of another process's GPU memory as *software emulation* over TCP
  (0.55 GB/s where CUDA IPC moves 1,399 GB/s on the same host), e.g. when
  ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` is off; nothing fails, every load is just slow.

So a pulling decode READs a little of each new peer right after the handshake, as a job
of its own on the set-up thread, queued behind that peer's set-up (the peer is ready, and
loads may start, meanwhile; a warm peer, ``extra.warm_peers``, is probed before any load)::

    scratch    PROBE_BYTES of this worker's memory kind, registered once per worker
    READ 1     the start of the peer's first described region (up to PROBE_BYTES of its
               span, which may cross blocks: it is one registration) -> scratch: it pays UCX's
               connection and (GPU memory) the CUDA IPC mapping; its time is the first READ's
    READ 2-4   the same bytes again, the fastest taken (one slow wake-up of this thread
               is no verdict): the steady rate; GPU memory read slower than SLOW_GBPS is
               logged as a warning naming the UCX settings to look at

Each READ is polled with the agent gate held for ``TIGHT_S`` (a READ at memory speed ends
well within it, so its time is exact), then every ``POLL_S`` with the gate released in
between (``AgentGate.paused``): a first READ that waits for the peer's UCX to answer the
connection (a prefill in a long forward) holds up set-ups asked for after it, at most
``timeout_s`` per READ, never the worker's progress rounds. Closing the worker abandons a
READ still running (its scratch retired, as below).

Ownership: the bytes read are never looked at, and a READ does not touch the peer's
memory, so any block the peer described may be read, lent or not. The scratch belongs
to a READ until NIXL says it ended: a READ that has not ended within ``timeout_s`` is
released (NIXL's release is not a cancel) and its scratch retired for good (kept
registered and alive; the next probe registers a new one; after ``MAX_RETIRED`` no peer
is probed again). A probe never fails a peer: its loads report their own errors.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.transfer.transport import DescList, TransferEngine, XferHandle, XferState
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.region import KVRegion, MemoryKind

logger = logging.getLogger(__name__)

PROBE_BYTES = 1 << 20  # what a probe READs (less when the peer's descriptor is smaller)
PROBE_TIMEOUT_S = 5.0  # a probe READ not ended by then is abandoned (its scratch retired)
TIGHT_S = 0.005  # a probe READ is polled back to back (the gate held) for this long
POLL_S = 0.001  # then this often, the gate released in between
SLOW_GBPS = 5.0  # GPU memory READ slower than this: warned (emulated GETs run at ~0.5)
MIN_RATE_BYTES = 64 << 10  # a smaller READ is all fixed cost: no rate is judged from it
MAX_RETIRED = 4  # scratch pages abandoned to unfinished READs before probing stops
STEADY_READS = 3  # READs after the first: the fastest gives the rate


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """One peer's probe: ``num_bytes`` READ twice, the first READ's time and the second's."""

    num_bytes: int
    first_s: float
    steady_s: float
    memory_kind: MemoryKind

    @property
    def gbps(self) -> float:
        return self.num_bytes / max(self.steady_s, 1e-9) / 1e9

    @property
    def slow(self) -> bool:
        """GPU memory READ at a rate no GPU path runs at (software emulation, host memory
        or a slow link in between)."""
        return (
            self.memory_kind is MemoryKind.VRAM
            and self.num_bytes >= MIN_RATE_BYTES
            and self.gbps < SLOW_GBPS
        )


class ReadProbe:
    """Probes the peers of one decode worker; every method runs on its set-up thread."""

    def __init__(
        self,
        engine: TransferEngine,
        device: torch.device,
        metrics: ConnectorMetrics,
        *,
        pause: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
        stopping: Callable[[], bool] = lambda: False,
        timeout_s: float = PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``pause()``: a context in which the set-up thread lets the worker's rounds in
        (``AgentGate.paused``); ``stopping()``: the worker is closing (a READ still
        running is abandoned)."""
        self._engine = engine
        self._pause = pause
        self._stopping = stopping
        self._device = device
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._clock = clock
        self._scratch: torch.Tensor | None = None
        self.retired: list[torch.Tensor] = []  # scratch a READ may still write: kept alive

    def probe(self, agent: str, region: KVRegion, where: str) -> None:
        """READ the start of the peer's ``region`` twice; log what it took, and warn when
        GPU memory reads slowly. Never raises."""
        if len(self.retired) >= MAX_RETIRED or self._stopping():
            return
        try:
            result = self._run(agent, region)
        except Exception as exc:  # NIXL's, or torch's (no memory for the scratch): logged
            logger.warning("READ probe of %s failed (its loads will say why): %s", where, exc)
            return
        if result is None:
            logger.warning(
                "READ probe of %s: %d bytes not read within %.1f s; a slow path or a peer "
                "that does not progress (its loads time out by transfer_timeout_s)%s",
                where,
                min(region.span_bytes, PROBE_BYTES),
                self._timeout_s,
                "; no more probes" if len(self.retired) >= MAX_RETIRED else "",
            )
            return
        self._metrics.read_probes += 1
        self._metrics.read_probe_first_seconds += result.first_s
        logger.info(
            "READ probe of %s (%s): first READ %.2f ms, then %.3f ms for %d bytes (%.2f GB/s)",
            where,
            result.memory_kind.value,
            result.first_s * 1e3,
            result.steady_s * 1e3,
            result.num_bytes,
            result.gbps,
        )
        if result.slow:
            self._metrics.read_probes_slow += 1
            logger.warning(
                "READs from the GPU memory of %s run at %.2f GB/s (GPU memory moves at "
                "hundreds): UCX is likely emulating them in software, or staging them through "
                "host memory. Check UCX_CUDA_IPC_ENABLE_GET_ZCOPY (kvbridge sets y unless it "
                "is set) and UCX_TLS (it needs cuda_ipc between GPUs of one host, an RDMA "
                "transport between hosts); UCX_PROTO_INFO=y prints the path UCX chose. "
                "See docs/gpu-memory.md",
                where,
                result.gbps,
            )

    def _run(self, agent: str, region: KVRegion) -> ProbeResult | None:
        scratch = self._scratch_page()
        num_bytes = min(region.span_bytes, scratch.numel())
        local = self._engine.prep_local(
            np.array([[scratch.data_ptr(), num_bytes, scratch.device.index or 0]], np.int64)
        )
        try:
            remote = self._engine.prep_remote(
                agent,
                np.array([[region.base_addr, num_bytes, region.device_id]], np.int64),
                memory_kind=region.memory_kind,
            )
            try:
                first = self._timed_read(local, remote)
                steady: list[float | None] = []
                while first is not None and len(steady) < STEADY_READS and None not in steady:
                    steady.append(self._timed_read(local, remote))
            finally:
                remote.release()
        finally:
            local.release()
        if first is None or not steady or None in steady:
            return None
        return ProbeResult(
            num_bytes=num_bytes,
            first_s=first,
            steady_s=min(t for t in steady if t is not None),
            memory_kind=region.memory_kind,
        )

    def _scratch_page(self) -> torch.Tensor:
        if self._scratch is None:
            page = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=self._device)
            self._engine.register([page])
            self._scratch = page
        return self._scratch

    def _timed_read(self, local: DescList, remote: DescList) -> float | None:
        """One READ into the scratch, waited for; its seconds, or None when it did not end
        within the timeout or the worker closes (the scratch is then retired: the READ may
        still write it)."""
        start = self._clock()
        handle = self._engine.read(local, np.zeros(1, np.int64), remote, np.zeros(1, np.int64))
        try:
            while self._engine.poll(handle) is XferState.PENDING:
                waited = self._clock() - start
                if waited > self._timeout_s or self._stopping():
                    self._retire()
                    return None
                if waited > TIGHT_S:
                    with self._pause():
                        time.sleep(POLL_S)  # the set-up thread's wait: rounds go on meanwhile
            return self._clock() - start
        finally:
            self._release(handle)

    def _release(self, handle: XferHandle) -> None:
        try:
            self._engine.release(handle)
        except KVBridgeError as exc:
            logger.warning("releasing a READ probe's handle failed: %s", exc)

    def _retire(self) -> None:
        assert self._scratch is not None
        self.retired.append(self._scratch)
        self._scratch = None
