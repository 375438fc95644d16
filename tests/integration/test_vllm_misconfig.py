"""Misconfigurations vLLM hides, each with real vLLM API servers: the client would get
HTTP 200 (or a bare 500) while decode recomputes (or drops) every request; these tests
prove kvbridge serves the load, or names and counts the failure.

* decode serves a byte-identical copy of the model from another directory under the same
  served name: a model is identified by its KV shapes and served name, never by its path,
  so every load is served;
* prefill and decode hold different secrets: decode shows the prefill as ``bad_secret``
  (``vllm:kvbridge_peer_state``), counts each request, and recomputes it correctly;
* ``kv_load_failure_policy: fail`` and an unreachable prefill: vLLM ends the request on the
  worker's failed report before kvbridge reads it, and the load still counts as failed
  (``loads_failed``), while a client that hangs up mid-load counts as aborted.

The servers are this module's own, by design: a copied model directory and a mismatched
secret are configurations no other module shares (one prefill, two decodes, started
together once for the module, built on :mod:`kvbridge.examples.vllm.servers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.connector.common.signing import ParamsSigner
from kvbridge.connector.vllm.translate import parse_params
from kvbridge.examples.vllm.client import (
    Completion,
    RequestError,
    compare,
    complete,
    make_prompts,
)
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import Service, http_get, start_all, stop_all
from kvbridge.examples.vllm.scraped_metrics import kvbridge_delta as _delta
from kvbridge.examples.vllm.scraped_metrics import kvbridge_deltas as _deltas
from kvbridge.examples.vllm.scraped_metrics import scrape
from kvbridge.examples.vllm.servers import ServerSpec, vllm_service, with_engine_nice
from tests.ports import dead_port

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODEL = "tiny-llama"
BLOCK = 32
MAX_TOKENS = 8
TIMEOUT_S = 120.0
LOGPROB_TOL = 1e-4
SECRET = "misconfig-test-secret-0123456789"
OTHER_SECRET = "another-secret-9876543210abcdefg"
LEASE = {"lease_s": 30, "heartbeat_s": 3}


@dataclasses.dataclass
class Servers:
    prefill: Service
    copy: Service  # the model copied to another directory, same secret, policy fail
    other_secret: Service  # the model's own directory, another secret

    def run(self, server: Service, prompt: list[int], **extra: object) -> Completion:
        return complete(
            server.url, MODEL, prompt, max_tokens=MAX_TOKENS, timeout_s=TIMEOUT_S, extra=extra
        )

    def params(self, prompt: list[int]) -> dict:
        """Prefill computes ``prompt`` and keeps its KV: the params decode loads with."""
        first = complete(
            self.prefill.url,
            MODEL,
            prompt,
            max_tokens=1,
            timeout_s=TIMEOUT_S,
            extra={"kv_transfer_params": {"do_remote_decode": True}},
        )
        assert first.kv_transfer_params and first.kv_transfer_params["do_remote_prefill"]
        return first.kv_transfer_params


def _decode(name: str, model: Path, secret: str, **fields: object) -> ServerSpec:
    return ServerSpec(
        name,
        model,
        block_size=BLOCK,
        connector="kvbridge",
        role="decode",
        kv_extra={**LEASE, "secret": secret},
        served_model_name=MODEL,
        max_model_len=2048,
        enforce_eager=True,  # no torch.compile warm-up: starts ~3x faster on CPU
        **fields,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[Servers]:
    model = ensure_model(MODEL)
    copied = tmp_path_factory.mktemp("copied-model") / f"{MODEL}-copy"
    shutil.copytree(model, copied)
    logs = tmp_path_factory.mktemp("vllm-logs")
    specs = [
        ServerSpec(
            "prefill",
            model,
            block_size=BLOCK,
            connector="kvbridge",
            role="prefill",
            kv_extra={**LEASE, "secret": SECRET},
            max_model_len=2048,
            enforce_eager=True,
        ),
        _decode("copy", copied, SECRET, failure_policy="fail"),
        _decode("other_secret", model, OTHER_SECRET),
    ]
    # three busy engine threads on a small machine: lower them (docs/operator.md)
    specs = [
        dataclasses.replace(s, kv_extra=with_engine_nice(s.kv_extra, "kvbridge", len(specs)))
        for s in specs
    ]
    services = [vllm_service(s, logs, slot=i) for i, s in enumerate(specs)]
    try:
        start_all(services, timeout_s=900)
        yield Servers(*services)
    finally:
        stop_all(services)


def _assert_same(reference: Completion, got: Completion) -> None:
    cmp = compare(reference, got)
    assert cmp.first_mismatch is None, f"tokens differ at {cmp.first_mismatch}"
    assert cmp.max_logprob_diff <= LOGPROB_TOL, cmp


def _labelled(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of metric ``name`` on the server at ``url``, by their labels (less
    vLLM's engine and model labels)."""
    status, body = http_get(url.rstrip("/") + "/metrics", timeout_s=5.0)
    assert status == 200, body[:200]
    out = {}
    for family in text_string_to_metric_families(body.decode(errors="replace")):
        for sample in family.samples:
            if sample.name == name:
                labels = {
                    k: v for k, v in sample.labels.items() if k not in ("engine", "model_name")
                }
                out[tuple(sorted(labels.items()))] = sample.value
    return out


