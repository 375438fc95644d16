"""The handover on fresh vLLM servers, as a user starts them: no warm-up request.

Per transfer mode, one trio of servers started together: prefill, decode (prefill's
blocks larger than decode's, so decode stages and splits them) and a plain reference
server with decode's block size. Nothing is sent before the tests: the first test is
the first request each server ever sees (see docs/handover.md for why this used to take
16-30 s, and what fixed it): the trios are the module's own, never servers another module
left in the session's pool (``tests/integration/vllm_pool.py``).

    pull    tiny-llama   prefill 64 -> decode 32
    push    tiny-gemma3  prefill 96 -> decode 64 (full + sliding-window groups)

The first P/D request is timed against the reference server's first request, sent just
before it: a P/D request pays two cold engines (prefill's first forward and decode's),
so the bound is twice the reference's time plus a margin for the handover; the stalls
this guards against were 16-30 s. Then 8 requests at once through both servers: every
load is loaded (none recomputed, none failed) and every token equals the reference.

The servers run with ``--enforce-eager`` (about 3x faster to start on CPU; the first
forward of each engine is then its slowest). ``KVBRIDGE_VLLM_COMPILE=1`` starts them as
the README's commands do (vLLM's default torch.compile, warmed up before it reports
healthy): the figures in docs/handover.md's second round come from that.
``KVBRIDGE_VLLM_BIND=auto`` leaves the CPU binding to vLLM (``auto``: every server on
every core, what a user's command gets) instead of one core per server; and
``KVBRIDGE_VLLM_EXTRA`` (a JSON object) is merged into kvbridge's ``extra`` settings on
both kvbridge servers (e.g. ``{"engine_step_wait": "sched_yield"}`` for the before/after rows of
docs/handover.md's third round).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from kvbridge.examples.vllm.client import Completion, compare, complete, make_prompts
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import Service
from kvbridge.examples.vllm.scraped_metrics import kvbridge_delta, kvbridge_deltas, scrape
from kvbridge.examples.vllm.servers import ServerSpec
from tests.integration.vllm_pool import ServerPool
from tests.verified_loads import verify_all

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_TOKENS = 8
LOGPROB_TOL = 1e-4
TIMEOUT_S = 120.0
CONCURRENT = 8
# (model, prefill block, decode block) per transfer mode
MODES = {"pull": ("tiny-llama", 64, 32), "push": ("tiny-gemma3", 96, 64)}
# the handover's own share of the first request, on top of two cold engines
HANDOVER_MARGIN_S = 5.0
# the user's command (vLLM's torch.compile) instead of --enforce-eager
COMPILE = os.environ.get("KVBRIDGE_VLLM_COMPILE") == "1"
# vLLM's own CPU binding ("auto") instead of one core per server
BIND = os.environ.get("KVBRIDGE_VLLM_BIND") or None
EXTRA = json.loads(os.environ.get("KVBRIDGE_VLLM_EXTRA") or "{}")


@dataclass
class Trio:
    mode: str
    model: str
    prefill: Service
    decode: Service
    reference: Service
    last_prefill_s: float = 0.0  # the prefill half of the last P/D request

    def prefill_then_decode(self, prompt: list[int]) -> Completion:
        """vLLM's P/D flow: prefill keeps the KV (max_tokens 1), decode loads it."""
        t0 = time.monotonic()
        first = complete(
            self.prefill.url,
            self.model,
            prompt,
            max_tokens=1,
            timeout_s=TIMEOUT_S,
            extra={"kv_transfer_params": {"do_remote_decode": True}},
        )
        assert first.kv_transfer_params, "prefill returned no kv_transfer_params"
        self.last_prefill_s = time.monotonic() - t0
        return complete(
            self.decode.url,
            self.model,
            prompt,
            max_tokens=MAX_TOKENS,
            timeout_s=TIMEOUT_S,
            extra={"kv_transfer_params": first.kv_transfer_params},
        )

    def reference_run(self, prompt: list[int]) -> Completion:
        return complete(
            self.reference.url, self.model, prompt, max_tokens=MAX_TOKENS, timeout_s=TIMEOUT_S
        )


def _spec(name: str, model_dir, block: int, mode: str | None, role: str | None) -> ServerSpec:
    return ServerSpec(
        name,
        model_dir,
        block_size=block,
        connector="kvbridge" if role else None,
        role=role,
        # defaults only: what a user's command line would carry, but for decode's
        # verify "all": every load proves its bytes (tests/verified_loads.py)
        kv_extra=_extra(mode, role) if role else None,
        failure_policy="recompute" if role else None,
        max_model_len=2048,
        enforce_eager=not COMPILE,  # no torch.compile at startup: ~3x faster on CPU
        cpus=BIND,
    )


