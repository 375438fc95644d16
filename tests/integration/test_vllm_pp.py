"""kvbridge inside real vLLM API servers with pipeline parallelism
(``--pipeline-parallel-size``).

Each pipeline stage registers only its layers; a stage's side channel listens at
``kv_port + pp_rank * tp_size + tp_rank``, the params list every prefill stage's layers,
and a decode stage reads from each prefill stage that holds some of its layers exactly
those layers (``kvbridge.handshake.layer_window``). Servers, kv_both, tiny-llama (4
layers), block 32, pull, every load verified:

    A     PP 2, vLLM's split: layers 0-1 | 2-3
    B     PP 2, VLLM_PP_LAYER_PARTITION=1,3: layers 0 | 1-3 (the same size, split
          differently)
    C     PP 1

- A -> C: one decode stage reads both prefill stages;
- C -> A: both decode stages read the one prefill rank, which frees after both said Done;
- A -> B: equal PP sizes whose layers split differently: B's stage 1 reads from both of A's.

Every pair's greedy output and logprobs equal one server's, and the bytes and
descriptors that moved are those of the prompt's every page of every layer, once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.examples.vllm.client import compare, make_prompts
from kvbridge.examples.vllm.procs import Service
from kvbridge.examples.vllm.scraped_metrics import kvbridge_delta as _delta
from kvbridge.examples.vllm.scraped_metrics import kvbridge_deltas as _deltas
from kvbridge.examples.vllm.scraped_metrics import scrape
from tests.integration.vllm_both import BLOCK, LOGPROB_TOL, prefilled, run, serving, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

LAYERS = 4
PAGE_BYTES = 2 * BLOCK * 2 * 32 * 4  # K,V x tokens x kv heads x head dim x fp32
PAIRS = [("A", "C"), ("C", "A"), ("A", "B")]
# vLLM's CPU build allocates the buffers a later stage receives its input in only while it
# compiles the model: with --enforce-eager the first request of a PP 2 server dies in
# sync_and_gather_intermediate_tensors (assert self.intermediate_tensors is not None). A
# graph traced once and run by torch's eager backend allocates them and compiles in seconds.
PP_SERVER = {
    "pipeline_parallel_size": 2,
    "enforce_eager": False,
    "extra_args": ("--compilation-config", '{"mode": 2, "backend": "eager"}'),
}
SEEDS = {pair: 7100 + i for i, pair in enumerate(PAIRS)}


@pytest.fixture(scope="module")
def servers(vllm_pool, tmp_path_factory) -> Iterator[dict[str, Service]]:
    specs = [
        spec("A", fixed_kv_port=True, **PP_SERVER),
        spec("B", env={"VLLM_PP_LAYER_PARTITION": "1,3"}, **PP_SERVER),
        spec("C"),
    ]
    with serving(vllm_pool, specs, tmp_path_factory.mktemp("vllm-pp-logs")) as running:
        yield running


def test_a_pipeline_parallel_prefill_advertises_every_stage(servers):
    a = servers["A"]
    base = a.launch.details["kv_transfer_config"]["kv_port"]  # type: ignore[index]
    params = prefilled(a, make_prompts(1, 80, seed=11)[0])
    assert params["remote_pp_layers"] == [[0, 2], [2, 4]], params
    assert params["remote_tp_size"] == 1 and params["remote_port"] == base, (base, params)


@pytest.mark.parametrize(("p", "d"), PAIRS, ids=[f"{p}->{d}" for p, d in PAIRS])
def test_pipeline_stages_load_every_layer_and_decode_as_one_server(servers, p, d):
    prefill, decode = servers[p], servers[d]
    prompts = make_prompts(3, 150, seed=SEEDS[(p, d)])
    before = scrape(decode.url)
    got = [run(decode, x, kv_transfer_params=prefilled(prefill, x)) for x in prompts]
    after = scrape(decode.url)
    moved = str(_deltas(before, after))
    assert _delta(before, after, "loads_loaded") == len(prompts), moved
    # each decode worker (every stage) verifies its own layers of every load
    stages = 1 if d == "C" else 2
    assert _delta(before, after, "loads_verified") == stages * len(prompts), moved
    pages = sum(-(-(len(x) - 1) // BLOCK) for x in prompts)
    assert _delta(before, after, "descriptors_posted") == pages * LAYERS, moved
    assert _delta(before, after, "bytes_read") == pages * LAYERS * PAGE_BYTES, moved
    for x, g in zip(prompts, got, strict=True):
        cmp = compare(run(servers["C"], x), g)  # one server, no pipeline stages
        assert cmp.first_mismatch is None and cmp.max_logprob_diff <= LOGPROB_TOL, cmp
