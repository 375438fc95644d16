"""kvbridge inside real vLLM API servers: speculative decoding on a Mamba2 hybrid.

With speculative decoding vLLM gives each request ``num_speculative_blocks`` scratch blocks
in its Mamba state group after the running state (``mamba_cache_mode`` "none": no prefix
caching). Only the running state moves, as vLLM's NixlConnector keeps it
(``clip_ssm_state_blocks``); the scratch blocks are the engine's own. n-gram speculation
(no draft model) is what vLLM's CPU build runs here. Servers, ``tiny-granite-hybrid``
(Mamba2 layers 0 and 2, attention 1 and 3), kv_both, block 64, pull, both with
``--speculative-config`` n-gram, 2 tokens:

    K1 -> K2: the attention pages and one running state per Mamba layer cross, no scratch
    block; prefill's digests show every byte decode holds is prefill's; decode drafts.

Output is not compared: vLLM's CPU build answers the same greedy request differently run
to run on one server with this speculation and no connector at all
(``scripts/experiments/vllm_mamba_spec_determinism.py``), and so does its NixlConnector
P/D, so no output here can show a moved state right or wrong (``docs/vllm.md``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvbridge.examples.vllm.client import make_prompts
from kvbridge.examples.vllm.procs import Service
from kvbridge.examples.vllm.scraped_metrics import kvbridge_delta as _delta
from kvbridge.examples.vllm.scraped_metrics import kvbridge_deltas as _deltas
from kvbridge.examples.vllm.scraped_metrics import scrape
from tests.integration.vllm_both import DRAFTS, prefilled, run, serving, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODEL = "tiny-granite-hybrid"
BLOCK = 64
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
ARGS = ("--no-enable-prefix-caching", "--speculative-config", json.dumps(NGRAM))
# attention layers 1 and 3: 2 layers x K,V x 2 KV heads x head dim 32 x fp32
ATTN_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
# per Mamba2 layer, fp32 (tests/integration/test_vllm_state.py): while speculating the conv
# state keeps d_conv - 1 + num_speculative_tokens rows of 288, the SSM state 4 x 64 x 16
STATE_BYTES = 2 * ((3 + NGRAM["num_speculative_tokens"]) * 288 + 4 * 64 * 16) * 4


@pytest.fixture(scope="module")
def servers(vllm_pool, tmp_path_factory) -> Iterator[dict[str, Service]]:
    specs = [spec(n, model=MODEL, block_size=BLOCK, extra_args=ARGS) for n in ("K1", "K2")]
    with serving(vllm_pool, specs, tmp_path_factory.mktemp("vllm-mamba-spec-logs")) as running:
        yield running


def _repeating(seed: int) -> list[int]:
    """A unique start, then one phrase four times (n-gram lookup finds it)."""
    start, phrase = make_prompts(2, 24, seed=seed)
    return start + phrase[1:] * 4


def test_only_the_running_state_moves_byte_for_byte_and_decode_drafts(servers):
    prompts = [_repeating(seed) for seed in (9301, 9302)]
    decode = servers["K2"]
    before = scrape(decode.url)
    for p in prompts:
        params = prefilled(servers["K1"], p, model=MODEL)
        # a state model's prefill stops one token short: decode resumes from that state
        assert (params["num_tokens"], params["resume_tokens"]) == (len(p), len(p) - 1)
        # no logprobs: in one full CI run (not in seven alone) decode answered HTTP 400 "Out
        # of range float values are not JSON compliant" (an inf or NaN logprob under n-gram
        # speculation); the loads are verified byte for byte below, the output not compared
        got = run(decode, p, model=MODEL, kv_transfer_params=params, logprobs=None)
        assert len(got.token_ids) == 8, got
    after = scrape(decode.url)
    moved = str(_deltas(before, after))
    assert _delta(before, after, "loads_loaded") == len(prompts), moved
    assert _delta(before, after, "loads_verified") == len(prompts), moved
    # whole attention pages up to the resume point and one running state per Mamba layer
    # and load: no scratch block crossed
    pages = sum(-(-(len(p) - 1) // BLOCK) for p in prompts)
    want = pages * BLOCK * ATTN_BYTES_PER_TOKEN + len(prompts) * STATE_BYTES
    assert _delta(before, after, "bytes_read") == want, moved
    assert after.get(DRAFTS, 0.0) > before.get(DRAFTS, 0.0), "decode did not draft"
