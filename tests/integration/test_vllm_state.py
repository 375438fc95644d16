"""kvbridge inside real vLLM API servers with a Mamba2 hybrid model: P/D output equals a
single server.

``tiny-granite-hybrid`` (vLLM's GraniteMoeHybrid: Mamba2 layers 0 and 2, attention layers 1
and 3) gives vLLM two KV-cache groups: a Mamba state group (conv + SSM state per block,
the page padded to the attention page) and full attention. Servers, all kv_both:

    S64 S128    pull; no prefix caching: vLLM keeps one state block per request
                (``mamba_cache_mode`` "none")
    Q64 Q128    push: prefill WRITEs both groups into decode's blocks
    A128        pull, prefix caching on (``mamba_cache_mode`` "align": a state block per
                block of tokens, the running state in the block of the last token)

A prefill of a state model computes every prompt token but the last (decode resumes from
the state after N - 1 tokens). vLLM's CPU build itself crashes in its Mamba2 prefill in
"align" mode once a prompt passes one block (``IndexError`` in
``mamba_mixer2.conv_ssm_forward``, with no connector at all), so A128 serves prompts
shorter than its block. The reference for a pair is the decode server computing the
prompt itself; prompts are unique per test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.examples.vllm.client import Completion, compare, complete, make_prompts
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import Service
from kvbridge.examples.vllm.scraped_metrics import kvbridge_delta as _delta
from kvbridge.examples.vllm.scraped_metrics import kvbridge_deltas as _deltas
from kvbridge.examples.vllm.scraped_metrics import scrape
from kvbridge.examples.vllm.servers import ServerSpec
from tests.integration.vllm_pool import ServerPool
from tests.verified_loads import verifying

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_TOKENS = 8
LOGPROB_TOL = 1e-4
TIMEOUT_S = 120.0
# attention layers 1 and 3: 2 layers x K,V x 2 KV heads x head dim 32 x fp32
ATTN_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
# per Mamba2 layer, fp32: conv state (d_conv - 1) x (expand * hidden + 2 * groups * d_state)
# = 3 x 288, SSM state heads x head dim x d_state = 4 x 64 x 16; layers 0 and 2
STATE_BYTES = 2 * (3 * 288 + 4 * 64 * 16) * 4


def _spec(name: str, block_size: int, mode: str, prefix_caching: bool = False) -> ServerSpec:
    return ServerSpec(
        name,
        ensure_model("tiny-granite-hybrid"),
        block_size=block_size,
        connector="kvbridge",
        role="both",
        # kv_both: as decode it verifies every load (tests/verified_loads.py)
        kv_extra=verifying({"lease_s": 30, "heartbeat_s": 3, "extra": {"transfer_mode": mode}}),
        failure_policy="fail",
        max_model_len=2048,
        enforce_eager=True,
        extra_args=() if prefix_caching else ("--no-enable-prefix-caching",),
    )


@pytest.fixture(scope="module")
def servers(vllm_pool: ServerPool, tmp_path_factory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("vllm-state-logs")
    specs = [
        _spec("S64", 64, "pull"),
        _spec("S128", 128, "pull"),
        _spec("Q64", 64, "push"),
        _spec("Q128", 128, "push"),
        _spec("A128", 128, "pull", prefix_caching=True),
    ]
    with vllm_pool.serving(specs, logs) as running:
        yield running


def _run(server: Service, prompt: list[int], **extra) -> Completion:
    return complete(
        server.url,
        "tiny-granite-hybrid",
        prompt,
        max_tokens=MAX_TOKENS,
        timeout_s=TIMEOUT_S,
        extra=extra,
    )


def _pd(prefill: Service, decode: Service, prompt: list[int]) -> Completion:
    first = complete(
        prefill.url,
        "tiny-granite-hybrid",
        prompt,
        max_tokens=1,
        timeout_s=TIMEOUT_S,
        extra={"kv_transfer_params": {"do_remote_decode": True}},
    )
    params = first.kv_transfer_params
    assert params and params["do_remote_prefill"], first
    # the params describe the whole prompt; prefill computed all of it but the last token
    assert (params["num_tokens"], params["resume_tokens"]) == (len(prompt), len(prompt) - 1)
    return _run(decode, prompt, kv_transfer_params=params)


def _check(
    servers: dict[str, Service], prefill: str, decode: str, prompts: list[list[int]]
) -> tuple[dict[str, float], dict[str, float]]:
    """P/D for every prompt, then the decode server alone as the reference; returns the
    decode server's metrics before and after the P/D requests."""
    before = scrape(servers[decode].url)
    got = [_pd(servers[prefill], servers[decode], p) for p in prompts]
    after = scrape(servers[decode].url)
    moved = _deltas(before, after)
    assert _delta(before, after, "loads_loaded") == len(prompts), moved
    assert _delta(before, after, "loads_recomputed") == 0, moved
    for prompt, pd in zip(prompts, got, strict=True):
        cmp = compare(_run(servers[decode], prompt), pd)
        assert cmp.first_mismatch is None, f"tokens differ at {cmp.first_mismatch}: {cmp}"
        assert cmp.max_logprob_diff <= LOGPROB_TOL, cmp
    return before, after


def _read_bytes(prompts: list[list[int]], prefill_block: int) -> int:
    """Prefill's whole attention pages up to the resume point, plus one state per layer."""
    pages = sum(-(-(len(p) - 1) // prefill_block) for p in prompts)
    return pages * prefill_block * ATTN_BYTES_PER_TOKEN + len(prompts) * STATE_BYTES


@pytest.mark.parametrize(("prefill", "decode"), [("S64", "S128"), ("S128", "S64")])
def test_pull_state_and_attention_equal_a_single_server(servers, prefill, decode):
    prompts = make_prompts(2, 200, seed=500 + int(prefill[1:]) + int(decode[1:]))
    before, after = _check(servers, prefill, decode, prompts)
    assert _delta(before, after, "bytes_read") == _read_bytes(prompts, int(prefill[1:]))


@pytest.mark.parametrize(("prefill", "decode"), [("Q64", "Q128"), ("Q128", "Q64")])
def test_push_writes_state_and_attention_into_decode(servers, prefill, decode):
    prompts = make_prompts(2, 200, seed=700 + int(prefill[1:]))
    before, after = _check(servers, prefill, decode, prompts)
    assert _delta(before, after, "bytes_read") == _read_bytes(prompts, int(prefill[1:]))
    assert _delta(before, after, "descriptors_posted") == 0  # decode posted nothing


@pytest.mark.parametrize(("prefill", "decode"), [("A128", "S128"), ("S128", "A128")])
def test_prefix_caching_align_mode_on_either_side(servers, prefill, decode):
    """An "align" prefill keeps the running state in the block of its last computed token;
    an "align" decode resumes from the state in the block of its last loaded token (equal
    block sizes on both sides)."""
    prompts = make_prompts(2, 80, seed=900 + ord(prefill[0]))
    assert max(len(p) for p in prompts) < 128  # vLLM's CPU Mamba2 prefill: one block
    before, after = _check(servers, prefill, decode, prompts)
    assert _delta(before, after, "bytes_read") == _read_bytes(prompts, 128)
