"""Prefill in a child OS process (``_prefill_child.py``), decode in the test process.

The child fills its caches with a seeded pattern; the test builds a replica of the same
bytes, so it knows what every load must deliver and can check, by digest, that the
child's blocks are byte-exact again after ``Done``. Then the child is SIGKILLed: the load
that needs it fails with a reason within a bounded time while other loads go on, and a
restarted child (same engine id, a new NIXL agent on a new ephemeral port) is handshaken
afresh. Every child binds ``kv_port`` 0 and reports the port it got.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.layout import KVLayout
from tests.connector.conftest import (
    NUM_BLOCKS,
    Cluster,
    SideFormat,
    check_loaded,
    expectations,
    fill_buffers,
    make_buffers,
    new_id,
    plan_request,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHILD_SCRIPT = REPO / "tests" / "connector" / "_prefill_child.py"
START_TIMEOUT_S = 60.0  # importing torch + nixl in a cold child on 2 shared cores
EVENT_TIMEOUT_S = 10.0
FAILURE_BOUND_S = 8.0  # a dead prefill must cost at most this much per load
KINDS = "FSM"


class Child:
    """A prefill worker process and a replica of its cache bytes."""

    def __init__(
        self,
        fmt: SideFormat,
        *,
        engine_id: str,
        kv_port: int,
        seed: int,
        log: Path,
        kinds: str = KINDS,
        rank: int = 0,
        tp_size: int = 1,
        total_kv_heads: int = 2,
        wait_ready: bool = True,
        transfer_mode: str = "pull",
        rewrites_in_place: bool = True,
        pp_rank: int = 0,
        pp_layers: tuple[tuple[int, int], ...] = (),
        group_layers: tuple[tuple[int, ...], ...] | None = None,
    ):
        """``pp_rank`` of the stages ``pp_layers`` (model layers ``[first, end)`` each;
        empty: no pipeline parallelism): the child holds only its stage's layers, of each
        group those of its ``group_layers`` (``make_groups``)."""
        from kvbridge.handshake.tp import rank_heads

        self.fmt, self.engine_id, self.seed, self.rank = fmt, engine_id, seed, rank
        heads = rank_heads(rank, tp_size, total_kv_heads).count
        layers = range(*pp_layers[pp_rank]) if pp_layers else (0, 1)
        self.buffers: KVCacheBuffers = make_buffers(
            fmt, kinds, NUM_BLOCKS, heads, tp_size=tp_size, layers=layers, group_layers=group_layers
        )
        fill_buffers(self.buffers, seed)
        cfg = {
            "engine_id": engine_id,
            "kv_port": kv_port,
            "seed": seed,
            "kinds": kinds,
            "rank": rank,
            "tp_size": tp_size,
            "total_kv_heads": total_kv_heads,
            "num_blocks": self.buffers.config.num_blocks,
            "block_size": fmt.block_size,
            "layout": fmt.layout.value,
            "cross_layer": fmt.cross_layer,
            "packing": fmt.packing.value,
            "kernel_block_size": fmt.kernel_block_size,
            "block_packing": fmt.block_packing,
            "packed_heads_major": fmt.packed_heads_major,
            "kv_interleaved": fmt.kv_interleaved,
            "transfer_mode": transfer_mode,
            "rewrites_in_place": rewrites_in_place,
            "pp_rank": pp_rank,
            "pp_layers": [list(s) for s in pp_layers],
            "group_layers": group_layers,
        }
        env = {**os.environ, "PYTHONPATH": str(REPO)}  # the tests package
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD_SCRIPT), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            cwd=REPO,
            env=env,
        )
        self._events: queue.Queue[dict] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.sent: set[str] = set()
        self.port = 0
        self.agent = ""
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        ready = self.wait_for("ready", timeout_s=START_TIMEOUT_S)
        self.port = ready["port"]
        self.agent = ready["agent"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._events.put(json.loads(line[3:]))
        self._events.put({"event": "eof"})

    def _note(self, event: dict) -> None:
        if event["event"] == "sent":
            self.sent.add(event["request_id"])
        elif event["event"] == "error":  # its worker loop raised: fail now, with the cause
            raise AssertionError(
                f"child {self.engine_id} failed: {event['reason']}; "
                f"log tail: {self.log.read_text()[-2000:]}"
            )

    def drain(self) -> None:
        """Take the events that arrived (non-blocking)."""
        while True:
            try:
                self._note(self._events.get_nowait())
            except queue.Empty:
                return

    def wait_for(self, name: str, timeout_s: float = EVENT_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                event = self._events.get(timeout=max(0.0, left))
            except queue.Empty:
                raise AssertionError(
                    f"child {self.engine_id}: no {name!r} event within {timeout_s} s; "
                    f"log tail: {self.log.read_text()[-2000:]}"
                ) from None
            self._note(event)
            if event["event"] == name:
                return event
            if event["event"] in ("eof", "error"):
                raise AssertionError(
                    f"child {self.engine_id} said {event} while we waited for {name!r}; "
                    f"log tail: {self.log.read_text()[-2000:]}"
                )

    def command(self, **cmd: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def send(self, request_id: str, block_ids, first_block) -> None:
        self.command(
            cmd="send",
            request_id=request_id,
            block_ids=[[int(b) for b in ids] for ids in block_ids],
            first_block=[int(f) for f in first_block],
        )
        event = self.wait_for("kept")
        assert event["request_id"] == request_id

    def digest(self) -> str:
        self.command(cmd="digest")
        return self.wait_for("digest")["sha256"]

    def replica_digest(self) -> str:
        digest = hashlib.sha256()
        for t in self.buffers.tensors:
            digest.update(t.numpy().tobytes())
        return digest.hexdigest()

    def kill(self) -> None:
        """SIGKILL, and reap it (bounded)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.kill()
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._log_file.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """``spawn(fmt, engine_id=..., kv_port=..., seed=...)`` -> Child; all are killed after."""
    children: list[Child] = []

    def _spawn(fmt: SideFormat, *, engine_id: str, kv_port: int = 0, seed: int = 1) -> Child:
        log = tmp_path / f"{engine_id}-{len(children)}.log"
        child = Child(fmt, engine_id=engine_id, kv_port=kv_port, seed=seed, log=log)
        children.append(child)
        return child

    try:
        yield _spawn
    finally:
        for child in children:
            child.close()


