"""On loopback: a peer restarted with the same engine_id (a new process, a new NIXL agent)
while the other side still knows the old one; the first request after the restart must
load, exactly. Pull: prefill restarts; decode's claim to the old agent fails, so decode
drops it, handshakes again and claims from the new one. Push: decode restarts; prefill
sees the ``Push`` come from an agent it does not know under that engine id, drops the
stale peer and handshakes again before writing. (Across two hosts, on the same address
and ports: tests/multihost/test_across_hosts.py.)"""

from __future__ import annotations

import pytest

from kvbridge.examples.check import make_prompts
from kvbridge.examples.launch import MODEL, Cluster
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.tokenizer import ByteTokenizer
from tests.verified_loads import verifying

pytestmark = pytest.mark.integration

MAX_TOKENS = 4


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_restarted_peer_is_handshaken_again_before_the_first_load(tmp_path, mode):
    model = load_model(MODEL)
    extra = {"extra": {"transfer_mode": mode}}
    restarted = "prefill" if mode == "pull" else "decode"
    c = Cluster(
        tmp_path,
        prefill_kv={"lease_s": 5.0, "heartbeat_s": 1.0, **extra},
        decode_kv=verifying(extra),
    )
    try:
        c.start()
        for i, prompt in enumerate(make_prompts(4)[:2]):
            if i:
                c.restart(restarted)  # same engine_id; a new router learns its new URL
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            out = c.complete("router", body)
            ids = ByteTokenizer().encode(prompt)
            want = reference_generate(model, ids, MAX_TOKENS, eos_id=None).token_ids
            assert out["token_ids"] == want
            u = out["usage"]
            assert u["loaded_tokens"] > 0, u  # loaded, not recomputed
            assert u["loaded_tokens"] + u["cached_tokens"] == u["prompt_tokens"] - 1, u
        noticed = "restarted (Push from agent" if mode == "push" else "handshaking again"
        assert noticed in c["prefill" if mode == "push" else "decode"].tail(20_000)
        c["prefill"].wait_all_free(5.0)
        c["decode"].wait_all_free(5.0)
    finally:
        c.close()
