"""A pair's transfer plan in words, for a reader new to kvbridge (the demo prints it).

The plan is the one decode computes at its handshake with prefill (``check_compatible``,
then ``negotiate``, from the two workers' descriptions, fetched from their side
channels as any peer fetches them). Each sentence says one thing: how each side pages its
cache, who moves the bytes (pull: decode READs, push: prefill WRITEs), in what chunks,
and who rewrites blocks from one format into the other::

    prefill pages its KV cache in 64-token blocks, token-major (NHD), all 4 layers of a
      block in one page (cross-layer)
    decode pages it in 16-token blocks of 8-token kernel blocks, head-major (HND), one
      page per layer
    ...
"""

from __future__ import annotations

from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.compat import check_compatible
from kvbridge.handshake.description import parse_description
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.handshake.plan import negotiate
from kvbridge.handshake.plan_model import GroupPlan, Rewrite, TransferPlan
from kvbridge.layouts.arrangement import BlockArrangement, HeadOrder
from kvbridge.layouts.specs import KVCacheKind

LAYOUT_WORDS = {"NHD": "token-major (NHD)", "HND": "head-major (HND)"}
KIND_WORDS = {
    "full_attention": "full attention",
    "sliding_window": "sliding window",
    "state": "recurrent state",
}


def fetch_description(host: str, port: int, *, timeout_s: float = 5.0) -> WorkerDescription:
    """A worker's description, asked of its side channel as a peer asks (no secret)."""
    client = HandshakeClient(
        ClientConfig(timeout_s=timeout_s, retries=1), requester_engine_id="kvbridge-demo"
    )
    try:
        return client.fetch(host, port)
    finally:
        client.close()


def decode_plan(prefill: WorkerDescription, decode: WorkerDescription) -> TransferPlan:
    """The plan decode's handshake with ``prefill`` ends in (``IncompatiblePeerError``
    when it refuses the pair; push mode: prefill plans the same from the same two)."""
    check_compatible(decode, prefill, peer=f"{prefill.engine_id}/rank{prefill.rank}")
    reader = parse_description(decode)
    return negotiate(reader, parse_description(prefill), can_repack=reader.can_repack)


def side_words(role: str, desc: WorkerDescription) -> str:
    kernel = (
        f" of {desc.kernel_block_size}-token kernel blocks"
        if desc.kernel_block_size != desc.block_size
        else ""
    )
    pages = (
        f"all {desc.num_layers} layers of a block in one page (cross-layer)"
        if desc.cross_layer
        else "one page per layer"
    )
    layout = LAYOUT_WORDS.get(desc.kv_layout, desc.kv_layout)
    return f"{role} pages its KV cache in {desc.block_size}-token blocks{kernel}, {layout}, {pages}"


def arrangement_words(arr: BlockArrangement, block_size: int) -> str:
    """``arr`` of one ``block_size``-token block, e.g. "4 chunks of 2 8-token HND
    sub-blocks (4x2xHND)"."""
    layout = arr.layout.value
    if arr.num_chunks == 1 and arr.sub_blocks_per_chunk == 1:
        text = f"one {block_size}-token {layout} block"
    else:
        sub = arr.sub_block_size(block_size)
        chunks = f"{arr.num_chunks} chunk{'s' if arr.num_chunks > 1 else ''}"
        text = f"{chunks} of {arr.sub_blocks_per_chunk} {sub}-token {layout} sub-blocks"
    if arr.heads is not HeadOrder.INNER:
        text += ", heads outermost"
    if arr.parts_outer:
        text += ", K and V apart"
    return f"{text} ({arr})"


def _rewrite(who: str, rewrite: Rewrite, block_size: int) -> str:
    src = arrangement_words(rewrite.src, block_size)
    return f"{who} rewrites each block from {src} to {arrangement_words(rewrite.dst, block_size)}"


def group_words(
    g: GroupPlan, prefill: WorkerDescription, decode: WorkerDescription, mode: str
) -> list[str]:
    """What happens to one KV-cache group: its chunks and its rewrites."""
    wire = next(w for w in decode.groups if w.group_id == g.group_id)
    kind = KIND_WORDS.get(wire.spec.kind, wire.spec.kind)
    head = f"group {g.group_id} ({kind}, {len(wire.layer_names)} layers)"
    if g.skipped:
        return [f"{head}: another pipeline stage moves it"]
    if g.kind is KVCacheKind.STATE:
        moves = "one state per request, the one decode resumes from"
    else:
        what = "only the window's tokens" if wire.spec.kind == "sliding_window" else "the tokens"
        moves = (
            f"{what} move in {g.wire_tokens}-token chunks, {g.remote_chunks_per_block} per "
            f"prefill block and {g.local_chunks_per_block} per decode block"
        )
    lines = [f"{head}: {moves}"]
    if g.sender is not None:
        when = "before decode reads them" if mode == "pull" else "before it writes them"
        lines.append(
            f"  {_rewrite('prefill', g.sender, prefill.block_size)}, {when}, and restores "
            "its own format after"
        )
    if g.native_read:
        lines.append("  prefill's blocks are read as they are, one descriptor per contiguous run")
    if g.repack_from:
        lines.append(
            f"  whole {g.repack_from}-token prefill pages land side by side in a decode block; "
            "decode's engine repacks them"
        )
    if g.split_from:
        lines.append(
            f"  whole {g.split_from}-token prefill pages land in staging slots; decode's "
            "engine splits them into its blocks"
        )
    if g.receiver is not None:
        lines.append(f"  {_rewrite('decode', g.receiver, decode.block_size)}, after they land")
    if g.head_slice:
        local, remote, n = g.head_slice
        lines.append(
            f"  decode's heads {local}..{local + n - 1} are prefill's {remote}..{remote + n - 1}"
        )
    if len(lines) == 1:
        lines.append("  nobody rewrites: the bytes land as they are")
    return lines


def plan_words(
    prefill: WorkerDescription, decode: WorkerDescription, plan: TransferPlan
) -> list[str]:
    mode = decode.transfer_mode
    who = (
        "decode READs prefill's blocks from prefill's memory (pull)"
        if mode == "pull"
        else "prefill WRITEs its blocks into decode's memory (push)"
    )
    lines = [side_words("prefill", prefill), side_words("decode", decode)]
    lines.append(f"over NIXL, {who}")
    for g in plan.groups:
        lines += group_words(g, prefill, decode, mode)
    rewriters = [
        name
        for name, any_rewrite in (
            ("prefill", any(g.sender for g in plan.groups)),
            ("decode", any(g.receiver or g.repack_from or g.split_from for g in plan.groups)),
        )
        if any_rewrite
    ]
    lines.append(f"who rewrites: {' and '.join(rewriters) if rewriters else 'nobody'}")
    return lines
