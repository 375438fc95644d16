"""Faults with real server processes (prefill, decode, vllm-router; real NIXL, real HTTP).

SIGKILL and SIGSTOP a peer, drop a completion notification, fail a load under each policy.
Expected every time: no hang (every wait has a deadline), the affected request ends by
the configured policy (``recompute``: the right tokens; ``fail``: an HTTP error naming the
failed load, never a 200 with wrong tokens), prefill frees the blocks (at once when decode
can tell it, by lease otherwise), both sides keep serving, a restarted peer is handshaken
again, and ``/metrics`` shows free blocks back at the total.
"""

from __future__ import annotations

import signal
import time

import pytest

from kvbridge.examples.check import make_prompts
from kvbridge.examples.launch import MODEL, Cluster
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.tokenizer import ByteTokenizer
from tests.engine_call_bounds import ENGINE_CALL_BOUND_S, slowest_engine_calls
from tests.verified_loads import verifying

LEASE_S = 3.0
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


def _want(model, prompt: str) -> list[int]:
    ids = ByteTokenizer().encode(prompt)
    return reference_generate(model, ids, MAX_TOKENS, eos_id=None).token_ids


def _body(prompt: str, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}


def _prefill(cluster: Cluster, prompt: str) -> dict:
    out = cluster.complete(
        "prefill", _body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    return out["kv_transfer_params"]


def _all_but_last(out: dict) -> bool:
    u = out["usage"]
    return u["loaded_tokens"] + u["cached_tokens"] == u["prompt_tokens"] - 1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(
        tmp_path_factory.mktemp("faults"),
        prefill_kv={"lease_s": LEASE_S, "heartbeat_s": 1.0},
        decode_kv=verifying({"transfer_timeout_s": 3.0}),
        decode_args=["--fault-inject", "drop-done"],
    )
    try:
        yield c.start()
    finally:
        c.close()


def test_a_dropped_done_costs_prefill_a_lease_and_nothing_else(cluster, model):
    """decode drops its first Done: output right, prefill holds until the lease, then frees."""
    prompt = make_prompts(4)[0]
    out = cluster.complete("router", _body(prompt))
    free, total = cluster["prefill"].free_blocks()
    assert free < total  # still held: the Done never came
    assert out["token_ids"] == _want(model, prompt) and _all_but_last(out)
    cluster["prefill"].wait_all_free(LEASE_S + 5)
    m = cluster["prefill"].metrics()
    assert m['kvbridge_send_outcomes_total{outcome="expired"}'] == 1
    out = cluster.complete("router", _body(make_prompts(4)[1]))  # the next Done arrives
    assert _all_but_last(out)
    cluster["prefill"].wait_all_free(2.0)  # by Done, well before a lease


def test_prefill_killed_before_the_load_decode_recomputes_and_a_restart_handshakes(cluster, model):
    prompt = make_prompts(6)[2]
    params = _prefill(cluster, prompt)
    cluster["prefill"].kill()
    t0 = time.monotonic()
    out = cluster.complete("decode", _body(prompt, kv_transfer_params=params))
    assert out["token_ids"] == _want(model, prompt)
    assert out["usage"]["loaded_tokens"] == 0
    assert time.monotonic() - t0 < 15  # a dead peer costs a timeout, never a hang
    cluster["decode"].wait_all_free(2.0)
    cluster.restart("prefill")
    prompt = make_prompts(6)[3]
    out = cluster.complete("router", _body(prompt))
    assert out["token_ids"] == _want(model, prompt) and _all_but_last(out)
    assert out["usage"]["loaded_tokens"] > 0  # the new incarnation was handshaken
    cluster["prefill"].wait_all_free(2.0)
    cluster["decode"].wait_all_free(2.0)


def test_a_frozen_prefill_times_the_load_out_then_frees_when_it_thaws(cluster, model):
    """SIGSTOP: decode's Prepare is never answered; after transfer_timeout_s decode
    recomputes (right tokens) and tells prefill, which frees once it runs again."""
    prompt = make_prompts(6)[4]
    params = _prefill(cluster, prompt)
    calls_before = cluster["decode"].metrics()
    cluster["prefill"].signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = cluster.complete("decode", _body(prompt, kv_transfer_params=params))
        assert out["token_ids"] == _want(model, prompt)
        assert out["usage"]["loaded_tokens"] == 0
        assert 2.5 < time.monotonic() - t0 < 15
    finally:
        cluster["prefill"].signal(signal.SIGCONT)
    cluster["prefill"].wait_all_free(LEASE_S + 5)
    out = cluster.complete("router", _body(make_prompts(6)[5]))
    assert _all_but_last(out)
    # decode's engine kept stepping: no call into kvbridge waited on the frozen peer
    slowest = slowest_engine_calls(calls_before, cluster["decode"].metrics())
    assert slowest and max(slowest.values()) <= ENGINE_CALL_BOUND_S, slowest


def test_zz_decode_killed_prefill_frees_by_lease_and_keeps_serving(cluster):
    prompt = make_prompts(2)[1]
    _prefill(cluster, prompt)
    cluster["decode"].kill()
    free, total = cluster["prefill"].free_blocks()
    assert free < total
    cluster["prefill"].wait_all_free(LEASE_S + 5)
    _prefill(cluster, prompt)  # still serving
    cluster["prefill"].wait_all_free(LEASE_S + 5)


def test_fail_policy_gives_the_client_an_error_never_wrong_tokens(tmp_path, model):
    c = Cluster(
        tmp_path,
        prefill_kv={"lease_s": LEASE_S, "heartbeat_s": 1.0},
        decode_kv=verifying({"failure_policy": "fail"}),
    )
    try:
        c.start()
        prompt = make_prompts(2)[0]
        params = _prefill(c, prompt)
        c["prefill"].kill()
        with pytest.raises(RuntimeError, match=r"HTTP 502: KV load failed"):
            c.complete("decode", _body(prompt, kv_transfer_params=params))
        c["decode"].wait_all_free(2.0)
        out = c.complete("decode", _body(prompt))  # decode keeps serving
        assert out["token_ids"] == _want(model, prompt)
    finally:
        c.close()