def load_from_child(cluster: Cluster, child: Child, decode, req) -> float:
    """Child keeps the blocks, decode loads them; pump until both report; seconds taken."""
    child.send(req.send_id, req.remote_ids, req.remote_first)
    decode.load(req.spec(child))

    def finished() -> bool:
        child.drain()
        return req.load_id in decode.failed or (
            req.load_id in decode.loaded and req.send_id in child.sent
        )

    took = cluster.pump([decode], finished, f"cross-process load {req.load_id}")
    failure = decode.failed.get(req.load_id)
    assert failure is None, f"load failed: {failure.reason}"
    return took


def disjoint_local_ids(req, *others, rng: np.random.Generator) -> None:
    """Give ``req`` decode blocks no other live request holds (as an allocator would)."""
    for g, lids in enumerate(req.local_ids):
        taken = np.concatenate([o.local_ids[g] for o in others])
        free = rng.permutation(np.setdiff1d(np.arange(NUM_BLOCKS), taken))
        assert free.size >= lids.size
        req.local_ids[g] = free[: lids.size]


PAIRS = [
    # sender rewrite (split 64 -> 16, NHD -> HND, kernel 8), cross-layer both sides
    (
        SideFormat(64, KVLayout.NHD, cross_layer=True),
        SideFormat(16, KVLayout.HND, cross_layer=True, kernel_block_size=8),
    ),
    # per-layer prefill, cross-layer decode with larger blocks: receiver merge as well
    (SideFormat(16, KVLayout.HND), SideFormat(64, KVLayout.NHD, cross_layer=True)),
]


