"""The pure helpers of scripts/experiments/bench_layer_push.py: descriptor rows that pick
one layer's page of a block the same way in per-layer and cross-layer caches, and the
overlap model."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.layouts.descriptors import piece_indices
from scripts.experiments.bench_layer_push import Setup, hidden_fraction, ideal_layered_s, page_rows

SMALL = dict(layers=3, hidden=32, heads=2, kv_heads=2, head_size=8, intermediate=32)


@pytest.mark.parametrize("cross_layer", [False, True])
def test_page_rows_pick_layer_l_of_each_block(cross_layer: bool) -> None:
    buffers = Setup(**SMALL, max_tokens=64, cross_layer=cross_layer).buffers()
    names = buffers.config.layer_names
    rows = page_rows(buffers.regions(), len(names))
    assert rows.shape == (buffers.config.num_blocks * len(names), 3)
    assert (rows[:, 1] == buffers.config.page_size_bytes).all()
    ids = np.array([4, 0, 2])
    want = [[buffers.layer_bytes(n)[b].data_ptr() for n in names] for b in ids]
    for layer in range(len(names)):
        picked = rows[piece_indices(ids, len(names), [layer])][:, 0]
        assert picked.tolist() == [w[layer] for w in want]
    every = rows[piece_indices(ids, len(names))][:, 0]
    assert every.tolist() == [a for w in want for a in w]  # block-major, layers in order


def test_ideal_layered_leaves_one_layer_of_the_shorter_side_exposed() -> None:
    assert ideal_layered_s(100.0, 10.0, 10) == pytest.approx(101.0)  # F + T/L
    assert ideal_layered_s(10.0, 100.0, 10) == pytest.approx(101.0)  # F/L + T
    assert ideal_layered_s(50.0, 50.0, 1) == pytest.approx(100.0)  # one layer: serial


def test_hidden_fraction_against_the_same_rounds_request() -> None:
    assert hidden_fraction(110.0, 10.0, 110.0) == 0.0  # no gain
    assert hidden_fraction(110.0, 10.0, 100.0) == 1.0  # the transfer cost nothing
    assert hidden_fraction(110.0, 10.0, 115.0) == pytest.approx(-0.5)  # (b) lost