def _wait_for(what: str, predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _moved(server: Service, before: dict[str, float]) -> str:
    """For assertion messages: the kvbridge counters that moved, the last warnings."""
    tail = server.log_tail(3000).splitlines()
    warnings = [line for line in tail if " WARNING " in line or " ERROR " in line][-8:]
    return "\n".join([str(_deltas(before, scrape(server.url))), *warnings])


def test_a_copy_of_the_model_in_another_directory_is_served(servers):
    """Decode runs the model from a copied directory under the same served name: the
    same KV shapes and served name, another path. Every load is served, none recomputed,
    and the answers equal the prefill server's own."""
    prompts = make_prompts(2, 300, seed=5401)
    before = scrape(servers.copy.url)
    got = [servers.run(servers.copy, p, kv_transfer_params=servers.params(p)) for p in prompts]
    _wait_for(
        "decode to publish its loads",
        lambda: _delta(before, scrape(servers.copy.url), "loads_loaded") >= len(prompts),
    )
    after = scrape(servers.copy.url)
    moved = _moved(servers.copy, before)
    assert _delta(before, after, "loads_loaded") == len(prompts), moved
    assert _delta(before, after, "loads_recomputed") == 0, moved
    assert _delta(before, after, "loads_failed") == 0, moved
    for p, g in zip(prompts, got, strict=True):
        _assert_same(servers.run(servers.prefill, p), g)


def test_a_secret_that_differs_shows_the_prefill_as_bad_secret(servers):
    """Prefill signs its params with one secret, decode checks them with another: decode
    computes every request itself (the answers are right), counts each one, and shows the
    prefill's side channel as ``bad_secret``."""
    decode = servers.other_secret
    prompts = make_prompts(2, 200, seed=5402)
    before = scrape(decode.url)
    failures_before = _labelled(decode.url, "vllm:kvbridge_peer_failures_total")
    got, peers = [], set()
    for p in prompts:
        params = servers.params(p)
        peers.add(f"{params['remote_host']}:{params['remote_port']}")
        got.append(servers.run(decode, p, kv_transfer_params=params))
    [peer] = peers
    bad = (("peer", peer), ("state", "bad_secret"))
    _wait_for(
        "decode to publish the peer's state",
        lambda: _labelled(decode.url, "vllm:kvbridge_peer_state").get(bad) == 1.0,
    )
    states = _labelled(decode.url, "vllm:kvbridge_peer_state")
    assert {k: v for k, v in states.items() if ("peer", peer) in k and v} == {bad: 1.0}
    failures = _labelled(decode.url, "vllm:kvbridge_peer_failures_total")
    key = (("reason", "bad_secret"),)
    assert failures.get(key, 0.0) - failures_before.get(key, 0.0) == len(prompts)
    after = scrape(decode.url)
    assert _delta(before, after, "bad_params") == len(prompts), _moved(decode, before)
    assert _delta(before, after, "loads_loaded") == 0
    for p, g in zip(prompts, got, strict=True):
        _assert_same(servers.run(servers.prefill, p), g)


def _params_for_a_gone_prefill(params: dict, port: int, name: str) -> dict:
    """Prefill's params for a prompt, moved to a peer that refuses connections at
    ``port`` (engine ``name``) and signed again with the shared secret: what decode gets
    from a prefill that is unreachable."""
    own = parse_params(params)  # less vLLM's own annotations
    assert own is not None
    moved = msgspec.structs.replace(
        own,
        remote_engine_id=name,
        remote_host="127.0.0.1",
        remote_port=port,
        remote_ports=[port],
        remote_request_id=f"{name}-request",
    )
    return ParamsSigner(SECRET.encode()).sign(moved, ttl_s=LEASE["lease_s"]).to_dict()


def test_fail_policy_and_an_unreachable_prefill_count_a_failed_load(servers):
    """``kv_load_failure_policy: fail``: the client gets an error, and decode counts the
    load failed, not aborted (vLLM ends the request on the worker's failed report before
    kvbridge reads that report)."""
    decode = servers.copy
    prompt = make_prompts(1, 200, seed=5403)[0]
    with dead_port() as port:
        params = _params_for_a_gone_prefill(servers.params(prompt), port, "gone-prefill-1")
        before = scrape(decode.url)
        with pytest.raises(RequestError) as failed:
            servers.run(decode, prompt, kv_transfer_params=params)
    assert failed.value.status >= 500, failed.value
    _wait_for(
        "decode to publish the failed load",
        lambda: _delta(before, scrape(decode.url), "loads_failed") >= 1,
    )
    after = scrape(decode.url)
    moved = _moved(decode, before)
    assert _delta(before, after, "loads_failed") == 1, moved
    assert _delta(before, after, "loads_aborted") == 0, moved
    assert _delta(before, after, "loads_loaded") == 0, moved


def test_a_client_that_hangs_up_mid_load_counts_an_aborted_load(servers):
    """The same unreachable prefill, but the client closes its connection while decode
    still tries to reach it: vLLM aborts the request, and the load counts as aborted,
    not failed."""
    decode = servers.copy
    prompt = make_prompts(1, 200, seed=5404)[0]
    with dead_port() as port:
        params = _params_for_a_gone_prefill(servers.params(prompt), port, "gone-prefill-2")
        before = scrape(decode.url)
        parts = urlsplit(decode.url)
        assert parts.hostname and parts.port
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "kv_transfer_params": params,
        }
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT_S)
        with contextlib.closing(conn):
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            # the handshake with the dead port is retried for ~4 x handshake_timeout_s
            _wait_for(
                "decode to load from the unreachable prefill",
                lambda: scrape(decode.url).get("vllm:kvbridge_loading_requests") == 1.0,
                timeout_s=15.0,
            )
        # the connection is closed: vLLM aborts the request
        _wait_for(
            "decode to publish the aborted load",
            lambda: _delta(before, scrape(decode.url), "loads_aborted") >= 1,
        )
    after = scrape(decode.url)
    moved = _moved(decode, before)
    assert _delta(before, after, "loads_aborted") == 1, moved
    assert _delta(before, after, "loads_failed") == 0, moved
    assert after.get("vllm:kvbridge_loading_requests") == 0.0, moved
