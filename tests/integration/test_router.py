"""vllm-router (``--vllm-pd-disaggregation``, its default NIXL mode, nothing changed on
either side) in front of kvbridge's example servers, all real processes on 127.0.0.1:

* 1P1D, prefill block 32 -> decode block 16: completions and chat, whole and streamed,
  8 at once, equal to the single-process reference token for token (and logit for logit),
  every prompt token but the last loaded from prefill, as decode's ``/metrics`` count;
* 2P2D (xPyD): the router spreads requests over both prefills and both decodes, each
  decode loads from both prefills, every answer right;
* what the router reads: ``/health``, ``/v1/models``, ``/metrics``.

The workers share a secret: prefill signs the ``kv_transfer_params`` it returns, and decode
refuses any that changed on the way, so every load counted shows the router passed them on
unchanged.

One module-scoped set of workers (two prefills, two decodes) serves every test; the
1P1D router fronts one pair of them.
"""

from __future__ import annotations

import http.client
import json
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvbridge.examples.check import compare, complete, http_get, make_prompts, scrape
from kvbridge.examples.launch import MODEL, Proc, worker_args
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.router import start_router
from kvbridge.examples.tokenizer import ByteTokenizer
from tests.ports import dead_port
from tests.verified_loads import verifying

pytestmark = pytest.mark.integration
MAX_TOKENS = 6
SECRET = "router-test-secret-0123456789abcdef"


def _worker(logs: Path, role: str, block_size: int, i: int) -> Proc:
    kv = {
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": f"{role}{i}-{uuid.uuid4().hex[:6]}",
        "kv_port": 0,
        "secret": SECRET,  # prefill signs its params: the router passes them on unchanged
    }
    if role == "decode":
        kv = verifying(kv)  # every load proves its bytes (tests/verified_loads.py)
    argv = [sys.executable, "-m", "kvbridge.examples.server", "--port", "0"]
    return Proc(f"{role}{i}", [*argv, *worker_args(role, kv, block_size)], logs / f"{role}{i}.log")


def _router(logs: Path, name: str, prefill: list[Proc], decode: list[Proc]) -> Proc:
    argv = [sys.executable, "-m", "kvbridge.examples.router", "--health-check-interval", "1"]
    for p in prefill:
        argv += ["--prefill", p.url]
    for d in decode:
        argv += ["--decode", d.url]
    return Proc(name, argv, logs / f"{name}.log")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    workers = {
        **{f"prefill{i}": _worker(logs, "prefill", 32, i) for i in range(2)},
        **{f"decode{i}": _worker(logs, "decode", 16, i) for i in range(2)},
    }
    procs = dict(workers)
    try:
        for p in workers.values():
            p.start()
        for p in workers.values():
            p.wait_healthy()
        P, D = [workers["prefill0"], workers["prefill1"]], [workers["decode0"], workers["decode1"]]
        procs["r11"] = _router(logs, "r11", P[:1], D[:1])
        procs["r22"] = _router(logs, "r22", P, D)
        for name in ("r11", "r22"):
            procs[name].start()
        for name in ("r11", "r22"):
            procs[name].wait_healthy()
        yield procs
    finally:
        for p in procs.values():
            p.kill()


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


def _want(model, prompt: str | list[int]) -> tuple[list[int], np.ndarray]:
    ids = ByteTokenizer().encode(prompt) if isinstance(prompt, str) else prompt
    out = reference_generate(model, ids, MAX_TOKENS, eos_id=None)
    return out.token_ids, out.logits


def test_the_router_sees_healthy_workers_and_the_model(fleet):
    for name in ("r11", "r22"):
        status, raw = http_get(fleet[name].url + "/health")
        assert status == 200, raw
        status, raw = http_get(fleet[name].url + "/v1/models")
        assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL, raw


