"""The tiny model family: paged forward == dense reference on cross-layer strided views."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.examples.model import (
    MODEL_NAMES,
    ModelCaches,
    ModelConfig,
    ModelConfigError,
    SeqInput,
    TinyModel,
)
from kvbridge.examples.paged_attention import AttentionCache, KVLayout, to_kernel_block_ids
from kvbridge.examples.state_layer import StateCache
from kvbridge.examples.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from kvbridge.layouts.errors import BlockIdError, LayoutError
from kvbridge.layouts.specs import FullAttentionSpec, KVCacheKind, SlidingWindowSpec, StateSpec

# Far below what one wrong block does (see the corruption tests), above float32 noise
# from matmuls of different shapes.
ATOL, RTOL = 5e-5, 1e-5
NUM_BLOCKS = 48
TEXT = "Prefill computes the prompt; decode continues from its KV cache. " * 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny ops: handing them to a second thread costs more than it saves."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def model(name: str) -> TinyModel:
    return TinyModel.from_name(name)


def token_ids(n: int, shift: int = 0) -> list[int]:
    return ByteTokenizer().encode(TEXT[shift:])[:n]


def cross_layer_caches(
    config: ModelConfig, *, block_size: int, kernel_block_size: int, layout: KVLayout
) -> tuple[ModelCaches, torch.Tensor]:
    """Every layer's page of block b side by side in row b of one int8 buffer::

    row b: [ layer0 page | layer1 page | ... ]   attention page = [ K | V ]

    Layers are placed group-major (as ``KVCacheConfig.layer_names``), so the views carved
    out of the buffer are strided, non-contiguous and not in model order.
    """
    specs = config.kv_specs(block_size)
    page = specs[0].page_size_bytes
    assert all(s.page_size_bytes == page for s in specs)
    order = sorted(range(config.num_layers), key=lambda i: config.layer_group_ids[i])
    row = page * config.num_layers // 4  # floats per buffer row
    buf = torch.full((NUM_BLOCKS, row * 4), 0x7F, dtype=torch.int8)  # junk, not zeros
    floats = buf.view(torch.float32)
    r = block_size // kernel_block_size
    h, d = config.num_kv_heads, config.head_size
    inner = (kernel_block_size, h, d) if layout is KVLayout.NHD else (h, kernel_block_size, d)
    layers: dict[int, AttentionCache | StateCache] = {}
    for slot, i in enumerate(order):
        base = slot * page // 4
        if isinstance(specs[i], StateSpec):
            tensors, offset = [], base
            for shape in config.state_shapes:
                strides = (row, *torch.empty(shape).stride())
                tensors.append(floats.as_strided((NUM_BLOCKS, *shape), strides, offset))
                offset += int(np.prod(shape))
            layers[i] = StateCache(tensors=tuple(tensors), block_size=block_size)
            continue
        part = page // 8
        strides = (row, part // r, inner[1] * d, d, 1)
        shape = (NUM_BLOCKS, r, *inner)
        layers[i] = AttentionCache(
            k=floats.as_strided(shape, strides, base),
            v=floats.as_strided(shape, strides, base + part),
            layout=layout,
            kernel_block_size=kernel_block_size,
            block_size=block_size,
        )
    return ModelCaches(layers=tuple(layers[i] for i in range(config.num_layers))), buf


class Request:
    """A request's block tables (random, non-contiguous ids from a shared pool)."""

    def __init__(self, config: ModelConfig, pool: list[int], *, block_size: int, kb: int, n: int):
        per_group = -(-n // block_size)
        self.manager_ids = [
            np.array([pool.pop() for _ in range(per_group)]) for _ in config.group_kinds
        ]
        self.tables = tuple(
            ids if kind is KVCacheKind.STATE else to_kernel_block_ids(ids, block_size, kb)
            for ids, kind in zip(self.manager_ids, config.group_kinds, strict=True)
        )

    def step(self, ids: list[int], start: int, end: int) -> SeqInput:
        return SeqInput(
            token_ids=ids[start:end],
            start_pos=start,
            block_tables=self.tables,
        )


def setup(name: str, block_size: int, kb: int, layout: KVLayout, n: int, seed: int = 0):
    m = model(name)
    caches, buf = cross_layer_caches(
        m.config, block_size=block_size, kernel_block_size=kb, layout=layout
    )
    pool = [int(b) for b in np.random.default_rng(seed).permutation(NUM_BLOCKS)]
    return m, caches, buf, pool


BLOCK_CASES = [(16, 16), (16, 8), (64, 64), (64, 16), (64, 8)]


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("block_size", "kb"), BLOCK_CASES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_paged_forward_matches_dense_reference(name, block_size, kb, layout):
    # Prompts end 3 tokens before a block boundary, so decode crosses it.
    prompt = (3 if block_size == 16 else 2) * block_size - 3
    steps = 6
    n = prompt + steps
    m, caches, _, pool = setup(name, block_size, kb, layout, n)
    ids_a, ids_b = token_ids(n), token_ids(n, shift=7)
    a = Request(m.config, pool, block_size=block_size, kb=kb, n=n)
    b = Request(m.config, pool, block_size=block_size, kb=kb, n=n)
    # A: one prefill chunk. B: chunks at a block multiple and (running state) off one.
    got_a = m.forward([a.step(ids_a, 0, prompt)], caches)
    got_b = [
        m.forward([b.step(ids_b, s, e)], caches)[0]
        for s, e in [(0, block_size), (block_size, block_size + 5), (block_size + 5, prompt)]
    ]
    for p in range(prompt, n):  # batched decode, one token each
        out_a, out_b = m.forward([a.step(ids_a, p, p + 1), b.step(ids_b, p, p + 1)], caches)
        got_a.append(out_a)
        got_b.append(out_b)
    for ids, got in ((ids_a, got_a), (ids_b, got_b)):
        want = m.reference_logits(ids)
        torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_paged_greedy_generation_matches_reference(name):
    m, caches, _, pool = setup(name, 16, 8, KVLayout.HND, 60)
    prompt, max_tokens = token_ids(40), 8
    want = m.greedy_generate_reference(prompt, max_tokens)
    req = Request(m.config, pool, block_size=16, kb=8, n=len(prompt) + max_tokens)
    ids = list(prompt)
    logits = m.forward([req.step(ids, 0, len(ids))], caches)[0]
    for _ in range(max_tokens):
        ids.append(int(logits[-1].argmax()))
        logits = m.forward([req.step(ids, len(ids) - 1, len(ids))], caches)[0]
    assert ids[len(prompt) :] == want
    assert len(set(want)) > 1, "a constant continuation would hide wrong caches"


def corrupt(caches: ModelCaches, config: ModelConfig, group: int, block: int) -> None:
    for i in config.group_layer_ids(group):
        cache = caches.layers[i]
        for t in cache.tensors if isinstance(cache, StateCache) else (cache.k, cache.v):
            t[block] = 0.0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_any_zeroed_block_changes_the_next_logits(name):
    """One block zeroed (every layer of its group) -> logits far outside the tolerance."""
    bs, n = 16, 80
    m, caches, buf, pool = setup(name, bs, 8, KVLayout.NHD, n)
    ids = token_ids(n)
    req = Request(m.config, pool, block_size=bs, kb=8, n=n)
    m.forward([req.step(ids, 0, n - 1)], caches)
    want = m.reference_logits(ids)[-1]
    clean = buf.clone()
    flips = 0
    for group, kind in enumerate(m.config.group_kinds):
        # Blocks whose loss must show: all for full attention, the window for sliding
        # window, the boundary the next chunk starts from for the state group.
        first = {KVCacheKind.SLIDING_WINDOW: (n - 1 - 24) // bs, KVCacheKind.STATE: 3}
        for j in range(first.get(kind, 0), 4 if kind is KVCacheKind.STATE else n // bs):
            corrupt(caches, m.config, group, int(req.manager_ids[group][j]))
            # The state group restarts from the corrupted boundary (after token 4*bs-1).
            start = 4 * bs if kind is KVCacheKind.STATE else n - 1
            got = m.forward([req.step(ids, start, n)], caches)[0][-1]
            diff = (got - want).abs().max().item()
            assert diff > 0.05, f"group {kind.value} block {j}: logits moved only {diff}"
            flips += int(got.argmax() != want.argmax())
            buf.copy_(clean)
    assert flips > 0, "no single corrupted block changed the greedy token"
    got = m.forward([req.step(ids, n - 1, n)], caches)[0][-1]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_blocks_outside_the_window_and_old_states_may_hold_anything():
    name, bs, kb = "tiny-hybrid-state", 16, 8
    n, prompt = 100, 80
    m, caches, _, pool = setup(name, bs, kb, KVLayout.HND, n)
    ids = token_ids(n)
    req = Request(m.config, pool, block_size=bs, kb=kb, n=n)
    m.forward([req.step(ids, 0, prompt)], caches)
    sw, state = (
        m.config.group_kinds.index(k) for k in (KVCacheKind.SLIDING_WINDOW, KVCacheKind.STATE)
    )
    # Sliding window: blocks wholly before the window of the first decode step get NaN,
    # and their table entries a null id (-1); the state group keeps only the last boundary.
    stale_sw = (prompt - m.config.sliding_window + 1) // bs
    for g, stale in ((sw, stale_sw), (state, prompt // bs - 1)):
        for j in range(stale):
            for i in m.config.group_layer_ids(g):
                cache = caches.layers[i]
                views = cache.tensors if isinstance(cache, StateCache) else (cache.k, cache.v)
                for t in views:
                    t[int(req.manager_ids[g][j])] = float("nan")
    r = bs // kb
    tables = list(req.tables)
    tables[sw] = tables[sw].copy()
    tables[sw][: stale_sw * r] = -1
    tables[state] = tables[state].copy()
    tables[state][: prompt // bs - 1] = -1
    req.tables = tuple(tables)
    got = [m.forward([req.step(ids, prompt, prompt + 3)], caches)[0]]
    got += [m.forward([req.step(ids, p, p + 1)], caches)[0] for p in range(prompt + 3, n)]
    want = m.reference_logits(ids)[prompt:]
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=RTOL)


def test_bad_inputs_raise_typed_errors():
    m, caches, _, pool = setup("tiny-hybrid-state", 16, 8, KVLayout.NHD, 40)
    ids = token_ids(40)
    req = Request(m.config, pool, block_size=16, kb=8, n=20)
    with pytest.raises(BlockIdError, match="needs entry"):
        m.forward([req.step(ids, 0, 40)], caches)
    holes = tuple(np.full_like(t, -1) if i == 2 else t for i, t in enumerate(req.tables))
    with pytest.raises(BlockIdError, match="needs the state in entry 0"):
        m.forward([SeqInput(token_ids=ids[5:9], start_pos=5, block_tables=holes)], caches)
    with pytest.raises(LayoutError, match="3 KV-cache groups"):
        m.forward([SeqInput(token_ids=ids[:4], start_pos=0, block_tables=req.tables[:2])], caches)
    wrong = ModelCaches.allocate(
        model("tiny-dense").config,
        num_blocks=4,
        block_size=16,
        kernel_block_size=8,
        layout=KVLayout.NHD,
    )
    with pytest.raises(LayoutError, match="layer caches for 6 layers"):
        m.forward([], wrong)
    with pytest.raises(ModelConfigError, match="tiny-dense"):
        ModelConfig.from_name("huge")


@pytest.mark.parametrize("prompt", [40, 33, 47, 48])
def test_a_snapshot_keeps_the_state_where_decode_resumes(prompt):
    """Prefill keeps the state after ``prompt - 1`` tokens in a resume block; a second
    request resumes from it (copied into the entry of its block of token prompt - 2) and
    computes the last prompt token and on exactly like one run."""
    m, caches, _, pool = setup("tiny-hybrid-state", 16, 8, KVLayout.NHD, 64)
    n = prompt + 4
    ids = token_ids(n)
    state = m.config.group_kinds.index(KVCacheKind.STATE)
    a = Request(m.config, pool, block_size=16, kb=8, n=n)
    resume = pool.pop()
    snap = SeqInput(
        token_ids=ids[:prompt],
        start_pos=0,
        block_tables=a.tables,
        state_snapshot=(prompt - 1, resume),
    )
    m.forward([snap], caches)
    # decode's copy: attention KV as prefill left it, the state from the resume block
    b = Request(m.config, pool, block_size=16, kb=8, n=n)
    tables = list(b.tables)
    for g, table in enumerate(a.tables):
        if g != state:
            tables[g] = table
    b.tables = tuple(tables)
    entry = int(b.manager_ids[state][(prompt - 2) // 16])
    for i in m.config.group_layer_ids(state):
        for t in caches.layers[i].tensors:
            t[entry] = t[resume]
    got = [m.forward([b.step(ids, p, p + 1)], caches)[0] for p in range(prompt - 1, n)]
    want = m.reference_logits(ids)[prompt - 1 :]
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=RTOL)


def test_config_groups_and_specs():
    cfg = ModelConfig.from_name("tiny-hybrid-state")
    assert cfg.group_kinds == (
        KVCacheKind.FULL_ATTENTION,
        KVCacheKind.SLIDING_WINDOW,
        KVCacheKind.STATE,
    )
    assert cfg.layer_group_ids == (0, 2, 1, 0, 2, 1)
    specs = cfg.kv_specs(16)
    assert [type(s) for s in specs] == [
        FullAttentionSpec,
        StateSpec,
        SlidingWindowSpec,
        FullAttentionSpec,
        StateSpec,
        SlidingWindowSpec,
    ]
    assert specs[0].dtype == torch.float32 and specs[2].sliding_window == 24
    assert specs[1].shapes == ((3, 64), (64, 4)) and specs[1].state_bytes == 1792
    assert {s.page_size_bytes for s in specs} == {2 * 16 * 2 * 16 * 4}
    groups = cfg.kv_cache_groups(16)
    assert [g.layer_names for g in groups] == [
        ("layers.0", "layers.3"),
        ("layers.2", "layers.5"),
        ("layers.1", "layers.4"),
    ]
    assert ModelConfig.from_name("tiny-dense").group_kinds == (KVCacheKind.FULL_ATTENTION,)


def test_weights_are_deterministic_per_name():
    ids = token_ids(30)
    for name in MODEL_NAMES:
        a, b = TinyModel.from_name(name), model(name)
        assert torch.equal(a.embed, b.embed) and torch.equal(a.lm_head, b.lm_head)
        assert torch.equal(a.reference_logits(ids), b.reference_logits(ids))
    assert not torch.equal(model("tiny-dense").embed, model("tiny-hybrid").embed)


@given(st.text(max_size=200))
def test_tokenizer_round_trips_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and all(0 <= t < tok.vocab_size for t in ids)
    assert tok.decode(ids) == text
    assert tok.decode([*tok.encode(text, add_bos=False), EOS_ID]) == text
