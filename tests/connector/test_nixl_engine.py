"""NixlTransferEngine against real NIXL: two agents in one process.

``decode`` reads from ``prefill``. In one process the first transfer to a new peer needs
the target agent driven too (connection wire-up), so waits poll the reader and call the
target's ``get_notifs``, exactly what a passive prefill worker does in its step loop.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge.connector.transfer.errors import DescriptorError, RegistrationError, TransferError
from kvbridge.connector.transfer.nixl_engine import (
    MergeRuns,
    NixlEngineConfig,
    NixlTransferEngine,
    ProgressMode,
)
from kvbridge.connector.transfer.transport import DescList, XferHandle, XferState, wait_done

NUM_BLOCKS = 1000
BLOCK_BYTES = 1024
TIMEOUT_S = 5.0


def _name(role: str) -> str:
    return f"{role}-0-{uuid.uuid4().hex[:8]}"


def _block_descs(t: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    num_blocks = t.numel() * t.element_size() // block_bytes
    descs = np.zeros((num_blocks, 3), dtype=np.int64)
    descs[:, 0] = t.data_ptr() + np.arange(num_blocks) * block_bytes
    descs[:, 1] = block_bytes
    return descs


def _wait(
    engine: NixlTransferEngine, handle: XferHandle, target: NixlTransferEngine
) -> dict[str, list[bytes]]:
    """Poll ``handle`` to DONE while driving ``target``; return the target's notifications."""
    notifs: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while engine.poll(handle) is XferState.PENDING:
        for sender, msgs in target.get_notifs().items():
            notifs.setdefault(sender, []).extend(msgs)
        assert time.monotonic() < deadline, f"{handle!r} not done within {TIMEOUT_S} s"
    return notifs


def _collect_notifs(
    target: NixlTransferEngine, sender: NixlTransferEngine, count: int
) -> list[bytes]:
    """Drive both sides until ``count`` notifications from ``sender`` reached ``target``.

    Without a progress thread a sender's notifications (and its connection wire-up) only
    move when the sender itself calls into NIXL, so the sender is driven too.
    """
    got: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < count:
        assert not sender.get_notifs(), "the sender got notifications nobody sent it"
        got.extend(target.get_notifs().get(sender.agent_name, []))
        assert time.monotonic() < deadline, f"{len(got)}/{count} from {sender.agent_name}"
    return got


class Pair:
    """A prefill engine holding known bytes and a decode engine with an empty cache."""

    def __init__(self, capture_telemetry: bool = False, merge: MergeRuns = MergeRuns.OFF) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.src = torch.randint(
            0, 256, (NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=gen
        )
        self.dst = torch.zeros_like(self.src)
        self.prefill = NixlTransferEngine(NixlEngineConfig(agent_name=_name("prefill")))
        self.decode = NixlTransferEngine(
            NixlEngineConfig(
                agent_name=_name("decode"), capture_telemetry=capture_telemetry, merge=merge
            )
        )
        self.prefill.register([self.src])
        self.decode.register([self.dst])
        self.peer = self.decode.add_peer(self.prefill.metadata())
        self.local = self.decode.prep_local(_block_descs(self.dst))
        self.remote = self.decode.prep_remote(self.peer, _block_descs(self.src))

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def test_read_shuffled_subset_copies_exact_bytes_and_notifies(pair: Pair) -> None:
    rng = np.random.default_rng(0)
    remote_idx = rng.permutation(NUM_BLOCKS)[:300]
    local_idx = rng.permutation(NUM_BLOCKS)[:300]
    assert pair.peer == pair.prefill.agent_name

    handle = pair.decode.read(pair.local, local_idx, pair.remote, remote_idx, notif=b"req-7")
    notifs = _wait(pair.decode, handle, pair.prefill)
    assert set(notifs) <= {pair.decode.agent_name}
    got = notifs.get(pair.decode.agent_name) or _collect_notifs(pair.prefill, pair.decode, 1)
    assert got == [b"req-7"]
    assert torch.equal(pair.dst[local_idx], pair.src[remote_idx])
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), local_idx)
    assert int(pair.dst[untouched].count_nonzero()) == 0
    assert pair.decode.num_descriptors_posted == 300
    assert pair.decode.bytes_posted == 300 * BLOCK_BYTES
    assert (handle.num_descs, handle.num_bytes, handle.peer) == (300, 300 * BLOCK_BYTES, pair.peer)
    assert pair.decode.poll(handle) is XferState.DONE  # stays DONE


