"""``extra.read_probe``: a pulling decode READs each new prefill at the handshake.

The first READ's fixed cost (UCX's connection; on GPUs the CUDA IPC mapping) is paid on the
set-up thread before any load, and GPU memory read at a rate no GPU path runs at is named
in a warning. The probe's own rules (what it reads into, what happens to a READ that does
not end) are checked against a scripted engine; the wiring with real NIXL agents."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.transfer.errors import TransferError
from kvbridge.connector.transfer.nixl_engine import NixlTransferEngine
from kvbridge.connector.transfer.transport import XferState
from kvbridge.connector.worker import read_probe
from kvbridge.connector.worker.read_probe import (
    MAX_RETIRED,
    PROBE_BYTES,
    STEADY_READS,
    ReadProbe,
)
from kvbridge.layouts.region import KVRegion, MemoryKind
from tests.connector.conftest import (
    Cluster,
    SideFormat,
    check_loaded,
    expectations,
    plan_request,
)

FMT = SideFormat(16, cross_layer=True)
BASE = 0x7F0000000000


def _region(kind: MemoryKind) -> KVRegion:
    """A peer's region of 64 blocks of 32 KiB: its span is 2 MiB, more than a probe reads."""
    return KVRegion(
        name="layer0",
        base_addr=BASE,
        block_bytes=32 << 10,
        block_stride_bytes=32 << 10,
        num_blocks=64,
        memory_kind=kind,
    )


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """Every READ a NIXL engine posts: (its agent, the peer, bytes)."""
    posted: list[tuple[str, str, int]] = []
    real = NixlTransferEngine.read

    def read(self, local, local_idx, remote, remote_idx, notif=b""):
        handle = real(self, local, local_idx, remote, remote_idx, notif)
        posted.append((self.agent_name, remote.peer, handle.num_bytes))
        return handle

    monkeypatch.setattr(NixlTransferEngine, "read", read)
    return posted


def _load(cluster: Cluster, prefill, decode, seed: int) -> None:
    prefill.fill(seed)
    req = plan_request(prefill, decode, 0, 64, np.random.default_rng(seed))
    before = expectations(prefill, decode, req)
    cluster.transfer(prefill, decode, req)
    check_loaded(prefill, decode, req, before)


def _warm(cluster: Cluster, decode, prefill) -> None:
    """Both step (a first READ waits for the peer's UCX to answer the connection)."""
    cluster.pump(
        [decode, prefill], lambda: decode.worker.metrics.handshakes >= 1, "the warm handshake"
    )


def test_a_pulling_decode_reads_its_prefill_at_the_handshake(cluster, monkeypatch, caplog):
    posted = _reads(monkeypatch)
    prefill = cluster.new_node("kv_producer", FMT, "F")
    extra = {"read_probe": "on", "warm_peers": [f"127.0.0.1:{prefill.port}"]}
    decode = cluster.new_node("kv_consumer", FMT, "F", extra=extra)
    with caplog.at_level(logging.INFO, logger="kvbridge.connector.worker.read_probe"):
        _warm(cluster, decode, prefill)
        cluster.pump(
            [decode, prefill], lambda: decode.worker.metrics.read_probes >= 1, "the READ probe"
        )
    d, p = decode.worker.agent_name, prefill.worker.agent_name
    # before any load: the first READ, then the same bytes again for the rate
    assert len(posted) == 1 + STEADY_READS and len(set(posted)) == 1, posted
    # the start of prefill's first region, across its blocks (one registration)
    spans = {min(r.span_bytes, PROBE_BYTES) for r in prefill.buffers.regions()}
    assert posted[0][:2] == (d, p) and posted[0][2] in spans
    metrics = decode.worker.metrics
    assert metrics.read_probes == 1 and metrics.read_probe_first_seconds > 0
    assert metrics.read_probes_slow == 0  # host memory: no GPU rate to judge
    assert "(DRAM): first READ" in caplog.text

    _load(cluster, prefill, decode, seed=3)  # the load's bytes are exact; no new probe
    assert len(posted) > 1 + STEADY_READS and metrics.read_probes == 1


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({}, "auto: host memory"),
        ({"read_probe": "off"}, "off"),
        ({"read_probe": "on", "transfer_mode": "push"}, "a pushing decode never READs"),
    ],
)
def test_no_probe_where_it_is_not_asked_for(cluster, monkeypatch, extra, why):
    posted = _reads(monkeypatch)
    mode = extra.get("transfer_mode", "pull")
    prefill = cluster.new_node("kv_producer", FMT, "F", extra={"transfer_mode": mode})
    warm = {**extra, "warm_peers": [f"127.0.0.1:{prefill.port}"]}
    decode = cluster.new_node("kv_consumer", FMT, "F", extra=warm)
    _warm(cluster, decode, prefill)
    assert posted == [], why
    _load(cluster, prefill, decode, seed=4)
    assert decode.worker.metrics.read_probes == 0, why


