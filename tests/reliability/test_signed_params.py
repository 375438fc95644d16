"""Signed kv_transfer_params: decode reads only what a prefill handed out, before it expires.

Unit level (the signer) and server level (a prefill and a decode example server with the
same secret): tampered, unsigned, foreign-secret or expired params get HTTP 400 naming
why, nothing is read, and the genuine params still work afterwards.
"""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.common.signing import ParamsSignatureError, ParamsSigner
from kvbridge.examples.check import make_prompts
from tests.reliability.servers import worker_pair

SECRET = b"0123456789abcdef-secret"


def _params(**over) -> KVTransferParams:
    base = dict(
        do_remote_prefill=True,
        remote_engine_id="prefill-0",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_block_ids=[[3, 4, 5]],
        remote_first_block=[0],
        remote_block_size=16,
        num_tokens=40,
        remote_request_id="r1",
        resume_tokens=39,
    )
    return KVTransferParams(**{**base, **over})


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_signed_params_verify_and_every_field_is_covered():
    clock = Clock()
    signer = ParamsSigner(SECRET, wall_clock=clock)
    signed = signer.sign(_params(), ttl_s=30)
    assert signed.expires_at == clock.now + 30 and len(signed.signature) == 64
    signer.verify(signed)
    signed = KVTransferParams.from_json(signed.to_json())  # through the HTTP hop
    signer.verify(signed)
    for field, value in [
        ("remote_block_ids", [[3, 4, 6]]),
        ("remote_request_id", "r2"),
        ("remote_engine_id", "other"),
        ("remote_port", 5601),
        ("num_tokens", 41),
        ("resume_tokens", 38),
        ("expires_at", signed.expires_at + 3600),
    ]:
        forged = msgspec.structs.replace(signed, **{field: value})
        with pytest.raises(ParamsSignatureError, match="do not match their signature"):
            signer.verify(forged)


def test_unsigned_foreign_and_expired_params_are_refused_by_name():
    clock = Clock()
    signer = ParamsSigner(SECRET, wall_clock=clock)
    with pytest.raises(ParamsSignatureError, match="not signed"):
        signer.verify(_params())
    other = ParamsSigner(b"another-secret-of-16+", wall_clock=clock).sign(_params(), 30)
    with pytest.raises(ParamsSignatureError, match="another secret"):
        signer.verify(other)
    signed = signer.sign(_params(), 30)
    clock.now += 30.5
    with pytest.raises(ParamsSignatureError, match=r"expired 0\.5 s ago"):
        signer.verify(signed)


def test_without_a_secret_params_are_dated_but_not_signed():
    clock = Clock()
    signer = ParamsSigner(None, wall_clock=clock)
    assert not signer.enabled
    dated = signer.sign(_params(), 30)
    assert dated.signature == "" and dated.expires_at == clock.now + 30
    signer.verify(dated)
    signer.verify(_params())  # undated params (another producer) pass
    clock.now += 31
    with pytest.raises(ParamsSignatureError, match="expired"):
        signer.verify(dated)


def _prefill(prefill, prompt: str) -> dict:
    status, out = prefill.post(
        {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert status == 200, out
    return out["kv_transfer_params"]


def _decode(decode, prompt: str, params: dict) -> tuple[int, dict]:
    return decode.post(
        {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params, "return_logits": False}
    )


def test_servers_refuse_tampered_unsigned_and_foreign_params_with_400():
    prompt = make_prompts(1)[0]
    with worker_pair() as (prefill, decode):
        params = _prefill(prefill, prompt)
        assert params["signature"] and params["expires_at"] > 0
        other_block = max(params["remote_block_ids"][0]) + 1
        forged = [
            {
                **params,
                "remote_block_ids": [[other_block, *ids[1:]] for ids in params["remote_block_ids"]],
            },
            {**params, "signature": ""},
            {**params, "signature": "0" * 64},
            {**params, "remote_request_id": "someone-else"},
        ]
        for bad in forged:
            status, out = _decode(decode, prompt, bad)
            assert status == 400, out
            assert "signature" in out["error"] or "not signed" in out["error"], out
        assert decode.loop.worker.metrics.bytes_read == 0  # nothing was read
        status, out = _decode(decode, prompt, params)  # the genuine params still work
        assert status == 200, out
        usage = out["usage"]
        assert usage["loaded_tokens"] == usage["prompt_tokens"] - 1  # all but the last
        assert prefill.blocks_in_use() == 0 and decode.blocks_in_use() == 0