@pytest.mark.parametrize(("pfmt", "dfmt"), PAIRS, ids=str)
def test_load_across_processes(cluster: Cluster, spawn, pfmt: SideFormat, dfmt: SideFormat) -> None:
    child = spawn(pfmt, engine_id=new_id("P"), seed=1234)
    decode = cluster.new_node("kv_consumer", dfmt, KINDS)
    decode.fill(99)
    rng = np.random.default_rng(0)
    for start, end in ((0, 256), (64, 192)):
        req = plan_request(child, decode, start, end, rng)
        want = expectations(child, decode, req)
        load_from_child(cluster, child, decode, req)
        check_loaded(child, decode, req, want)
        assert child.digest() == child.replica_digest(), "child's blocks not restored after Done"
    assert decode.worker.metrics.handshakes == 1
    assert decode.worker.metrics.transfers == 2


SAME = SideFormat(16, KVLayout.NHD, cross_layer=True)


@pytest.mark.parametrize(
    ("pfmt", "dfmt"),
    [PAIRS[0], (SAME, SAME)],
    ids=["dies-before-prepare", "dies-before-read"],  # the plan rewrites / needs no rewrite
)
def test_killed_prefill_fails_load_then_restarted_one_serves(
    cluster: Cluster, spawn, pfmt: SideFormat, dfmt: SideFormat
) -> None:
    engine_id = new_id("P")
    child = spawn(pfmt, engine_id=engine_id, seed=1)  # kv_port 0
    decode = cluster.new_node(
        "kv_consumer", dfmt, KINDS, handshake_timeout_s=0.5, transfer_timeout_s=5.0
    )
    # an in-process prefill that stays alive throughout
    other = cluster.new_node("kv_producer", pfmt, KINDS)
    other.fill(3)
    decode.fill(4)
    rng = np.random.default_rng(1)

    first = plan_request(child, decode, 0, 128, rng)
    first_want = expectations(child, decode, first)
    load_from_child(cluster, child, decode, first)
    check_loaded(child, decode, first, first_want)

    # SIGKILL the child while it holds a request decode has not read yet
    doomed = plan_request(child, decode, 0, 128, rng)
    child.send(doomed.send_id, doomed.remote_ids, doomed.remote_first)
    child.kill()
    disjoint_local_ids(doomed, first, rng=rng)
    live = plan_request(other, decode, 0, 128, rng)
    disjoint_local_ids(live, first, doomed, rng=rng)
    live_want = expectations(other, decode, live)
    other.send(live.send_id, live.remote_ids, live.remote_first)
    decode.load(doomed.spec(child), live.spec(other))
    took = cluster.pump(
        [decode, other],
        lambda: doomed.load_id in decode.failed and live.send_id in other.sent,
        f"LoadFailure for {doomed.load_id} (prefill killed) and the live load",
        timeout_s=FAILURE_BOUND_S,
    )
    reason = decode.failed[doomed.load_id].reason
    assert any(w in reason.lower() for w in ("disconnect", "unreachable", "gone", "timeout")), (
        reason
    )
    assert took < FAILURE_BOUND_S
    assert live.load_id in decode.loaded and live.load_id not in decode.failed
    check_loaded(other, decode, live, live_want)
    check_loaded(child, decode, first, first_want)  # earlier load untouched
    handshakes = decode.worker.metrics.handshakes

    # a new incarnation: same engine id, a new port, a new agent name and new bytes
    reborn = spawn(pfmt, engine_id=engine_id, seed=2)
    assert reborn.agent != child.agent
    again = plan_request(reborn, decode, 0, 192, rng)
    again_want = expectations(reborn, decode, again)
    load_from_child(cluster, reborn, decode, again)
    check_loaded(reborn, decode, again, again_want)
    assert decode.worker.metrics.handshakes == handshakes + 1
    assert reborn.digest() == reborn.replica_digest()