# ------------------------------------------------------------- the probe's own rules


class ScriptedEngine:
    """Just what ReadProbe calls: READs that end after ``polls`` polls (never: None), or
    raise; each poll moves the clock ``poll_s`` on."""

    def __init__(self, clock: list[float], *, polls: int | None, poll_s: float = 0.001) -> None:
        self.clock, self.polls, self.poll_s = clock, polls, poll_s
        self.registered: list[torch.Tensor] = []
        self.released_handles = 0
        self.released_lists = 0
        self.reads: list[int] = []  # the scratch address of each READ
        self.fail: TransferError | None = None
        self._left = 0

    def register(self, tensors):
        self.registered.extend(tensors)

    def prep_local(self, descs):
        return _List(self, int(descs[0][0]))

    def prep_remote(self, agent, descs, memory_kind):
        assert agent == "prefill-agent" and int(descs[0][0]) == BASE
        assert int(descs[0][1]) == PROBE_BYTES
        return _List(self, 0)

    def read(self, local, local_idx, remote, remote_idx, notif=b""):
        self.reads.append(local.addr)
        self._left = self.polls if self.polls is not None else -1
        return object()

    def poll(self, handle):
        self.clock[0] += self.poll_s
        if self.fail is not None:
            raise self.fail
        if self._left == 0:
            return XferState.DONE
        self._left -= 1 if self._left > 0 else 0
        return XferState.PENDING

    def release(self, handle):
        self.released_handles += 1


class _List:
    def __init__(self, engine: ScriptedEngine, addr: int) -> None:
        self.engine, self.addr = engine, addr

    def release(self):
        self.engine.released_lists += 1


@contextlib.contextmanager
def _counted(pauses: list[int]) -> Iterator[None]:
    pauses.append(1)
    yield


def _probe(engine: ScriptedEngine, clock: list[float], **kw) -> tuple[ReadProbe, ConnectorMetrics]:
    metrics = ConnectorMetrics()
    probe = ReadProbe(engine, torch.device("cpu"), metrics, clock=lambda: clock[0], **kw)
    return probe, metrics


@pytest.mark.parametrize(
    ("kind", "polls", "slow"),
    [
        (MemoryKind.VRAM, 2, True),  # 1 MiB in 2 ms: 0.5 GB/s, an emulated GET's rate
        (MemoryKind.VRAM, 0, False),  # 1 MiB in 10 us: 105 GB/s
        (MemoryKind.DRAM, 2, False),  # host memory: not judged
    ],
)
def test_gpu_memory_read_slowly_is_named_with_the_ucx_settings(caplog, kind, polls, slow):
    clock = [0.0]
    engine = ScriptedEngine(clock, polls=polls, poll_s=0.001 if polls else 0.00001)
    probe, metrics = _probe(engine, clock)
    with caplog.at_level(logging.INFO, logger="kvbridge.connector.worker.read_probe"):
        probe.probe("prefill-agent", _region(kind), where="prefill-0 at h:1")
    assert metrics.read_probes == 1
    assert metrics.read_probes_slow == int(slow)
    assert ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in caplog.text) is slow
    assert len(engine.reads) == 1 + STEADY_READS  # the first, then the fastest of the rest
    assert engine.released_handles == len(engine.reads)
    assert engine.released_lists == 2  # the local and the remote list
    assert len(engine.registered) == 1 and engine.registered[0].numel() == PROBE_BYTES


