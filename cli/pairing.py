"""Whether a decode worker can read a prefill worker's KV cache, and how: the plan a
worker computes at its handshake (``check_compatible``, then ``negotiate``, the same pure
functions the connector calls), turned into what a request of a given prompt length costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvbridge.handshake.compat import check_compatible
from kvbridge.handshake.description import PeerLayout, parse_description
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.handshake.plan import negotiate
from kvbridge.handshake.plan_model import GroupPlan, TransferPlan
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.specs import KVCacheKind, SlidingWindowSpec


class DescriptionError(KVBridgeError):
    """A file that is not a worker description."""


def load_description(path: str | Path) -> WorkerDescription:
    """A worker description saved as JSON (``kvbridge describe`` or ``kvbridge probe
    --save``)."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=WorkerDescription)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DescriptionError(f"{path}: not a kvbridge worker description: {exc}") from None


def save_description(desc: WorkerDescription, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.encode(desc))


@dataclass(frozen=True)
class Pairing:
    """The plan decode computes against prefill (or the refusal)."""

    plan: TransferPlan | None
    refusal: IncompatiblePeerError | None
    decode: PeerLayout | None = None


def pair(prefill: WorkerDescription, decode: WorkerDescription) -> Pairing:
    """What decode's handshake with prefill ends in: a plan, or the refusal naming the
    fields (push mode: prefill plans the same way, from the same two descriptions)."""
    peer = f"{prefill.engine_id}/rank{prefill.rank}"
    try:
        check_compatible(decode, prefill, peer=peer)
        reader, source = parse_description(decode), parse_description(prefill)
        plan = negotiate(reader, source, can_repack=reader.can_repack)
    except IncompatiblePeerError as exc:
        return Pairing(None, exc)
    return Pairing(plan, None, reader)


@dataclass(frozen=True)
class GroupCost:
    group: GroupPlan
    chunks: int
    descriptors: int
    bytes: int
    note: str


def request_cost(pairing: Pairing, prompt_tokens: int) -> list[GroupCost]:
    """Per group, what one request of ``prompt_tokens`` moves: decode computes the last
    prompt token itself and loads the ``prompt_tokens - 1`` before it; a sliding-window
    group only the window; a state group one state."""
    assert pairing.plan is not None and pairing.decode is not None
    tokens = max(prompt_tokens - 1, 0)
    specs = {g.group_id: g.spec for g in pairing.decode.config.groups}
    out = []
    for g in pairing.plan.groups:
        spec = specs[g.group_id]
        if g.kind is KVCacheKind.STATE:
            chunks, note = (1 if tokens else 0), "one state per request"
        elif isinstance(spec, SlidingWindowSpec):
            start = spec.window_start(tokens)
            chunks = len(g.chunks_for_tokens(start, tokens))
            note = f"the last {tokens - start} tokens"
        else:
            chunks, note = math.ceil(tokens / g.wire_tokens), f"{tokens} tokens"
        out.append(
            GroupCost(g, chunks, chunks * g.descriptors_per_chunk, chunks * g.bytes_per_chunk, note)
        )
    return out


def describe_text(desc: WorkerDescription) -> str:
    """A worker description in a few lines."""
    lines = [
        f"engine {desc.engine_id} rank {desc.rank}/{desc.tp_size} "
        f"(protocol {desc.protocol_version}, side channel "
        f"{desc.side_channel_host}:{desc.side_channel_port})",
        f"  model {desc.model_name} {desc.dtype}: {desc.num_layers} layers, "
        f"{desc.num_kv_heads} KV heads x {desc.head_size}",
        f"  blocks {desc.block_size} tokens (kernel {desc.kernel_block_size}), layout "
        f"{desc.kv_layout}{' cross-layer' if desc.cross_layer else ''}, packing "
        f"{desc.kv_packing}, transfer {desc.transfer_mode}",
    ]
    for g in desc.groups:
        lines.append(f"  group {g.group_id}: {g.spec.kind}, {len(g.layer_names)} layers")
    return "\n".join(lines)


def plan_text(pairing: Pairing, prompt_tokens: int) -> str:
    if pairing.refusal is not None:
        exc = pairing.refusal
        lines = ["REFUSED: these workers cannot pair"]
        lines += [f"  {name}: decode={a!r} prefill={b!r}" for name, a, b in exc.differences]
        lines.append(f"  fix: {exc.hint or 'make the fields above equal on both sides'}")
        return "\n".join(lines)
    assert pairing.plan is not None
    plan = pairing.plan
    lines = [f"PAIRS: {plan.remote_engine_id} -> {plan.local_engine_id}", str(plan)]
    costs = request_cost(pairing, prompt_tokens)
    lines.append(f"one request of {prompt_tokens} prompt tokens:")
    for c in costs:
        g = c.group
        staging = f", staging slot {g.staging_bytes} B" if g.staging_bytes else ""
        lines.append(
            f"  group {g.group_id}: {c.chunks} chunks ({c.note}) -> {c.descriptors} "
            f"descriptors, {c.bytes} B{staging}"
        )
    total_d, total_b = sum(c.descriptors for c in costs), sum(c.bytes for c in costs)
    lines.append(f"  total: {total_d} descriptors, {total_b} B")
    rewrites = plan.sender_rewrites()
    lines.append(
        "  rewrites: prefill "
        + (", ".join(f"group {k}: {v}" for k, v in rewrites.items()) or "none")
        + "; decode "
        + (
            ", ".join(f"group {g.group_id}: {g.receiver}" for g in plan.groups if g.receiver)
            or "none"
        )
    )
    return "\n".join(lines)
