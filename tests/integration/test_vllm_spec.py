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

from kvbridge.examples.vllm.client import make_prompts
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import Service
from tests.integration.vllm_both import check_speculative_pd, serving, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


@pytest.fixture(scope="module")
def servers(vllm_pool, tmp_path_factory) -> Iterator[dict[str, Service]]:
    speculative = {
        "method": "eagle",
        "model": str(ensure_model("tiny-eagle")),
        "num_speculative_tokens": 2,
    }
    args = ("--speculative-config", json.dumps(speculative))
    specs = [spec(name, extra_args=args) for name in ("S1", "S2")]
    with serving(vllm_pool, specs, tmp_path_factory.mktemp("vllm-spec-logs")) as running:
        yield running


def test_the_draft_models_kv_moves_with_the_targets_and_decode_equals_one_server(servers):
    prefill, decode = servers["S1"], servers["S2"]
    check_speculative_pd(prefill, decode, make_prompts(2, 300, seed=9090))