def test_1p1d_completions_match_the_reference_and_load_every_prompt_token(fleet, model):
    prompts = make_prompts(8)
    before = scrape(fleet["decode0"].url)

    def one(i: int) -> dict:
        body = {
            "prompt": prompts[i] if i % 2 else ByteTokenizer().encode(prompts[i]),
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "return_logits": True,
            "stream": i % 4 >= 2,
        }
        return complete(fleet["r11"].url, body, timeout_s=60)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logits = _want(model, prompt)
        verdict = compare(out["token_ids"], np.asarray(out["logits"]), tokens, logits, 1e-4)
        assert verdict.ok, verdict.reason
        usage = out["usage"]
        assert usage["loaded_tokens"] + usage["cached_tokens"] == usage["prompt_tokens"] - 1
    after = scrape(fleet["decode0"].url)

    def grew(metric: str) -> float:
        return after.get(metric, 0.0) - before.get(metric, 0.0)

    # 8 requests, each one load from prefill0 (a prompt decode cached whole loads nothing)
    loads = sum(o["usage"]["loaded_tokens"] > 0 for o in outs)
    assert grew("kvbridge_transfers_total") == loads
    # and each load proved, by prefill's digests, that decode holds what prefill sent
    assert grew("kvbridge_loads_verified_total") == loads > 0
    assert after.get("kvbridge_load_verify_failures_total", 0.0) == 0


def _chat(url: str, content: str, stream: bool) -> dict:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        if not stream:
            return json.loads(resp.read())
        tokens: list[int] = []
        text = ""
        for line in resp.read().split(b"\n"):
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                tokens += chunk["token_ids"]
                text += chunk["choices"][0]["delta"]["content"]
        return {"token_ids": tokens, "text": text}
    finally:
        conn.close()


@pytest.mark.parametrize("stream", [False, True])
def test_1p1d_chat_matches_the_reference(fleet, model, stream):
    content = make_prompts(5)[4]
    want, _ = _want(model, f"user: {content}\nassistant:")
    out = _chat(fleet["r11"].url, content, stream)
    assert out["token_ids"] == want
    text = out["text"] if stream else out["choices"][0]["message"]["content"]
    assert text == ByteTokenizer().decode(want)


def test_2p2d_spreads_the_load_over_both_prefills_and_both_decodes(fleet, model):
    names = ("prefill0", "prefill1", "decode0", "decode1")
    before = {n: scrape(fleet[n].url) for n in names}
    prompts = [f"xPyD request {i}: " + p for i, p in enumerate(make_prompts(8))]

    def one(prompt: str) -> dict:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        return complete(fleet["r22"].url, body, timeout_s=60)

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["token_ids"] == _want(model, prompt)[0]
        assert out["usage"]["loaded_tokens"] == out["usage"]["prompt_tokens"] - 1
    after = {n: scrape(fleet[n].url) for n in names}

    def grew(name: str, metric: str) -> float:
        return after[name].get(metric, 0.0) - before[name].get(metric, 0.0)

    sends = {p: grew(p, 'kvbridge_send_outcomes_total{outcome="done"}') for p in names[:2]}
    loads = {d: grew(d, "kvbridge_transfers_total") for d in names[2:]}
    assert sum(sends.values()) == sum(loads.values()) == len(prompts), (sends, loads)
    assert all(n >= 2 for n in sends.values()), sends  # round robin: 4 each, at least 2
    assert all(n >= 2 for n in loads.values()), loads


def test_the_launcher_says_why_the_router_did_not_start(tmp_path):
    """Workers that never answer /health: the router never binds; the launcher gives up
    at its deadline, kills it and says what it waited for."""
    with dead_port() as p, dead_port() as d:
        with pytest.raises(RuntimeError, match="waits until every worker's /health"):
            start_router(
                [f"http://127.0.0.1:{p}"],
                [f"http://127.0.0.1:{d}"],
                startup_timeout_s=3,
                log=tmp_path / "router.log",
            )


def test_a_fixed_port_is_held_until_the_router_binds_it(fleet):
    """``--port N`` (a deployment's front door): the launcher holds N (bound, SO_REUSEADDR,
    not listening) until the router listens on it. N comes from a socket held the same way
    for the whole test, so nothing else can take it meanwhile (no probing)."""
    from kvbridge.examples.router import reserve_port

    held = reserve_port("127.0.0.1")
    port = held.getsockname()[1]
    router = None
    try:
        router, got, metrics_port = start_router(
            [fleet["prefill0"].url], [fleet["decode0"].url], port=port, startup_timeout_s=60
        )
        assert got == port and metrics_port != port
        status, raw = http_get(f"http://127.0.0.1:{port}/health")
        assert status == 200, raw
    finally:
        held.close()
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
