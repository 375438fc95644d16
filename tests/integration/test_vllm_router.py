"""vllm-router (P/D mode, its default NIXL mode, nothing changed on either side) in front
of real vLLM CPU servers with kvbridge's connector: every answer equals a single plain vLLM
server token for token (and logprob for logprob), whole and streamed, and decode loaded
every prompt token but the last from prefill (vLLM's own count of external prompt tokens).

    pull   prefill block 64  -> decode block 32   decode READs
    push   prefill block 128 -> decode block 32   prefill WRITEs whole pages into decode's
                                                  staging slots
    ref    block 32, no connector                 the reference

The reference and the pull pair are asked for together from the session's pool
(``tests/integration/vllm_pool.py``): they have the configurations of
``test_vllm_cold_start.py``'s pull trio, which runs just before and hands them over warm.
Push is opt-in (``KVBRIDGE_VLLM_ROUTER_PUSH=1``: two more servers, five at once). The
servers are launched by ``kvbridge.examples.vllm.servers``, the router by
``kvbridge.examples.router``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.examples.router import start_router
from kvbridge.examples.vllm.client import Completion, compare, complete, make_prompts
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import Service, http_get
from kvbridge.examples.vllm.servers import ServerSpec
from tests.integration.vllm_pool import ServerPool
from tests.verified_loads import verify_all

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_TOKENS = 8
TIMEOUT_S = 180.0
LOGPROB_TOL = 1e-4
MODES = {"pull": (64, 32), "push": (128, 32)}


def _spec(name: str, model: Path, block: int, role: str | None, mode: str = "pull") -> ServerSpec:
    """A server as test_vllm_cold_start.py's builds it (pull: the same configurations, so
    the session's pool hands its warm pull trio over): pull is kvbridge's default mode,
    decode verifies every load (tests/verified_loads.py), a failed load recomputes (the
    test counts decode's loads: one recomputed fails it as an error would)."""
    extra = {"transfer_mode": mode} if mode == "push" else {}
    if role == "decode":
        extra = verify_all(extra)
    kv = {"kv_extra": {"extra": extra} if extra else None, "failure_policy": "recompute"}
    return ServerSpec(
        name,
        model,
        block_size=block,
        max_model_len=2048,
        enforce_eager=True,  # no torch.compile warm-up: starts ~3x faster on CPU
        **({"connector": "kvbridge", "role": role, **kv} if role else {}),
    )


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_model("tiny-llama")


@pytest.fixture(scope="module")
def servers(vllm_pool: ServerPool, model, tmp_path_factory) -> Iterator[dict[str, Service]]:
    """The reference and the pull pair, asked for together (the pool stops the idle
    servers its first request does not take)."""
    specs = [
        _spec("ref", model, 32, None),
        _spec("prefill-pull", model, 64, "prefill"),
        _spec("decode-pull", model, 32, "decode"),
    ]
    with vllm_pool.serving(specs, tmp_path_factory.mktemp("vllm-router"), timeout_s=600) as running:
        yield running


@pytest.fixture(scope="module")
def reference(servers) -> Service:
    return servers["ref"]


# push needs a second pair of servers (a minute or more each on CPU): opt-in, like the TP
# tests, so that CI stays within its time
PUSH = pytest.mark.skipif(
    os.environ.get("KVBRIDGE_VLLM_ROUTER_PUSH") != "1",
    reason="push behind the router: set KVBRIDGE_VLLM_ROUTER_PUSH=1 (two more vLLM servers)",
)


@contextlib.contextmanager
def _push_pair(pool: ServerPool, model: Path, logs: Path) -> Iterator[list[Service]]:
    p_block, d_block = MODES["push"]
    specs = [
        _spec("prefill-push", model, p_block, "prefill", "push"),
        _spec("decode-push", model, d_block, "decode", "push"),
    ]
    with pool.serving(specs, logs, timeout_s=600, first_slot=1) as running:
        yield [running["prefill-push"], running["decode-push"]]


@pytest.fixture(scope="module", params=["pull", pytest.param("push", marks=PUSH)])
def pair(request, vllm_pool, model, servers, tmp_path_factory) -> Iterator[dict]:
    mode = request.param
    logs = tmp_path_factory.mktemp(f"vllm-router-{mode}")
    with contextlib.ExitStack() as stack:
        if mode == "pull":
            prefill, decode = servers["prefill-pull"], servers["decode-pull"]
        else:
            prefill, decode = stack.enter_context(_push_pair(vllm_pool, model, logs))
        router, port, _ = start_router(
            [prefill.url], [decode.url], startup_timeout_s=60, log=logs / "router.log"
        )
        try:
            yield {"url": f"http://127.0.0.1:{port}", "decode": decode, "mode": mode}
        finally:
            router.terminate()
            router.wait(timeout=10)


def _counts(service: Service) -> dict[str, float]:
    """Decode's prompt tokens from a KV transfer, kvbridge's completed loads, and the
    engine's calls into kvbridge that vLLM's histogram counted, per hook."""
    status, raw = http_get(service.url + "/metrics", timeout_s=5.0)
    assert status == 200, raw
    out = {"external": 0.0, "loaded": 0.0}
    calls = "vllm:kvbridge_engine_call_seconds_count"
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            if (
                sample.name == "vllm:prompt_tokens_by_source_total"
                and sample.labels.get("source") == "external_kv_transfer"
            ):
                out["external"] += sample.value
            elif sample.name == "vllm:kvbridge_loads_loaded_total":
                out["loaded"] += sample.value
            elif sample.name == calls:
                hook = sample.labels["hook"]
                out[hook] = out.get(hook, 0.0) + sample.value
    return out


def _stream(url: str, model: str, prompt: list[int]) -> Completion:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        "stream": True,
    }
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        text, logprobs = "", []
        for line in resp.read().split(b"\n"):
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                logprobs += choice["logprobs"]["token_logprobs"]
        return Completion([], logprobs, text, 0.0)
    finally:
        conn.close()


