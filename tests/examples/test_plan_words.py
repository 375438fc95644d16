"""The demo's plan in words (examples/plan_words.py): each side's paging, the chunks, and
who rewrites. The whole path, from two live workers' side channels, runs in
tests/scripts/test_run_demo.py."""

from __future__ import annotations

from kvbridge.examples.plan_words import arrangement_words, group_words, plan_words, side_words
from kvbridge.handshake.messages import WireGroup, WireSpec
from kvbridge.handshake.plan_model import GroupPlan, Rewrite, TransferPlan
from kvbridge.layouts.arrangement import BlockArrangement, HeadOrder
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import KVCacheKind
from tests.handshake.descriptions import make_description

GROUP = WireGroup(
    group_id=0, layer_names=["l0", "l1"], spec=WireSpec(kind="full_attention", block_size=16)
)
PREFILL = make_description("p", block_size=64, kernel_block_size=64, cross_layer=True)
DECODE = make_description("d", block_size=16, kernel_block_size=8, kv_layout="HND", groups=[GROUP])


def _group(**kwargs: object) -> GroupPlan:
    fields: dict = dict(
        group_id=0,
        kind=KVCacheKind.FULL_ATTENTION,
        wire_tokens=16,
        local_chunks_per_block=1,
        remote_chunks_per_block=4,
        sender=None,
        receiver=None,
        streams=(),
    )
    return GroupPlan(**(fields | kwargs))


def test_an_arrangement_names_its_chunks_and_sub_blocks():
    whole = BlockArrangement(layout=KVLayout.NHD)
    assert arrangement_words(whole, 64) == "one 64-token NHD block (1x1xNHD)"
    cut = BlockArrangement(layout=KVLayout.HND, num_chunks=4, sub_blocks_per_chunk=2)
    assert arrangement_words(cut, 64) == "4 chunks of 2 8-token HND sub-blocks (4x2xHND)"
    heads = BlockArrangement(layout=KVLayout.HND, heads=HeadOrder.IN_LAYER, parts_outer=True)
    assert arrangement_words(heads, 16) == (
        "one 16-token HND block, heads outermost, K and V apart (1x1xHNDPN-Hlayer)"
    )


def test_each_side_says_its_block_size_layout_and_pages():
    assert side_words("prefill", PREFILL) == (
        "prefill pages its KV cache in 64-token blocks, token-major (NHD), all 2 layers of a "
        "block in one page (cross-layer)"
    )
    assert side_words("decode", DECODE) == (
        "decode pages its KV cache in 16-token blocks of 8-token kernel blocks, head-major "
        "(HND), one page per layer"
    )


def test_a_sender_rewrite_is_prefills_and_a_plain_group_nobodys():
    sender = Rewrite(
        src=BlockArrangement(layout=KVLayout.NHD),
        dst=BlockArrangement(layout=KVLayout.HND, num_chunks=4, sub_blocks_per_chunk=2),
    )
    lines = group_words(_group(sender=sender), PREFILL, DECODE, "pull")
    assert lines[0] == (
        "group 0 (full attention, 2 layers): the tokens move in 16-token chunks, 4 per "
        "prefill block and 1 per decode block"
    )
    assert lines[1].startswith(
        "  prefill rewrites each block from one 64-token NHD block (1x1xNHD) to 4 chunks"
    )
    assert group_words(_group(), PREFILL, DECODE, "pull")[1:] == [
        "  nobody rewrites: the bytes land as they are"
    ]
    plan = TransferPlan(
        local_engine_id="d", remote_engine_id="p", remote_agent_name="a", groups=(_group(),)
    )
    words = plan_words(PREFILL, DECODE, plan)
    assert words[2] == "over NIXL, decode READs prefill's blocks from prefill's memory (pull)"
    assert words[-1] == "who rewrites: nobody"
