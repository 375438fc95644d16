"""Small sets of kv_both vLLM servers (tiny-llama, block 32, pull, every load verified) for
the modules that each serve one vLLM configuration: fp8 caches, speculative decoding,
data parallelism. Each module asks the session's pool for its set once (:func:`serving`);
a server of a configuration the module before handed back is taken over
(:mod:`tests.integration.vllm_pool`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from kvbridge.examples.vllm.client import Completion, compare, complete
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import Service
from kvbridge.examples.vllm.scraped_metrics import kvbridge_delta as _delta
from kvbridge.examples.vllm.scraped_metrics import kvbridge_deltas as _deltas
from kvbridge.examples.vllm.scraped_metrics import scrape
from kvbridge.examples.vllm.servers import ServerSpec, with_engine_nice
from tests.integration.vllm_pool import ServerPool
from tests.verified_loads import verifying

MODEL = "tiny-llama"
BLOCK = 32
MAX_TOKENS = 8
TIMEOUT_S = 120.0
START_TIMEOUT_S = 900.0
LOGPROB_TOL = 1e-4
LAYERS_WITH_DRAFT = 4 + 1  # tiny-llama's body (or tiny-mimo's), and one draft layer
PAGE_BYTES = 2 * BLOCK * 2 * 32 * 4  # K,V x tokens x kv heads x head dim x fp32
DRAFTS = "vllm:spec_decode_num_draft_tokens_total"


def spec(name: str, model: str = MODEL, **fields: object) -> ServerSpec:
    """A kv_both server of ``model`` (a name :func:`ensure_model` builds); ``fields``
    override :class:`ServerSpec`'s."""
    return ServerSpec(
        name,
        ensure_model(model),
        **{
            "block_size": BLOCK,
            "connector": "kvbridge",
            "role": "both",
            "kv_extra": verifying({"lease_s": 30, "heartbeat_s": 3}),
            "failure_policy": "recompute",
            "max_model_len": 2048,
            "enforce_eager": True,
            **fields,
        },  # type: ignore[arg-type]
    )


@contextlib.contextmanager
def serving(pool: ServerPool, specs: list[ServerSpec], logs: Path) -> Iterator[dict[str, Service]]:
    """The servers of ``specs`` by name, from ``pool``: those it holds idle with the same
    configuration, the others started together; handed back to ``pool`` on exit.

    When their workers (one busy-waiting engine thread each) outnumber the cores, every
    server lowers its engine threads (``extra.engine_thread_nice``, as the docs tell such a
    machine to): a CI run of PP 2 + PP 2 + PP 1 servers on two cores without it starved a
    decode's transfer threads for 48 s and its load timed out."""
    busy = sum(
        s.tensor_parallel_size * s.pipeline_parallel_size * s.data_parallel_size for s in specs
    )
    specs = [
        dataclasses.replace(s, kv_extra=with_engine_nice(s.kv_extra, s.connector or "", busy))
        for s in specs
    ]
    with pool.serving(specs, logs, timeout_s=START_TIMEOUT_S) as services:
        yield services


def run(
    server: Service,
    prompt: list[int],
    max_tokens: int = MAX_TOKENS,
    *,
    model: str = MODEL,
    **extra: object,
) -> Completion:
    """One greedy completion of ``model`` (as :func:`spec` served it) on ``server``."""
    return complete(
        server.url, model, prompt, max_tokens=max_tokens, timeout_s=TIMEOUT_S, extra=extra
    )


def prefilled(server: Service, prompt: list[int], *, model: str = MODEL) -> dict:
    """Prefill ``prompt`` on ``server``, kept for a decode: the params it answers."""
    first = run(
        server, prompt, max_tokens=1, model=model, kv_transfer_params={"do_remote_decode": True}
    )
    assert first.kv_transfer_params and first.kv_transfer_params["do_remote_prefill"]
    return first.kv_transfer_params


def check_speculative_pd(
    prefill: Service, decode: Service, prompts: list[list[int]], *, model: str = MODEL
) -> None:
    """P/D of ``prompts`` between two servers with the same speculative config whose
    draft layer keeps KV beside the body's: every layer's pages cross (the draft's too),
    verified by prefill's digests; decode's greedy output and logprobs equal prefill's
    own, and decode drafted (vLLM's spec-decode counter moved)."""
    before = scrape(decode.url)
    got = []
    for p in prompts:
        params = prefilled(prefill, p, model=model)
        got.append(run(decode, p, model=model, kv_transfer_params=params))
    after = scrape(decode.url)
    for p, g in zip(prompts, got, strict=True):
        cmp = compare(run(prefill, p, model=model), g)  # one server, the same config
        assert cmp.first_mismatch is None and cmp.max_logprob_diff <= LOGPROB_TOL, cmp
    moved = str(_deltas(before, after))
    assert _delta(before, after, "loads_loaded") == len(prompts), moved
    assert _delta(before, after, "loads_verified") == len(prompts), moved
    pages = sum(-(-(len(p) - 1) // BLOCK) for p in prompts)
    assert _delta(before, after, "descriptors_posted") == pages * LAYERS_WITH_DRAFT, moved
    assert _delta(before, after, "bytes_read") == pages * LAYERS_WITH_DRAFT * PAGE_BYTES, moved
    drafted = after.get(DRAFTS, 0.0) - before.get(DRAFTS, 0.0)
    assert drafted > 0, "decode did not draft: speculative decoding was not on"
