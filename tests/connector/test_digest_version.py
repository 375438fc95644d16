"""Peers whose digests mean different things (``DIGEST_VERSION``) refuse verified loads by
name, never report them corrupt: a decode refuses a prefill of another version before it
reads, a prefill refuses a reader of another version its digests.

Two full connectors in one process with real NIXL (``pair_harness``); the "older" side
describes itself with digest version 1 (what a peer from before position weights sends,
having no such field)."""

from __future__ import annotations

import msgspec
import pytest

import kvbridge.handshake.description as description
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.worker.digests import version_refusal
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.layouts.allocation import CacheFormat
from kvbridge.layouts.digest import DIGEST_VERSION
from kvbridge.layouts.layout import KVLayout
from tests.connector.pair_harness import (
    FakeClock,
    Request,
    decode_admit,
    failed,
    loaded,
    make_side,
    prefill_finish,
    run_until,
    token_ids,
)

NHD = CacheFormat(layout=KVLayout.NHD, cross_layer=True)


def test_a_description_without_the_field_reads_as_version_1():
    """An older peer sends no ``digest_version``: it digested by version 1."""
    desc = WorkerDescription(
        protocol_version=3,
        engine_id="p",
        agent_name="a",
        rank=0,
        tp_size=1,
        model_name="m",
        dtype="float16",
        num_layers=1,
        num_kv_heads=1,
        head_size=8,
        compat_hash="",
        block_size=16,
        kernel_block_size=16,
        kv_layout="NHD",
        kv_packing="kv_split",
        cross_layer=True,
        groups=[],
        regions=[],
        nixl_metadata=b"",
    )
    assert desc.digest_version == 1  # the field's default: what an older peer meant
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(desc))
    del fields["digest_version"]
    raw = msgspec.msgpack.encode(fields)
    assert msgspec.msgpack.decode(raw, type=WorkerDescription).digest_version == 1
    assert version_refusal(DIGEST_VERSION, "prefill x") == ""
    assert "digest_version 1, this worker by 2" in version_refusal(1, "prefill x")


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("older", ["prefill", "decode"])
def test_a_peer_of_another_digest_version_is_refused_by_name(mode, older, monkeypatch):
    clock = FakeClock()
    extra = {"transfer_mode": mode, "verify": "all"}
    sides = {}
    try:
        for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
            with monkeypatch.context() as m:
                if name == older:
                    m.setattr(description, "DIGEST_VERSION", 1)
                sides[name] = make_side(role, name, 16, NHD, "F", clock, extra=extra)
        prefill, decode = sides["prefill"], sides["decode"]
        p = Request("p1", token_ids(150), KVTransferParams(do_remote_decode=True))
        d = Request("d1", p.prompt_token_ids, prefill_finish(prefill, p))
        decode_admit(decode, d)
        run_until([decode, prefill], lambda: bool(failed(decode, "d1")), "the load to fail")
        [failure] = failed(decode, "d1")
        who = "prefill prefill rank 0" if older == "prefill" else "the reader"
        assert f"{who} digests rows by digest_version 1, this worker by 2" in failure.reason
        assert not loaded(decode, "d1")
        assert decode.worker.metrics.loads_verified == 0
        if older == "prefill":  # refused before reading: nothing compared, nothing counted
            assert decode.worker.metrics.load_verify_failures == 0
        run_until([prefill, decode], lambda: "p1" in prefill.freed, "prefill to free p1")
    finally:
        for side in sides.values():
            side.worker.shutdown()
