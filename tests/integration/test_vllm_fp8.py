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

from kvbridge.examples.vllm.client import Completion, compare, complete, make_prompts
from kvbridge.examples.vllm.metrics import kvbridge_delta as _delta
from kvbridge.examples.vllm.metrics import kvbridge_deltas as _deltas
from kvbridge.examples.vllm.metrics import scrape
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import Service, start_all, stop_all
from kvbridge.examples.vllm.servers import ServerSpec, vllm_service
from tests.verified_loads import verifying

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_TOKENS = 8
LOGPROB_TOL = 1e-4
TIMEOUT_S = 120.0
BLOCK = 32
BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 1  # tiny-llama: layers x K,V x kv heads x head dim x fp8


def _spec(name: str, cache_dtype: str) -> ServerSpec:
    return ServerSpec(
        name,
        ensure_model("tiny-llama"),
        block_size=BLOCK,
        connector="kvbridge",
        role="both",
        kv_extra=verifying({"lease_s": 30, "heartbeat_s": 3}),
        failure_policy="recompute",
        max_model_len=2048,
        enforce_eager=True,
        extra_args=("--kv-cache-dtype", cache_dtype),
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("vllm-fp8-logs")
    specs = [_spec("E4a", "fp8"), _spec("E4b", "fp8"), _spec("E5", "fp8_e5m2")]
    services = {s.name: vllm_service(s, logs, slot=i) for i, s in enumerate(specs)}
    try:
        start_all(list(services.values()), timeout_s=900)
        yield services
    finally:
        stop_all(list(services.values()))


def _run(server: Service, prompt: list[int], **extra) -> Completion:
    return complete(
        server.url,
        ensure_model("tiny-llama").name,
        prompt,
        max_tokens=MAX_TOKENS,
        timeout_s=TIMEOUT_S,
        extra=extra,
    )


def _pd(prefill: Service, decode: Service, prompt: list[int]) -> Completion:
    first = complete(
        prefill.url,
        ensure_model("tiny-llama").name,
        prompt,
        max_tokens=1,
        timeout_s=TIMEOUT_S,
        extra={"kv_transfer_params": {"do_remote_decode": True}},
    )
    assert first.kv_transfer_params and first.kv_transfer_params["do_remote_prefill"]
    return _run(decode, prompt, kv_transfer_params=first.kv_transfer_params)


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
        _assert_same(_run(prefill, p), g)  # the same fp8 cache, computed in one server
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
    _assert_same(_run(decode, make_prompts(1, 200, seed=8081)[0]), got)