def test_a_probe_read_that_does_not_end_retires_its_scratch(caplog, monkeypatch):
    """The READ may still write the scratch: it stays registered and alive, the next probe
    reads into a new one, and after MAX_RETIRED no peer is probed any more."""
    monkeypatch.setattr(read_probe, "POLL_S", 0.0)
    pauses: list[int] = []
    clock = [0.0]
    engine = ScriptedEngine(clock, polls=None, poll_s=0.3)
    probe, metrics = _probe(engine, clock, timeout_s=1.0, pause=lambda: _counted(pauses))
    probe.probe("prefill-agent", _region(MemoryKind.VRAM), where="prefill-0 at h:1")
    assert engine.released_handles == 1 and len(engine.reads) == 1  # no second READ
    assert len(pauses) == 3  # polls at 0.3, 0.6, 0.9 s waited with the gate released
    assert probe.retired == [engine.registered[0]]
    assert "not read within 1.0 s" in caplog.text
    assert metrics.read_probes == 0

    for _ in range(MAX_RETIRED + 2):
        probe.probe("prefill-agent", _region(MemoryKind.VRAM), where="prefill-0 at h:1")
    assert len(probe.retired) == MAX_RETIRED  # then it stopped probing
    assert len(engine.registered) == MAX_RETIRED  # one scratch per abandoned READ
    scratch = [t.data_ptr() for t in engine.registered]
    assert len(set(engine.reads)) == MAX_RETIRED and set(engine.reads) == set(scratch)
    assert "no more probes" in caplog.text


def test_a_probe_read_that_fails_keeps_its_scratch(caplog):
    """A failed READ ended: its scratch serves the next probe; the peer is not failed
    (its loads report their own errors)."""
    clock = [0.0]
    engine = ScriptedEngine(clock, polls=1)
    engine.fail = TransferError("READ failed: NIXL raised nixlBackendError")
    probe, metrics = _probe(engine, clock)
    probe.probe("prefill-agent", _region(MemoryKind.VRAM), where="prefill-0 at h:1")
    assert "READ probe of prefill-0 at h:1 failed" in caplog.text
    assert probe.retired == [] and engine.released_handles == 1
    engine.fail = None
    probe.probe("prefill-agent", _region(MemoryKind.VRAM), where="prefill-0 at h:1")
    assert metrics.read_probes == 1 and len(engine.registered) == 1


def test_a_closing_worker_abandons_a_probe_read_and_starts_none(monkeypatch):
    monkeypatch.setattr(read_probe, "POLL_S", 0.0)
    clock, closing = [0.0], [False]
    engine = ScriptedEngine(clock, polls=None, poll_s=0.001)
    polls = [0]
    real_poll = engine.poll

    def poll(handle):
        polls[0] += 1
        closing[0] = polls[0] >= 3  # close() began while the READ runs
        return real_poll(handle)

    engine.poll = poll  # type: ignore[method-assign]
    probe, metrics = _probe(engine, clock, stopping=lambda: closing[0])
    probe.probe("prefill-agent", _region(MemoryKind.VRAM), where="prefill-0 at h:1")
    assert polls[0] == 3 and clock[0] < 1.0  # abandoned at once, not at the timeout
    assert probe.retired == [engine.registered[0]]  # the READ may still write it
    assert engine.released_handles == 1 and metrics.read_probes == 0
    probe.probe("prefill-agent", _region(MemoryKind.VRAM), where="prefill-0 at h:1")
    assert len(engine.reads) == 1  # closing: no new probe
