"""What kvbridge plans against vLLM's LHBNC caches, from vLLM's own allocation (no NIXL).

An LHBNC side is one region per (layer, head); the plan reads one piece per (layer,
head) of a wire chunk and rewrites nothing on the LHBNC side. A peer whose blocks could
only be read in pieces under 512 B is refused at the handshake, naming both formats.
(The bytes themselves move in ``test_vllm_pairs.py``.)
"""

from __future__ import annotations

import pytest

from kvbridge.connector.vllm import translate
from kvbridge.examples.vllm.layout_peer import TOTAL_HEADS, SideSpec, build_allocation
from kvbridge.handshake.description import PeerLayout, WorkerIdentity, describe, parse_description
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.plan import negotiate
from kvbridge.layouts.external import adopt_kv_caches

pytestmark = pytest.mark.vllm

FA, ROCM = "FLASH_ATTN", "ROCM_ATTN"


def peer(spec: SideSpec, engine_id: str) -> PeerLayout:
    """A side's description as the handshake carries it (vLLM never rewrites in place)."""
    a = build_allocation(spec)
    config = translate.kv_cache_config(a.kv_cache_config)
    hint, _ = translate.kv_layout(a.kv_cache_config)
    buffers = adopt_kv_caches(
        config, {n: a.kv_caches[n] for n in config.layer_names}, layout_hint=hint
    )
    identity = WorkerIdentity(
        engine_id=engine_id,
        agent_name=engine_id,
        model_name="tiny",
        dtype=spec.dtype,
        num_layers=spec.num_layers,
        num_kv_heads=TOTAL_HEADS,
        head_size=spec.head_size,
        rank=spec.rank,
        tp_size=spec.tp_size,
    )
    desc = describe(identity, buffers, nixl_metadata=b"", compat_hash="", rewrites_in_place=False)
    return parse_description(desc)


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        (SideSpec(ROCM, "LHBNC", 64), SideSpec(FA, "LBHNC", 16)),
        (SideSpec(FA, "LBHNC", 16), SideSpec(ROCM, "LHBNC", 32)),
        (SideSpec(FA, "BHLNC", 16), SideSpec(FA, "LHBNC", 16)),
        (SideSpec(FA, "LHBNC", 16), SideSpec(FA, "BHLNC", 16)),
        (SideSpec(FA, "LHBNC", 32), SideSpec(FA, "LHBNC", 16)),
    ],
    ids=lambda s: s.label(),
)
def test_a_chunk_moves_as_one_piece_per_layer_and_head_without_rewrites(prefill, decode):
    plan = negotiate(peer(decode, "D"), peer(prefill, "P"))
    (group,) = plan.groups
    assert group.sender is None and group.receiver is None and not group.native_read, plan
    assert group.descriptors_per_chunk == prefill.num_layers * TOTAL_HEADS
    u = min(prefill.block_size, decode.block_size)
    assert {s.length for s in group.streams} == {u * 2 * prefill.head_size * 2}  # [u, K|V]


def test_lhbnc_decode_reading_one_head_slice_across_tp():
    """TP 1 prefill, TP 2 decode: rank 1 reads heads 2, 3 of every (layer, chunk)."""
    local = peer(SideSpec(ROCM, "LHBNC", 16, tp_size=2, rank=1), "D")
    plan = negotiate(local, peer(SideSpec(FA, "LBHNC", 16), "P"))
    (group,) = plan.groups
    assert group.head_slice == (0, 2, 2)
    assert group.descriptors_per_chunk == 3 * 2


def test_token_major_prefill_with_small_heads_is_refused_naming_both_formats():
    """LBNHC rows of one (token, head) are 64 B here: under the 512 B kvbridge reads."""
    with pytest.raises(IncompatiblePeerError, match=r"(?s)OUTER.*NHD.*64-byte pieces") as err:
        negotiate(peer(SideSpec(ROCM, "LHBNC", 16), "D"), peer(SideSpec(FA, "LBNHC", 16), "P"))
    assert "VLLM_KV_CACHE_LAYOUT=" in str(err.value)