def test_write_pushes_local_blocks_to_peer(pair: Pair) -> None:
    pair.dst[:10] = 7
    handle = pair.decode.write(pair.local, np.arange(10), pair.remote, np.arange(990, 1000))
    _wait(pair.decode, handle, pair.prefill)
    assert bool((pair.src[990:] == 7).all())
    assert pair.decode.num_descriptors_posted == 10


def test_standalone_notifications_arrive_in_order(pair: Pair) -> None:
    pair.prefill.add_peer(pair.decode.metadata())
    for i in range(5):
        pair.decode.send_notif(pair.peer, b"msg-%d" % i)
    got = _collect_notifs(pair.prefill, pair.decode, 5)
    assert got == [b"msg-%d" % i for i in range(5)]
    with pytest.raises(TransferError, match="unknown peer"):
        pair.decode.send_notif("nobody", b"x")


@pytest.mark.parametrize(
    ("local_idx", "remote_idx", "match"),
    [
        ([0, 1000], [0, 1], "local_idx: index 1000 at position 1 outside"),
        ([0, 1], [0, 5000], "remote_idx: index 5000 at position 1 outside"),
        ([-1], [0], "index -1"),
        ([0, 1, 2], [0, 1], "3 local indices but 2 remote"),
        ([], [], "non-empty"),
        ([0.0], [0], "integer"),
        ([[0]], [[0]], "1-D"),
    ],
)
def test_bad_indices_raise_descriptor_error_and_post_nothing(
    pair: Pair, local_idx: list, remote_idx: list, match: str
) -> None:
    with pytest.raises(DescriptorError, match=match):
        pair.decode.read(pair.local, np.array(local_idx), pair.remote, np.array(remote_idx))
    assert (pair.decode.num_descriptors_posted, pair.decode.num_live_handles) == (0, 0)
    ok = pair.decode.read(pair.local, np.array([3]), pair.remote, np.array([4]))
    _wait(pair.decode, ok, pair.prefill)
    assert torch.equal(pair.dst[3], pair.src[4])


def test_descriptors_outside_registered_memory_raise(pair: Pair) -> None:
    outside = _block_descs(pair.dst)[:2].copy()
    outside[1, 0] += NUM_BLOCKS * BLOCK_BYTES  # second row past the end of the cache
    with pytest.raises(DescriptorError, match=r"row 1 .* outside every registered region"):
        pair.decode.prep_local(outside)
    remote = _block_descs(pair.src)[:2].copy()
    remote[0, 0] -= 1 << 20
    with pytest.raises(DescriptorError, match="nixlNotFoundError") as err:
        pair.decode.prep_remote(pair.peer, remote)
    assert pair.peer in str(err.value)
    with pytest.raises(DescriptorError, match="Nx3"):
        pair.decode.prep_local(np.zeros((4, 2), dtype=np.int64))
    with pytest.raises(TransferError, match="unknown peer"):
        pair.decode.prep_remote("nobody", remote)


