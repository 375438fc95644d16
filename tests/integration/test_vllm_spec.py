"""kvbridge inside real vLLM API servers with speculative decoding (EAGLE).

vLLM's EAGLE draft (``tiny-eagle``: one decoder layer over tiny-llama's hidden states)
keeps its KV cache beside the target's: its layer continues the target's numbering
(``model.layers.4``) in the same KV-cache group, and vLLM hands it to the connector with
the target's layers. Servers, kv_both, tiny-llama, block 32, pull, both with
``--speculative-config {"method": "eagle", "num_speculative_tokens": 2, ...}``:

    S1 S2

- S1 -> S2: all five layers' KV crosses (four target, one draft), verified by prefill's
  digests; decode's greedy output and logprobs equal S1's own with the same speculative
  config, and decode drafted (vLLM's spec-decode counters moved).

The draft's weights are random, so vLLM accepts none of its tokens: greedy output is the
target's either way, which is what makes it comparable; that the draft's KV is right is
shown by the digests (every row decode holds is prefill's), not by acceptance.
"""

from __future__ import annotations

import json
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
LAYERS = 4 + 1  # tiny-llama's four, the draft's one
PAGE_BYTES = 2 * BLOCK * 2 * 32 * 4  # K,V x tokens x kv heads x head dim x fp32


def _spec(name: str) -> ServerSpec:
    speculative = {
        "method": "eagle",
        "model": str(ensure_model("tiny-eagle")),
        "num_speculative_tokens": 2,
    }
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
        extra_args=("--speculative-config", json.dumps(speculative)),
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("vllm-spec-logs")
    services = {n: vllm_service(_spec(n), logs, slot=i) for i, n in enumerate(("S1", "S2"))}
    try:
        start_all(list(services.values()), timeout_s=900)
        yield services
    finally:
        stop_all(list(services.values()))


def _run(server: Service, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra) -> Completion:
    return complete(
        server.url, "tiny-llama", prompt, max_tokens=max_tokens, timeout_s=TIMEOUT_S, extra=extra
    )


def test_the_draft_models_kv_moves_with_the_targets_and_decode_equals_one_server(servers):
    prefill, decode = servers["S1"], servers["S2"]
    prompts = make_prompts(2, 300, seed=9090)
    before = scrape(decode.url)
    got = []
    for p in prompts:
        first = _run(prefill, p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert first.kv_transfer_params and first.kv_transfer_params["do_remote_prefill"]
        got.append(_run(decode, p, kv_transfer_params=first.kv_transfer_params))
    after = scrape(decode.url)
    for p, g in zip(prompts, got, strict=True):
        cmp = compare(_run(prefill, p), g)  # one server, the same speculative config
        assert cmp.first_mismatch is None and cmp.max_logprob_diff <= LOGPROB_TOL, cmp
    moved = str(_deltas(before, after))
    assert _delta(before, after, "loads_loaded") == len(prompts), moved
    assert _delta(before, after, "loads_verified") == len(prompts), moved
    pages = sum(-(-(len(p) - 1) // BLOCK) for p in prompts)
    assert _delta(before, after, "descriptors_posted") == pages * LAYERS, moved
    assert _delta(before, after, "bytes_read") == pages * LAYERS * PAGE_BYTES, moved
    drafted = after.get("vllm:spec_decode_num_draft_tokens_total", 0.0) - before.get(
        "vllm:spec_decode_num_draft_tokens_total", 0.0
    )
    assert drafted > 0, "decode did not draft: speculative decoding was not on"
