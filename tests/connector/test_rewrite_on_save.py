"""Permute after save, really after save (``extra.rewrite_on_save``): prefill rewrites a
kept request's blocks into its last reader's format as soon as they are added, so that
reader's ``Prepare`` finds them ready; a reader that wants another format (or none) gets
them restored first. Two real connectors in one process, real NIXL."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kvbridge.layouts.allocation import CacheFormat, read_group_token_major
from kvbridge.layouts.layout import KVLayout
from tests.connector.pair_harness import (
    FakeClock,
    Request,
    Side,
    decode_admit,
    loaded,
    make_side,
    prefill_finish,
    run_until,
    token_ids,
)
from tests.connector.test_push_pair import _finish_decode, _pools_full, _remote_decode

PREFILL_FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
HND_FMT = CacheFormat(layout=KVLayout.HND, kernel_block_size=8)  # needs a sender rewrite


@pytest.fixture
def sides() -> Iterator[Callable[..., Side]]:
    clock = FakeClock()
    made: list[Side] = []

    def make(role: str, name: str, block_size: int, fmt: CacheFormat, **extra) -> Side:
        lease = {"lease_s": 30.0} if role == "kv_producer" else {}
        made.append(make_side(role, name, block_size, fmt, "F", clock, extra=extra, **lease))
        return made[-1]

    try:
        yield make
    finally:
        for side in reversed(made):
            side.worker.shutdown()


def _load(prefill: Side, decode: Side, n: int, seed: int) -> tuple[Request, Request]:
    p = Request(f"p{seed}", token_ids(n, seed), _remote_decode())
    params = prefill_finish(prefill, p)
    prefill.step()  # the worker is handed the request: rewritten now, if it learned how
    d = Request(f"d{seed}", p.prompt_token_ids, params)
    assert decode_admit(decode, d) == n - 1
    run_until(
        [prefill, decode],
        lambda: loaded(decode, d.request_id) and p.request_id in prefill.freed,
        f"load {d.request_id}",
    )
    return p, d


def _same_kv(prefill: Side, decode: Side, p: Request, d: Request, tokens: int) -> bool:
    want = read_group_token_major(prefill.buffers, 0, np.array(p.block_ids[0]))
    got = read_group_token_major(decode.buffers, 0, np.array(d.block_ids[0]))
    return torch.equal(got[:, :, :tokens], want[:, :, :tokens])


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_second_request_is_rewritten_before_its_reader_asks(sides, mode):
    prefill = sides(
        "kv_producer", "prefill", 64, PREFILL_FMT, rewrite_on_save=True, transfer_mode=mode
    )
    decode = sides("kv_consumer", "decode", 16, HND_FMT, transfer_mode=mode)
    first = _load(prefill, decode, 200, seed=1)
    m = prefill.worker.metrics
    assert (m.eager_hits, m.eager_misses) == (0, 0)  # nothing learned before the first
    rewrites = m.sender_rewrites
    second = _load(prefill, decode, 260, seed=2)
    assert (m.eager_hits, m.eager_misses) == (1, 0)
    assert m.sender_rewrites > rewrites and m.sender_restores == m.sender_rewrites
    for p, d, n in ((*first, 199), (*second, 259)):
        assert _same_kv(prefill, decode, p, d, n)  # prefill restored: its bytes are the truth
        _finish_decode(decode, d)
    _pools_full(prefill, decode)


def test_a_reader_that_needs_no_rewrite_claims_and_gets_the_native_blocks(sides):
    """Prefill learned HND from one decode; a decode of prefill's own format must not read
    the guess: it claims the blocks (empty Prepare), prefill restores them, it reads."""
    prefill = sides("kv_producer", "prefill", 64, PREFILL_FMT, rewrite_on_save=True)
    hnd = sides("kv_consumer", "decode-hnd", 16, HND_FMT)
    same = sides("kv_consumer", "decode-same", 64, PREFILL_FMT)
    a = _load(prefill, hnd, 200, seed=3)
    b = _load(prefill, same, 200, seed=4)  # rewritten on save as HND, then restored
    m = prefill.worker.metrics
    assert (m.eager_hits, m.eager_misses) == (0, 1)
    assert same.worker.metrics.notifications_sent >= 2  # its claim, and Done
    assert _same_kv(prefill, hnd, *a, 199) and _same_kv(prefill, same, *b, 199)
    _finish_decode(hnd, a[1])
    _finish_decode(same, b[1])
    _pools_full(prefill, hnd, same)
