"""Push mode, on loopback: a decode restarted with the same engine_id (a new process, a new
NIXL agent) while prefill still knows the old one. Prefill must notice that the ``Push``
comes from an agent it does not know under that engine id, drop the stale peer and
handshake again before writing: the first request after the restart loads, exactly.
(The same across two hosts: tests/multihost/test_across_hosts.py.)"""

from __future__ import annotations

import pytest

from kvbridge.examples.check import make_prompts
from kvbridge.examples.launch import MODEL, Cluster
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.tokenizer import ByteTokenizer

pytestmark = pytest.mark.integration

MAX_TOKENS = 4


def test_a_restarted_decode_is_handshaken_again_before_the_first_write(tmp_path):
    model = load_model(MODEL)
    push = {"extra": {"transfer_mode": "push"}}
    c = Cluster(tmp_path, prefill_kv={"lease_s": 5.0, "heartbeat_s": 1.0, **push}, decode_kv=push)
    try:
        c.start()
        for i, prompt in enumerate(make_prompts(4)[:2]):
            if i:
                c.restart("decode")  # same engine_id; the proxy learns its new URL
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            out = c.complete("proxy", body)
            ids = ByteTokenizer().encode(prompt)
            want = reference_generate(model, ids, MAX_TOKENS, eos_id=None).token_ids
            assert out["token_ids"] == want
            u = out["usage"]
            assert u["loaded_tokens"] > 0, u  # loaded, not recomputed
            assert u["loaded_tokens"] + u["cached_tokens"] == u["prompt_tokens"] - 1, u
        assert "restarted (Push from agent" in c["prefill"].tail(20_000)
        c["prefill"].wait_all_free(5.0)
        c["decode"].wait_all_free(5.0)
    finally:
        c.close()
