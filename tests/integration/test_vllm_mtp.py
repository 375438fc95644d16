"""kvbridge inside real vLLM API servers with speculative decoding (MTP).

``tiny-mimo`` (vLLM's ``MiMoForCausalLM``: a 4-layer Qwen2 body and one multi-token
prediction layer, ``num_nextn_predict_layers`` 1) drafts with its MTP layer
(``--speculative-config {"method": "mtp", "num_speculative_tokens": 1}``, vLLM's
``MiMoMTP``), whose attention keeps its KV cache beside the target's, in the same
KV-cache group; vLLM hands it to the connector with the target's layers. Servers,
kv_both, block 32, pull:

    M1 M2

- M1 -> M2: all five layers' KV crosses (four target, one MTP), verified by prefill's
  digests; decode's greedy output and logprobs equal M1's own with the same speculative
  config, and decode drafted (vLLM's spec-decode counters moved).

The MTP layer's weights are random, so vLLM accepts few of its tokens: greedy output is
the target's either way, which is what makes it comparable; that the MTP layer's KV is
right is shown by the digests (every row decode holds is prefill's), not by acceptance.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvbridge.examples.vllm.client import make_prompts
from kvbridge.examples.vllm.procs import Service
from tests.integration.vllm_both import check_speculative_pd, serving, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODEL = "tiny-mimo"


@pytest.fixture(scope="module")
def servers(vllm_pool, tmp_path_factory) -> Iterator[dict[str, Service]]:
    speculative = {"method": "mtp", "num_speculative_tokens": 1}
    args = ("--speculative-config", json.dumps(speculative))
    specs = [spec(name, model=MODEL, extra_args=args) for name in ("M1", "M2")]
    with serving(vllm_pool, specs, tmp_path_factory.mktemp("vllm-mtp-logs")) as running:
        yield running


def test_the_mtp_layers_kv_moves_with_the_targets_and_decode_equals_one_server(servers):
    prefill, decode = servers["M1"], servers["M2"]
    check_speculative_pd(prefill, decode, make_prompts(2, 300, seed=9090), model=MODEL)