def test_paired_descriptors_of_different_lengths_raise(pair: Pair) -> None:
    half = _block_descs(pair.src, BLOCK_BYTES // 2)
    remote_half = pair.decode.prep_remote(pair.peer, half)
    with pytest.raises(DescriptorError, match="local desc 0 has 1024 bytes, remote desc 0 has 512"):
        pair.decode.read(pair.local, np.array([0]), remote_half, np.array([0]))


def test_release_is_idempotent_and_released_handle_cannot_be_used(pair: Pair) -> None:
    handle = pair.decode.read(pair.local, np.arange(4), pair.remote, np.arange(4))
    _wait(pair.decode, handle, pair.prefill)
    handle.release()
    handle.release()
    pair.decode.release(handle)
    assert handle.released and pair.decode.num_live_handles == 0
    assert "released" in repr(handle)
    with pytest.raises(TransferError, match="released"):
        pair.decode.poll(handle)
    live = pair.decode.read(pair.local, np.arange(1), pair.remote, np.arange(1))
    with pytest.raises(TransferError, match="another engine"):
        pair.prefill.poll(live)
    pair.remote.release()
    pair.remote.release()
    with pytest.raises(DescriptorError, match="not a live remote list"):
        pair.decode.read(pair.local, np.arange(4), pair.remote, np.arange(4))


def test_close_releases_everything_and_is_idempotent(pair: Pair) -> None:
    handles = [
        pair.decode.read(pair.local, np.array([i]), pair.remote, np.array([i])) for i in range(3)
    ]
    _wait(pair.decode, handles[0], pair.prefill)
    assert (pair.decode.num_live_handles, pair.decode.num_live_desc_lists) == (3, 2)
    pair.decode.close()
    assert all(h.released for h in handles)
    assert pair.local.released and pair.remote.released
    assert (pair.decode.num_live_handles, pair.decode.num_live_desc_lists) == (0, 0)
    assert pair.decode.peers == () and pair.decode.closed
    pair.decode.close()  # second close is a no-op
    handles[1].release()  # already released: no-op, no NIXL call
    with pytest.raises(TransferError, match="after close"):
        pair.decode.metadata()
    with pytest.raises(TransferError, match="after close"):
        pair.decode.poll(handles[2])


def test_context_manager_closes() -> None:
    with NixlTransferEngine(NixlEngineConfig(agent_name=_name("ctx"))) as engine:
        engine.register([torch.zeros(64, dtype=torch.uint8)])
        assert len(engine.metadata()) > 0
    assert engine.closed


def test_remove_peer_then_add_again(pair: Pair) -> None:
    handle = pair.decode.read(pair.local, np.array([0]), pair.remote, np.array([0]))
    _wait(pair.decode, handle, pair.prefill)
    pair.decode.remove_peer(pair.peer)
    pair.decode.remove_peer(pair.peer)  # unknown now: no-op
    assert handle.released and pair.remote.released and pair.decode.peers == ()
    assert not pair.local.released
    with pytest.raises(TransferError, match="unknown peer"):
        pair.decode.prep_remote(pair.peer, _block_descs(pair.src))

    assert pair.decode.add_peer(pair.prefill.metadata()) == pair.peer
    remote = pair.decode.prep_remote(pair.peer, _block_descs(pair.src))
    handle = pair.decode.read(pair.local, np.array([5, 6]), remote, np.array([8, 9]))
    _wait(pair.decode, handle, pair.prefill)
    assert torch.equal(pair.dst[5:7], pair.src[8:10])


def test_new_incarnation_under_live_name_is_refused(pair: Pair) -> None:
    impostor = NixlTransferEngine(NixlEngineConfig(agent_name=pair.peer))
    try:
        impostor.register([torch.zeros(64, dtype=torch.uint8)])
        with pytest.raises(TransferError, match=r"nixlNotAllowedError.*unique agent name"):
            pair.decode.add_peer(impostor.metadata())
    finally:
        impostor.close()
    with pytest.raises(TransferError, match="nixlMismatchError"):
        pair.decode.add_peer(b"not metadata" * 8)


def test_register_rejects_bad_tensors(pair: Pair) -> None:
    with pytest.raises(RegistrationError, match="overlaps"):
        pair.decode.register([pair.dst[10:20]])
    with pytest.raises(RegistrationError, match="contiguous"):
        pair.decode.register([torch.zeros(8, 8)[:, 1]])
    with pytest.raises(RegistrationError, match="no tensors"):
        pair.decode.register([])
    extra = torch.zeros(4, BLOCK_BYTES, dtype=torch.uint8)
    pair.decode.register([extra])  # a second allocation is fine
    assert pair.decode.prep_local(_block_descs(extra)).num_descs == 4


def test_foreign_thread_is_refused(pair: Pair) -> None:
    errors: list[BaseException] = []

    def use() -> None:
        try:
            pair.decode.get_notifs()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=use)
    thread.start()
    thread.join(TIMEOUT_S)
    assert len(errors) == 1 and isinstance(errors[0], TransferError)
    assert "not thread-safe" in str(errors[0])


def test_telemetry_counts_merged_descriptors() -> None:
    pair = Pair(capture_telemetry=True)
    try:
        contiguous = pair.decode.read(pair.local, np.arange(100), pair.remote, np.arange(100))
        _wait(pair.decode, contiguous, pair.prefill)
        shuffled_idx = np.random.default_rng(1).permutation(NUM_BLOCKS)[:50]
        shuffled = pair.decode.read(pair.local, shuffled_idx, pair.remote, shuffled_idx[::-1])
        _wait(pair.decode, shuffled, pair.prefill)
        merged = pair.decode.telemetry(contiguous)
        assert merged is not None and (merged.num_descs, merged.num_bytes) == (1, 100 * 1024)
        apart = pair.decode.telemetry(shuffled)
        assert apart is not None and (apart.num_descs, apart.num_bytes) == (50, 50 * 1024)
        # by index (small transfers): ours counts rows, NIXL coalesces adjacent ones
        assert pair.decode.num_descriptors_posted == pair.decode.num_rows_posted == 150
    finally:
        pair.close()