def test_router_answers_equal_a_single_server_and_decode_loads_the_prompt(pair, reference, model):
    prompts = make_prompts(8, approx_tokens=150, seed={"pull": 1, "push": 2}[pair["mode"]])
    want = [
        complete(reference.url, model.name, p, max_tokens=MAX_TOKENS, timeout_s=TIMEOUT_S)
        for p in prompts
    ]
    before = _counts(pair["decode"])

    def one(p: list[int]) -> Completion:
        return complete(pair["url"], model.name, p, max_tokens=MAX_TOKENS, timeout_s=TIMEOUT_S)

    with ThreadPoolExecutor(8) as pool:  # 8 at once through the router
        got = list(pool.map(one, prompts))
    for w, g in zip(want, got, strict=True):
        c = compare(w, g)
        assert c.ok(LOGPROB_TOL), c
    # decode computed only each prompt's last token; vLLM counts the rest as external
    after = _counts(pair["decode"])
    assert after["external"] - before["external"] == sum(len(p) - 1 for p in prompts), after
    assert after["loaded"] - before["loaded"] == len(prompts), (before, after)
    # both sides of decode's engine timed their calls into kvbridge: the scheduler's hooks
    # (one match per request at least) and the worker's (one start_load_kv per step)
    for hook in ("get_num_new_matched_tokens", "build_connector_meta", "start_load_kv"):
        assert after.get(hook, 0.0) - before.get(hook, 0.0) >= len(prompts), (hook, after)
    streamed = _stream(pair["url"], model.name, prompts[0])
    assert streamed.text == want[0].text
    assert (
        max(abs(a - b) for a, b in zip(streamed.logprobs, want[0].logprobs, strict=True))
        <= LOGPROB_TOL
    )
