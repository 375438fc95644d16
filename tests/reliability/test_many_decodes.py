"""Eight decodes that never met the prefill connect to it at once: their handshakes,
agent adds and first claims all land on one prefill together. Every load is exact, and
the prefill's engine never waited on them: its calls into kvbridge stay under the bound
of ``tests/engine_call_bounds.py``. The prefill runs in its own process (as in a
deployment: its engine shares the GIL with nobody else's); the decodes run here."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.examples.check import make_prompts
from kvbridge.examples.launch import Cluster, Proc
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.tokenizer import ByteTokenizer
from tests.engine_call_bounds import ENGINE_CALL_BOUND_S, slowest_engine_calls
from tests.reliability.servers import MODEL, SECRET, decodes, post

NUM_DECODES = 8
MAX_TOKENS = 3


@pytest.fixture
def prefill(tmp_path) -> Iterator[Proc]:
    cluster = Cluster(tmp_path, prefill_kv={"secret": SECRET, "engine_id": "prefill-many"})
    proc = cluster["prefill"]
    try:
        proc.start()
        proc.wait_healthy()
        yield proc
    finally:
        proc.kill()


def test_eight_new_decodes_at_once_load_exactly_and_never_stall_the_prefill(prefill):
    model = load_model(MODEL)
    prompts = make_prompts(NUM_DECODES)
    params = []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, out = post(prefill.url, body)
        assert status == 200, out
        params.append(out["kv_transfer_params"])
    with decodes(NUM_DECODES) as fleet:
        before = prefill.metrics()

        def load(i: int) -> dict:
            body = {"prompt": prompts[i], "max_tokens": MAX_TOKENS, "ignore_eos": True}
            status, out = fleet[i].post({**body, "kv_transfer_params": params[i]})
            assert status == 200, out
            return out

        with ThreadPoolExecutor(NUM_DECODES) as pool:
            outs = list(pool.map(load, range(NUM_DECODES)))
        for prompt, out in zip(prompts, outs, strict=True):
            ids = ByteTokenizer().encode(prompt)
            want = reference_generate(model, ids, MAX_TOKENS, eos_id=None)
            assert out["token_ids"] == want.token_ids
            usage = out["usage"]
            assert usage["loaded_tokens"] + usage["cached_tokens"] == usage["prompt_tokens"] - 1
        slowest = slowest_engine_calls(before, prefill.metrics())
        assert slowest and max(slowest.values()) <= ENGINE_CALL_BOUND_S, slowest
        prefill.wait_all_free(10.0)
        assert all(d.blocks_in_use() == 0 for d in fleet)