def _extra(mode: str | None, role: str) -> dict | None:
    extra = {**({"transfer_mode": mode} if mode == "push" else {}), **EXTRA}
    if role == "decode":
        extra = verify_all(extra)
    return {"extra": extra} if extra else None


# push first: the pull trio, started last, is what test_vllm_router.py (run right after
# this module, tests/integration/conftest.py) takes over from the session's pool
@pytest.fixture(scope="module", params=["push", "pull"])
def trio(request, vllm_pool: ServerPool, tmp_path_factory) -> Iterator[Trio]:
    """Servers of their own, started anew (``fresh``): the first test times each one's
    first request. Handed back to the pool afterwards, warm."""
    mode = request.param
    model, prefill_block, decode_block = MODES[mode]
    model_dir = ensure_model(model)
    logs = tmp_path_factory.mktemp(f"vllm-cold-{mode}")
    specs = [
        _spec("prefill", model_dir, prefill_block, mode, "prefill"),
        _spec("decode", model_dir, decode_block, mode, "decode"),
        _spec("reference", model_dir, decode_block, None, None),
    ]
    with vllm_pool.serving(specs, logs, fresh=True) as running:
        yield Trio(
            mode, model_dir.name, running["prefill"], running["decode"], running["reference"]
        )


def _assert_same(reference: Completion, got: Completion) -> None:
    cmp = compare(reference, got)
    assert cmp.first_mismatch is None, f"tokens differ at {cmp.first_mismatch}"
    assert cmp.max_logprob_diff <= LOGPROB_TOL, cmp


def _wait_for_loads(trio: Trio, before: dict[str, float], count: int) -> dict[str, float]:
    """decode's /metrics once it counts ``count`` more ended loads (stats reach the API
    server a moment after the request): loaded, recomputed, failed, or released (vLLM
    asked for none of the remote tokens: decode computes them, by design, not timing)."""
    deadline = time.monotonic() + 30.0
    while True:
        after = scrape(trio.decode.url)
        ended = sum(
            kvbridge_delta(before, after, n)
            for n in ("loads_loaded", "loads_recomputed", "loads_failed", "loads_released")
        )
        if ended >= count:
            return after
        if time.monotonic() > deadline:
            raise AssertionError(
                f"decode counted {ended} of {count} loads within 30 s: "
                f"{kvbridge_deltas(before, after)}"
            )
        time.sleep(0.2)


def test_the_first_request_after_startup_is_not_slow(trio: Trio) -> None:
    prompt = make_prompts(1, 300, seed=4100 + len(trio.mode))[0]
    before = scrape(trio.decode.url)
    ref = trio.reference_run(prompt)  # the reference server's first request: cold too
    t0 = time.monotonic()
    got = trio.prefill_then_decode(prompt)
    pd_s = time.monotonic() - t0
    after = _wait_for_loads(trio, before, 1)
    _assert_same(ref, got)
    moved = kvbridge_deltas(before, after)
    assert kvbridge_delta(before, after, "loads_loaded") == 1, moved
    assert kvbridge_delta(before, after, "loads_recomputed") == 0, moved
    bound = 2 * ref.seconds + HANDOVER_MARGIN_S
    print(
        f"{trio.mode}: first request: reference {ref.seconds:.2f} s, P/D {pd_s:.2f} s "
        f"(prefill {trio.last_prefill_s:.2f} s, decode {got.seconds:.2f} s)"
    )
    assert pd_s <= bound, (
        f"first P/D request took {pd_s:.1f} s, the reference server's first "
        f"{ref.seconds:.1f} s (bound {bound:.1f} s)"
    )


def test_eight_concurrent_requests_all_load_and_equal_a_single_server(trio: Trio) -> None:
    prompts = make_prompts(CONCURRENT, 300, seed=4200 + len(trio.mode))
    before = scrape(trio.decode.url)
    with ThreadPoolExecutor(CONCURRENT) as pool:
        got = list(pool.map(trio.prefill_then_decode, prompts))
    after = _wait_for_loads(trio, before, CONCURRENT)
    moved = kvbridge_deltas(before, after)
    assert kvbridge_delta(before, after, "loads_recomputed") == 0, moved
    assert kvbridge_delta(before, after, "loads_failed") == 0, moved
    loaded = kvbridge_delta(before, after, "loads_loaded")
    released = kvbridge_delta(before, after, "loads_released")
    assert loaded + released == CONCURRENT and loaded >= CONCURRENT - 1, moved
    for prompt, g in zip(prompts, got, strict=True):
        _assert_same(trio.reference_run(prompt), g)
