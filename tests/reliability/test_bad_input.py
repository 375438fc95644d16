"""Bad input at the servers: kv_transfer_params and HTTP bodies that are wrong in every way
get a 4xx naming the problem or a typed load failure (decode recomputes), never a crash,
never a read outside what a prefill advertised, and both workers keep serving."""

from __future__ import annotations

import json
import random

import pytest

from kvbridge.examples.check import make_prompts
from tests.ports import dead_port
from tests.reliability.servers import worker_pair


@pytest.fixture(scope="module")
def pair():
    # no secret: what an unsigned deployment must still survive; a load of a request
    # prefill never kept (a fuzzed id) costs decode its transfer timeout
    with worker_pair(secret=None, handshake_timeout_s=0.5, transfer_timeout_s=10.0) as workers:
        yield workers


def _genuine(prefill, prompt: str) -> dict:
    status, out = prefill.post(
        {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert status == 200, out
    return out["kv_transfer_params"]


def _decode(decode, prompt: str, params) -> tuple[int, dict]:
    return decode.post({"prompt": prompt, "max_tokens": 3, "kv_transfer_params": params})


def _all_but_last(usage: dict) -> bool:
    """Every prompt token but the last was loaded or found in decode's own cache."""
    return usage["loaded_tokens"] + usage["cached_tokens"] == usage["prompt_tokens"] - 1


def _local(decode, prompt: str) -> list[int]:
    status, out = decode.post({"prompt": prompt, "max_tokens": 3})
    assert status == 200, out
    return out["token_ids"]


REFUSED = [  # (change to genuine params, what the 400 names)
    ({"remote_port": "5600"}, "remote_port"),
    ({"remote_block_ids": "1,2"}, "remote_block_ids"),
    ({"remote_block_ids": [[-1, 2]]}, "non-negative"),
    ({"remote_block_ids": [[4, 4]]}, "distinct"),
    ({"remote_block_ids": [list(range(5_000))]}, "at most"),
    ({"remote_block_size": -16}, "remote_block_size"),
    ({"num_tokens": -1}, "num_tokens"),
    ({"num_tokens": 1 << 40}, "num_tokens"),
    ({"resume_tokens": 10_000}, "resume_tokens"),
    ({"remote_first_block": [-3]}, "remote_first_block"),
    ({"remote_rank": 5}, "remote_rank"),
    ({"remote_port": 70000}, "remote_port"),
    ({"remote_engine_id": ""}, "remote_engine_id"),
    ({"surprise": 1}, "unknown field"),
]


@pytest.mark.parametrize(("change", "named"), REFUSED, ids=[c[1] for c in REFUSED])
def test_malformed_params_get_400_naming_the_field(pair, change, named):
    prefill, decode = pair
    prompt = make_prompts(2)[1]
    params = _genuine(prefill, prompt)
    held = prefill.blocks_in_use(timeout_s=0)
    if isinstance(change.get("remote_block_ids"), list) and len(change["remote_block_ids"]) == 1:
        change = {"remote_block_ids": change["remote_block_ids"] * len(params["remote_block_ids"])}
    status, out = _decode(decode, prompt, {**params, **change})
    assert status == 400, out
    assert named in out["error"], out
    assert prefill.blocks_in_use(timeout_s=0) == held  # no state changed over there
    status, out = _decode(decode, prompt, params)  # the real ones still load
    assert status == 200 and _all_but_last(out["usage"]), out
    assert prefill.blocks_in_use() == 0 and decode.blocks_in_use() == 0


def test_block_ids_past_what_prefill_advertised_are_never_read(pair):
    """Well-formed ids beyond prefill's 128 blocks: the load fails by name before any read,
    decode recomputes (right tokens), and prefill's real hold is untouched."""
    prefill, decode = pair
    prompt = make_prompts(2)[0]
    params = _genuine(prefill, prompt)
    far = {
        **params,
        "remote_block_ids": [[500 + i] for i in range(len(params["remote_block_ids"]))],
    }
    far["remote_first_block"] = [0] * len(far["remote_block_ids"])
    before = decode.loop.worker.metrics.bytes_read
    status, out = _decode(decode, prompt, far)
    assert status == 200 and out["usage"]["loaded_tokens"] == 0, out
    assert out["token_ids"] == _local(decode, prompt)
    assert decode.loop.worker.metrics.bytes_read == before
    status, out = _decode(decode, prompt, params)
    assert status == 200 and _all_but_last(out["usage"]), out
    assert prefill.blocks_in_use() == 0 and decode.blocks_in_use() == 0


def test_an_unknown_engine_costs_a_handshake_timeout_then_decode_recomputes(pair):
    _, decode = pair
    prompt = make_prompts(2)[0]
    with dead_port() as port:
        ghost = {
            "do_remote_prefill": True,
            "remote_engine_id": "nobody",
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "remote_block_ids": [[0]] * 3,
            "remote_first_block": [0, 0, 0],
            "remote_block_size": 32,
            "num_tokens": 30,
            "resume_tokens": 29,
            "remote_request_id": "ghost-1",
        }
        status, out = _decode(decode, prompt, ghost)
    assert status == 200 and out["usage"]["loaded_tokens"] == 0, out
    assert out["token_ids"] == _local(decode, prompt)
    assert decode.blocks_in_use() == 0


def test_fuzzed_bodies_never_crash_a_worker(pair):
    """200 random mutations of a valid body (bytes flipped, cut, duplicated): every answer
    is a 2xx or a 4xx with a JSON reason, and both workers still serve afterwards.

    A mutation can leave well-formed params naming a request prefill never kept (one
    character of ``remote_request_id``); unsigned, decode cannot tell, and prefill waits
    up to its lease for such a request to be handed over, so that load costs decode its
    load timeout and recomputes. The fuzzed params' own lease may run out meanwhile, so
    "still serves" is shown with params minted after the fuzz."""
    prefill, decode = pair
    prompt = make_prompts(1)[0]
    params = _genuine(prefill, prompt)
    valid = json.dumps({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}).encode()
    rng = random.Random(1234)
    statuses = set()
    for _ in range(200):
        body = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            op, i = rng.random(), rng.randrange(len(body))
            if op < 0.5:
                body[i] = rng.randrange(256)
            elif op < 0.8:
                del body[i : i + rng.randint(1, 20)]
            else:
                body[i:i] = body[i : i + rng.randint(1, 20)]
        status, out = decode.post(bytes(body))
        statuses.add(status)
        assert status == 200 or (400 <= status < 500 and "error" in out), (status, out)
    assert statuses & {400, 422}  # the fuzz did reach the validation paths
    status, out = _decode(decode, prompt, _genuine(prefill, prompt))
    assert status == 200 and _all_but_last(out["usage"]), out
    assert prefill.blocks_in_use(timeout_s=40) == 0 and decode.blocks_in_use() == 0
