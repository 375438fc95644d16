"""kvbridge between vLLM API servers of different tensor-parallel sizes.

Real weights on disk (``kvbridge.examples.vllm.models``), so a TP-2 server serves the same model as
a TP-1 server and P/D output must equal a TP-1 server computing the prompt itself. The module's
own servers, not the session's pool's (``tests/integration/vllm_pool.py``): cores pinned by
hand, a small cache and a warm-up that no other module's servers have:

    P128   tiny-llama, TP 1, block 128, kv_both, one core (prefill, and the reference)
    T32    tiny-llama, TP 2, block 32, kv_both, one core per rank
    L64    tiny-llama, TP 1, block 64, kv_both (not with KVBRIDGE_VLLM_TP21=0)

The module runs in CI. It was opt-in until vLLM's wait between engine steps was switched
from ``os.sched_yield`` to ``time.sleep(0)`` (``kvbridge.connector.vllm.spin_wait``;
docs/handover.md, third round): with vLLM's own wait it failed on the quiet 2-core machine
(a load failed, a request got no answer in 120 s), with the switch it passed 3 of 3 runs
in about a minute. ``KVBRIDGE_VLLM_TP=0`` skips it.

- TP 1 -> TP 2 (P128 -> T32): each decode rank reads its KV head of every 128-token prefill
  page into its staging slots and vLLM's kernel splits it into its 32-token blocks.
- TP 2 -> TP 1 (T32 -> L64; ``KVBRIDGE_VLLM_TP21=0`` skips it): decode reads each 32-token
  page from both prefill ranks (each holds one KV head) and merges them into its 64-token
  blocks. With vLLM's own wait, on the shared 2-core machine busy with other tests, it
  failed in 3 of 3 runs (docs/history/measurements-0.1.0.md): L64's first handshakes with
  the TP-2 prefill took 1.4 s to 2 min, and L64's and T32's engines then went minutes
  without a step.

Settings as in ``scripts/run_vllm_pd.sh``: one core per engine thread
(``VLLM_CPU_OMP_THREADS_BIND``), ``extra.engine_thread_nice`` (more busy-waiting engine
threads than cores), and the TP-2 server's first forward pass paid before the tests (a
local request, then P/D requests per direction until one loads, at most 4).
``KVBRIDGE_VLLM_EXTRA`` (a JSON object) is merged into kvbridge's ``extra`` settings on
every server (e.g. ``{"engine_step_wait": "sched_yield"}``: vLLM's own wait between steps,
the "before" runs of docs/handover.md's third round).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge.examples.vllm.client import Completion, RequestError, compare, complete, make_prompts
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import Service, start_all, stop_all
from kvbridge.examples.vllm.scraped_metrics import kvbridge_delta as _delta
from kvbridge.examples.vllm.scraped_metrics import kvbridge_deltas as _deltas
from kvbridge.examples.vllm.scraped_metrics import scrape
from kvbridge.examples.vllm.servers import ServerSpec, vllm_service, with_engine_nice
from tests.verified_loads import verifying

WITH_TP = os.environ.get("KVBRIDGE_VLLM_TP", "1") != "0"
# Opt-in: on the shared 2-core machine the TP 1 -> 2 test passed 4 of 8 runs (loads stuck in
# `reading` for the 60 s timeout, or the prefill's handshake listener silent for 4 x 5 s;
# docs/history/measurements-0.1.0.md, known limits).
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(not WITH_TP, reason="KVBRIDGE_VLLM_TP=0 skips it"),
]

MAX_TOKENS = 8
LOGPROB_TOL = 1e-4
TIMEOUT_S = 120.0
# TP-2 engines on 2 cores run slowly (seconds per load, more on a busy machine): a prefill
# lease and a load timeout with room for that
LEASE = {"lease_s": 120, "heartbeat_s": 3, "transfer_timeout_s": 60}
EXTRA = json.loads(os.environ.get("KVBRIDGE_VLLM_EXTRA") or "{}")
BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny-llama: layers x K,V x kv heads x head dim x fp32
LAYERS = 4
WITH_TP21 = os.environ.get("KVBRIDGE_VLLM_TP21", "1") != "0"


class ServerFailed(AssertionError):
    """A request failed; the message quotes the log of the server involved."""


@dataclass
class Cluster:
    servers: dict[str, Service]
    model: str

    def url(self, name: str) -> str:
        return self.servers[name].url

    @contextlib.contextmanager
    def logs_on_error(self, name: str) -> Iterator[None]:
        try:
            yield
        except RequestError as exc:
            svc = self.servers[name]
            errors = "\n".join(svc.error_lines(5)) or "(no exception lines)"
            raise ServerFailed(
                f"{exc}\n--- {name}: exception lines ---\n{errors}\n"
                f"--- {name}: last lines of {svc.log_path} ---\n{svc.log_tail(60)}"
            ) from exc

    def metrics(self, name: str) -> dict[str, float]:
        return scrape(self.url(name))

    def run(self, name: str, prompt: list[int], **extra: Any) -> Completion:
        with self.logs_on_error(name):
            return complete(
                self.url(name),
                self.model,
                prompt,
                max_tokens=MAX_TOKENS,
                timeout_s=TIMEOUT_S,
                extra=extra,
            )

    def pd(self, prefill: str, decode: str, prompt: list[int]) -> Completion:
        """vLLM's P/D flow by hand: prefill keeps the KV, decode loads it."""
        with self.logs_on_error(prefill):
            first = complete(
                self.url(prefill),
                self.model,
                prompt,
                max_tokens=1,
                timeout_s=TIMEOUT_S,
                extra={"kv_transfer_params": {"do_remote_decode": True}},
            )
        params = first.kv_transfer_params
        assert params and params["do_remote_prefill"], params
        return self.run(decode, prompt, kv_transfer_params=params)