def test_telemetry_off_returns_none(pair: Pair) -> None:
    handle = pair.decode.read(pair.local, np.arange(2), pair.remote, np.arange(2))
    _wait(pair.decode, handle, pair.prefill)
    assert pair.decode.telemetry(handle) is None


def test_desc_list_repr_and_sizes(pair: Pair) -> None:
    assert isinstance(pair.local, DescList)
    assert pair.local.num_descs == NUM_BLOCKS and int(pair.local.lens.sum()) == pair.dst.numel()
    assert "local" in repr(pair.local) and pair.peer in repr(pair.remote)
    with pytest.raises(ValueError):
        pair.local.lens[0] = 1  # read-only view of the prepared lengths


def test_progress_thread_completes_without_driving_the_target() -> None:
    # With the wrapper's progress thread the passive side need not call into NIXL. It spins
    # a core per agent, so it is opt-in and this test keeps it short.
    spin = ProgressMode.PROGRESS_THREAD_SPIN
    src = torch.full((8, BLOCK_BYTES), 9, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    with (
        NixlTransferEngine(NixlEngineConfig(agent_name=_name("prefill"), progress=spin)) as pf,
        NixlTransferEngine(NixlEngineConfig(agent_name=_name("decode"), progress=spin)) as dc,
    ):
        pf.register([src])
        dc.register([dst])
        peer = dc.add_peer(pf.metadata())
        local, remote = dc.prep_local(_block_descs(dst)), dc.prep_remote(peer, _block_descs(src))
        handle = dc.read(local, np.arange(8), remote, np.arange(8), notif=b"done")
        wait_done(dc, handle, timeout_s=TIMEOUT_S)  # pf is never called meanwhile
        assert torch.equal(dst, src)
        deadline = time.monotonic() + TIMEOUT_S
        while not (notifs := pf.get_notifs()):
            assert time.monotonic() < deadline
        assert notifs == {dc.agent_name: [b"done"]}


# -- adjacent runs posted as one descriptor (NixlEngineConfig.merge) -------------------------


def _merge_pair(merge: MergeRuns) -> Iterator[Pair]:
    p = Pair(capture_telemetry=True, merge=merge)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def merging() -> Iterator[Pair]:
    yield from _merge_pair(MergeRuns.ON)


@pytest.mark.parametrize("op", ["read", "write"])
def test_runs_move_as_one_descriptor_each_with_exact_bytes(merging: Pair, op: str) -> None:
    # three runs (100 rows, 10 rows, 1 row) and two rows that jump on one side only
    local_idx = np.concatenate([np.arange(200, 300), np.arange(600, 610), [7], [40, 41]])
    remote_idx = np.concatenate([np.arange(0, 100), np.arange(500, 510), [3], [80, 90]])
    before = (merging.src.clone(), merging.dst.clone())
    post = merging.decode.read if op == "read" else merging.decode.write
    handle = post(merging.local, local_idx, merging.remote, remote_idx, notif=b"runs")
    notifs = _wait(merging.decode, handle, merging.prefill)
    got = notifs.get(merging.decode.agent_name) or _collect_notifs(
        merging.prefill, merging.decode, 1
    )
    assert got == [b"runs"]
    if op == "read":
        assert torch.equal(merging.dst[local_idx], before[0][remote_idx])
        touched, other = merging.dst, before[1]
        untouched = np.setdiff1d(np.arange(NUM_BLOCKS), local_idx)
    else:
        assert torch.equal(merging.src[remote_idx], before[1][local_idx])
        touched, other = merging.src, before[0]
        untouched = np.setdiff1d(np.arange(NUM_BLOCKS), remote_idx)
    assert torch.equal(touched[untouched], other[untouched]), "bytes outside the runs changed"
    assert (handle.num_rows, handle.num_descs, handle.num_bytes) == (113, 5, 113 * BLOCK_BYTES)
    assert "num_descs=5 of 113 rows" in repr(handle)
    assert (merging.decode.num_rows_posted, merging.decode.num_descriptors_posted) == (113, 5)
    telemetry = merging.decode.telemetry(handle)
    assert telemetry is not None and (telemetry.num_descs, telemetry.num_bytes) == (
        5,
        113 * BLOCK_BYTES,
    )
    handle.release()
    assert merging.decode.num_live_handles == 0


def test_no_runs_post_by_index_even_when_merging(merging: Pair) -> None:
    shuffled = np.random.default_rng(3).permutation(NUM_BLOCKS)[:64]
    reverse = shuffled[::-1].copy()
    handle = merging.decode.read(merging.local, shuffled, merging.remote, reverse)
    _wait(merging.decode, handle, merging.prefill)
    assert torch.equal(merging.dst[shuffled], merging.src[reverse])
    assert (handle.num_rows, handle.num_descs) == (64, 64)


def test_by_default_rows_post_by_index_and_nixl_coalesces_them() -> None:
    """What the default (MergeRuns.OFF) hands NIXL: every row; NIXL itself still moves a
    run as one descriptor, which is why merging does not change the copy."""
    assert NixlEngineConfig(agent_name="x").merge is MergeRuns.OFF
    for pair in _merge_pair(MergeRuns.OFF):
        handle = pair.decode.read(pair.local, np.arange(100, 300), pair.remote, np.arange(200))
        _wait(pair.decode, handle, pair.prefill)
        assert torch.equal(pair.dst[100:300], pair.src[:200])
        assert (handle.num_rows, handle.num_descs) == (200, 200)
        assert (pair.decode.num_rows_posted, pair.decode.num_descriptors_posted) == (200, 200)
        telemetry = pair.decode.telemetry(handle)
        assert telemetry is not None and telemetry.num_descs == 1


def test_touching_registrations_never_merge() -> None:
    """Two local registrations that happen to touch (views of one allocation here): a run
    of rows across their boundary is two descriptors, one per registration."""
    big = torch.zeros(2 * 64, BLOCK_BYTES, dtype=torch.uint8)
    src = torch.randint(0, 256, (128, BLOCK_BYTES), dtype=torch.uint8)
    with (
        NixlTransferEngine(NixlEngineConfig(agent_name=_name("prefill"))) as prefill,
        NixlTransferEngine(
            NixlEngineConfig(agent_name=_name("decode"), merge=MergeRuns.ON)
        ) as decode,
    ):
        prefill.register([src])
        decode.register([big[:64]])
        decode.register([big[64:]])
        peer = decode.add_peer(prefill.metadata())
        local = decode.prep_local(_block_descs(big))
        remote = decode.prep_remote(peer, _block_descs(src))
        assert local.adjacent[:63].all() and not local.adjacent[63] and local.adjacent[64:127].all()
        handle = decode.read(local, np.arange(60, 70), remote, np.arange(10, 20))
        _wait(decode, handle, prefill)
        assert torch.equal(big[60:70], src[10:20])
        assert (handle.num_rows, handle.num_descs) == (10, 2)


def test_a_slow_nixl_call_is_logged_by_name(caplog: pytest.LogCaptureFixture) -> None:
    """A NIXL call that blocks (one waiting on the peer's UCX worker) holds up the thread
    that made it, often the engine's step: it is logged with its name and duration."""
    from kvbridge.connector.transfer.nixl_calls import SLOW_CALL_S, nixl_call

    ticks = iter([10.0, 10.0 + SLOW_CALL_S + 59.0, 20.0, 20.1])
    with caplog.at_level("WARNING", logger="kvbridge.connector.transfer.nixl_calls"):
        with nixl_call("agent 'd': make_connection 'p'", clock=lambda: next(ticks)):
            pass
        with nixl_call("agent 'd': get_notifs", clock=lambda: next(ticks)):
            pass
    [record] = caplog.records
    assert "make_connection 'p' took 60.0 s" in record.getMessage()


def test_a_slow_call_says_whether_its_thread_worked_waited_for_a_cpu_or_was_blocked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The 59.6 s ``add_peer`` CI saw on loopback was never explained: a diagnosed call's
    line splits its time into on a CPU, runnable waiting for one (starved) and blocked, from
    the thread's own scheduler figures."""
    from kvbridge.connector.transfer.nixl_calls import nixl_call

    if not Path("/proc/thread-self/schedstat").exists():
        pytest.skip("no /proc/thread-self/schedstat here")
    with caplog.at_level("WARNING", logger="kvbridge.connector.transfer.nixl_calls"):
        with nixl_call("agent 'd': add_peer (1 bytes)", slow_s=0.2, diagnose=True):
            threading.Event().wait(0.3)  # asleep: blocked, not on a CPU
    [record] = caplog.records
    message = record.getMessage()
    assert f"thread {threading.current_thread().name}, nice " in message
    figures = re.search(
        r"([\d.]+) s on a CPU, ([\d.]+) s runnable waiting for one, ([\d.]+) s blocked", message
    )
    assert figures is not None, message
    on_cpu, _waiting, blocked = (float(f) for f in figures.groups())
    assert blocked >= 0.25 and on_cpu < 0.1, message