def cache_digest(decode) -> str:
    """sha256 of decode's whole KV cache: the test writes nothing into it while a load is
    held, so a change is a transfer landing."""
    h = hashlib.sha256()
    for tensor in decode.buffers.tensors:
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_prefill_fault_while_read_in_flight(
    cluster: Cluster, spawn, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """Under UCX_TLS=tcp a READ needs the target to progress, so a SIGSTOPped child holds
    the read in flight deterministically. Killed: the read fails as a disconnect.

    Frozen past the transfer timeout (twice over), the READ is still on the wire, and
    releasing it would not stop it (release is not cancel): the load is held, not
    reported, for as long as the child stays frozen. Resumed, the child serves the READ,
    which lands in blocks decode still holds; only then does the engine hear of the
    failure, and after that no byte of decode's cache changes. Decode's Done(ok=False)
    frees the child's blocks, and the child serves the next load exactly.
    """
    monkeypatch.setenv("UCX_TLS", "tcp")  # both agents below: the child's and decode's
    child = spawn(SAME, engine_id=new_id("P"), seed=5)
    timeout_s = 1.0
    decode = cluster.new_node("kv_consumer", SAME, KINDS, transfer_timeout_s=timeout_s)
    decode.fill(6)
    rng = np.random.default_rng(2)
    warm = plan_request(child, decode, 0, 64, rng)
    load_from_child(cluster, child, decode, warm)  # handshake and connection are up

    req = plan_request(child, decode, 0, 256, rng)
    disjoint_local_ids(req, warm, rng=rng)
    child.send(req.send_id, req.remote_ids, req.remote_first)
    untouched = cache_digest(decode)
    os.kill(child.proc.pid, signal.SIGSTOP)
    posted = decode.worker.metrics.descriptors_posted
    decode.load(req.spec(child))
    assert decode.worker.metrics.descriptors_posted > posted, "the READ was not posted"
    for _ in range(20):  # the frozen target cannot serve it: still in flight
        decode.collect()
    assert req.load_id not in decode.loaded and req.load_id not in decode.failed

    def ended() -> bool:
        return req.load_id in decode.failed or req.load_id in decode.loaded

    if fault == "killed":
        child.kill()
        cluster.pump([decode], ended, "LoadFailure (killed prefill)", FAILURE_BOUND_S)
        failure = decode.failed[req.load_id]
        assert "disconnect" in failure.reason.lower(), failure.reason
        assert failure.num_valid_tokens == 0
        return

    # past the deadline, and past it again: held (and overdue), never reported
    cluster.pump(
        [decode],
        lambda: decode.worker.metrics.held_overdue == 1,
        "the held load to be overdue",
        2 * timeout_s + FAILURE_BOUND_S,
    )
    assert decode.worker.metrics.loads_held == 1
    assert not ended(), "a failed load was reported while its READ could still land"
    assert cache_digest(decode) == untouched

    os.kill(child.proc.pid, signal.SIGCONT)
    cluster.pump([decode], ended, "the held failure once the READ ended", FAILURE_BOUND_S)
    failure = decode.failed[req.load_id]
    assert "timed out" in failure.reason and str(child.engine_id) in failure.reason
    assert failure.num_valid_tokens == 0
    given_back = cache_digest(decode)
    assert given_back != untouched  # the abandoned READ did land, while decode held the blocks
    for _ in range(200):  # ... and nothing lands after the give-back
        decode.collect()
        child.drain()
    assert cache_digest(decode) == given_back
    cluster.pump(
        [decode],
        lambda: (child.drain(), req.send_id in child.sent)[1],
        f"the resumed child to free {req.send_id} on Done(ok=False)",
    )
    again = plan_request(child, decode, 0, 128, rng)
    disjoint_local_ids(again, warm, req, rng=rng)
    want = expectations(child, decode, again)
    load_from_child(cluster, child, decode, again)
    check_loaded(child, decode, again, want)
    assert child.digest() == child.replica_digest()