# name -> (block size, TP size, VLLM_CPU_OMP_THREADS_BIND)
SERVERS = {"P128": (128, 1, "0"), "T32": (32, 2, "0|1")}
if WITH_TP21:
    SERVERS["L64"] = (64, 1, "1")
# KV-cache tokens per server: small caches, and few descriptors for a decode to prepare for
# every block of a prefill at its first handshake (1 GiB of VLLM_CPU_KVCACHE_SPACE would
# be 32,768 blocks per rank of T32)
CACHE_TOKENS = 16384


def _spec(name: str, model_dir: Path, kv_extra: dict[str, Any] | None) -> ServerSpec:
    block_size, tp, cpus = SERVERS[name]
    return ServerSpec(
        name,
        model_dir,
        block_size=block_size,
        tensor_parallel_size=tp,
        cpus=cpus,
        connector="kvbridge",
        role="both",
        # kv_both: as decode it verifies every load (tests/verified_loads.py)
        kv_extra=verifying(kv_extra or {}),
        failure_policy="recompute",
        max_model_len=2048,
        enforce_eager=True,  # no torch.compile warm-up: starts ~3x faster on CPU
        extra_args=("--num-gpu-blocks-override", str(CACHE_TOKENS // block_size)),
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    llama = ensure_model("tiny-llama")
    logs = tmp_path_factory.mktemp("vllm-tp-logs")
    busy = sum(tp for _, tp, _ in SERVERS.values())  # one busy-waiting thread per rank
    kv_extra = with_engine_nice(dict(LEASE), "kvbridge", busy)
    if EXTRA:  # KVBRIDGE_VLLM_EXTRA: more of kvbridge's extra settings, on every server
        kv_extra = {**(kv_extra or {}), "extra": {**(kv_extra or {}).get("extra", {}), **EXTRA}}
    servers = {name: vllm_service(_spec(name, llama, kv_extra), logs) for name in SERVERS}
    try:
        start_all(list(servers.values()), timeout_s=400)
        cluster = Cluster(servers, llama.name)
        _warm_up(cluster)
        yield cluster
    finally:
        stop_all(list(servers.values()))


WARM_UP_TRIES = 4


def _warm_up(cluster: Cluster) -> None:
    """The TP-2 server's first forward pass compiles vLLM's masked vocabulary embedding
    (a C++ build, even with enforce_eager): one rank builds for tens of seconds while the
    other waits in all_reduce and neither calls the connector, so a load in flight then
    would time out. A local request pays that. Then P/D requests per direction until one
    loads (at most ``WARM_UP_TRIES``): a fresh server sometimes leaves its first handshakes
    unanswered (each try gives up after 4 x 5 s); the tests check the outcome."""
    cluster.run("T32", make_prompts(1, 32, seed=77)[0])
    pairs = [("P128", "T32"), *([("T32", "L64")] if WITH_TP21 else [])]
    for i, (prefill, decode) in enumerate(pairs):
        for attempt in range(WARM_UP_TRIES):
            before = cluster.metrics(decode)
            try:
                cluster.pd(prefill, decode, make_prompts(1, 64, seed=6100 + 10 * i + attempt)[0])
            except ServerFailed as exc:
                print(f"warm-up {prefill} -> {decode} failed (ignored): {str(exc)[:300]}")
            if _delta(before, cluster.metrics(decode), "loads_loaded") >= 1:
                break
            print(f"warm-up {prefill} -> {decode}: try {attempt + 1} did not load")


def _assert_same(reference: Completion, got: Completion) -> None:
    cmp = compare(reference, got)
    assert cmp.first_mismatch is None, f"tokens differ at {cmp.first_mismatch}"
    assert cmp.max_logprob_diff <= LOGPROB_TOL, cmp


def _pages(loaded: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in loaded)


def _check(
    cluster: Cluster, prefill: str, decode: str, reference: str, seed: int
) -> tuple[list[int], dict[str, float], dict[str, float]]:
    """P/D for two prompts: tokens and logprobs equal the reference server's, every load
    loaded and none recomputed; returns the tokens loaded per prompt and decode's metrics
    before and after."""
    prompts = make_prompts(2, 300, seed=seed)
    before = cluster.metrics(decode)
    got = [cluster.pd(prefill, decode, p) for p in prompts]
    after = cluster.metrics(decode)
    moved = _deltas(before, after)
    assert _delta(before, after, "loads_loaded") == len(prompts), moved
    assert _delta(before, after, "loads_recomputed") == 0, moved
    assert _delta(before, after, "loads_failed") == 0, moved
    for p, g in zip(prompts, got, strict=True):
        _assert_same(cluster.run(reference, p), g)
    return [len(p) - 1 for p in prompts], before, after  # decode computes the last token


def test_prefill_tp_1_to_decode_tp_2_with_larger_prefill_blocks(cluster: Cluster) -> None:
    """P128 (TP 1) -> T32 (TP 2): each decode rank reads its head of every 128-token page
    (one descriptor per page and layer), the ranks' bytes add up to the prompt's KV in
    whole prefill pages once, and each rank splits them into its 32-token blocks."""
    loaded, before, after = _check(cluster, "P128", "T32", "P128", seed=6001)
    moved = _deltas(before, after)
    pages = _pages(loaded, 128)
    assert _delta(before, after, "bytes_read") == pages * 128 * BYTES_PER_TOKEN, moved
    assert _delta(before, after, "transfers") == 2 * len(loaded), moved  # one per rank
    assert _delta(before, after, "descriptors_posted") == 2 * pages * LAYERS, moved
    assert _delta(before, after, "receiver_rewrites") == 2 * _pages(loaded, 32), moved


@pytest.mark.skipif(not WITH_TP21, reason="KVBRIDGE_VLLM_TP21=0 skips it")
def test_prefill_tp_2_to_decode_tp_1_with_smaller_prefill_blocks(cluster: Cluster) -> None:
    """T32 (TP 2) -> L64 (TP 1): decode reads each 32-token page's head from both prefill
    ranks (one descriptor per page, layer and source rank) and merges them into its
    64-token blocks; the bytes are the prompt's KV in whole prefill pages once."""
    loaded, before, after = _check(cluster, "T32", "L64", "P128", seed=6002)
    moved = _deltas(before, after)
    pages = _pages(loaded, 32)
    assert _delta(before, after, "bytes_read") == pages * 32 * BYTES_PER_TOKEN, moved
    assert _delta(before, after, "descriptors_posted") == 2 * pages * LAYERS, moved
    assert _delta(before, after, "receiver_rewrites") == _pages(loaded, 64), moved
