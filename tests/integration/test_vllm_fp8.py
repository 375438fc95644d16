"""kvbridge inside real vLLM API servers with fp8 KV caches (``--kv-cache-dtype``).

vLLM stores every fp8 variant as ``torch.uint8``; kvbridge compares the element format
(``connector/vllm/translate.py`` ``kv_element_format``), not the storage dtype. Servers,
all kv_both, tiny-llama, block 32, pull, per-tensor scales (1.0: the checkpoint has none):

    E4a E4b   --kv-cache-dtype fp8 (e4m3)
    E5        --kv-cache-dtype fp8_e5m2

- E4a -> E4b: one byte per element crosses; decode's output and logprobs equal E4a's own
  (the same fp8 cache computed in one server);
- E4a -> E5: refused by name at the handshake (the bytes would be read as another
  format), the prompt computed on E5, exactly as E5 alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.examples.vllm.client import Completion, compare, make_prompts
from kvbridge.examples.vllm.procs import Service
from kvbridge.examples.vllm.scraped_metrics import kvbridge_delta as _delta
from kvbridge.examples.vllm.scraped_metrics import kvbridge_deltas as _deltas
from kvbridge.examples.vllm.scraped_metrics import scrape
from tests.integration.vllm_both import BLOCK, prefilled, run, serving, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

LOGPROB_TOL = 1e-4
BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 1  # tiny-llama: layers x K,V x kv heads x head dim x fp8


@pytest.fixture(scope="module")
def servers(vllm_pool, tmp_path_factory) -> Iterator[dict[str, Service]]:
    specs = [
        spec(name, extra_args=("--kv-cache-dtype", dtype))
        for name, dtype in (("E4a", "fp8"), ("E4b", "fp8"), ("E5", "fp8_e5m2"))
    ]
    with serving(vllm_pool, specs, tmp_path_factory.mktemp("vllm-fp8-logs")) as running:
        yield running


def _pd(prefill: Service, decode: Service, prompt: list[int]) -> Completion:
    return run(decode, prompt, kv_transfer_params=prefilled(prefill, prompt))


def _assert_same(reference: Completion, got: Completion) -> None:
    cmp = compare(reference, got)
    assert cmp.first_mismatch is None, f"tokens differ at {cmp.first_mismatch}"
    assert cmp.max_logprob_diff <= LOGPROB_TOL, cmp


def test_an_fp8_cache_moves_as_fp8_and_decode_equals_a_single_server(servers):
    prefill, decode = servers["E4a"], servers["E4b"]
    prompts = make_prompts(2, 300, seed=8080)
    before = scrape(decode.url)
    got = [_pd(prefill, decode, p) for p in prompts]
    after = scrape(decode.url)
    for p, g in zip(prompts, got, strict=True):
        _assert_same(run(prefill, p), g)  # the same fp8 cache, computed in one server
    moved = str(_deltas(before, after))
    assert _delta(before, after, "loads_loaded") == len(prompts), moved
    assert _delta(before, after, "loads_verified") == len(prompts), moved
    pages = sum(-(-(len(p) - 1) // BLOCK) for p in prompts)
    assert _delta(before, after, "bytes_read") == pages * BLOCK * BYTES_PER_TOKEN, moved


def test_fp8_formats_that_differ_are_refused_by_name_and_computed_locally(servers):
    prefill, decode = servers["E4a"], servers["E5"]
    prompt = make_prompts(1, 200, seed=8081)[0]
    before = scrape(decode.url)
    got = _pd(prefill, decode, prompt)
    after = scrape(decode.url)
    moved = str(_deltas(before, after))
    assert _delta(before, after, "loads_loaded") == 0, moved
    assert _delta(before, after, "bytes_read") == 0, moved
    log = decode.log_tail(400)
    assert "fp8_e4m3" in log and "fp8_e5m2" in log, log[-3000:]
    _assert_same(run(decode, make_prompts(1, 200, seed=8081)[0]), got)
