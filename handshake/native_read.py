"""Reading a sender that may not rewrite its blocks: pieces in its native arrangement.

A plan normally asks the sender to rewrite its blocks after save into the reader's wire
chunks. A sender whose engine may read those blocks meanwhile (``rewrites_in_place``
false) is read as it is: every piece of the wire plan is cut where its bytes stop being
contiguous in the sender's native arrangement (e.g. one piece per head).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.pieces import geometries
from kvbridge.handshake.plan_model import PieceStream, Rewrite
from kvbridge.layouts.arrangement import UnitGeometry, element_offsets
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.specs import AttentionSpec


def unless_rewritten(
    streams: tuple[PieceStream, ...],
    remote: PeerLayout,
    group_id: int,
    spec: AttentionSpec,
    sender: Rewrite | None,
    chunks: int,
    min_piece_bytes: int,
) -> tuple[tuple[PieceStream, ...], Rewrite | None, bool]:
    """(streams, sender rewrite, read natively): as planned, unless the plan needs
    ``remote`` to rewrite its blocks and it may not; then every stream re-cut by
    :func:`native_stream` to read its blocks as they are, and no sender rewrite."""
    if sender is None or remote.rewrites_in_place:
        return streams, sender, False
    geometry = geometries(remote, group_id, spec)[0]
    native = tuple(
        native_stream(s, geometry, sender, chunks, group_id, min_piece_bytes) for s in streams
    )
    return native, None, True


def native_stream(
    stream: PieceStream,
    geometry: UnitGeometry,
    rewrite: Rewrite,
    chunks: int,
    group_id: int,
    min_piece_bytes: int,
) -> PieceStream:
    """``stream`` re-cut to read the sender's ``rewrite.src`` bytes where the plan wanted
    its ``rewrite.dst`` bytes: each piece splits into runs contiguous in ``src``."""
    # Elements of one head row (head_size x itemsize bytes) never split: probe with them.
    elem = geometry.head_size * geometry.itemsize
    probe = replace(geometry, head_size=1, itemsize=8)
    dst, src = element_offsets(probe, rewrite.dst), element_offsets(probe, rewrite.src)
    src_at = np.empty_like(dst)
    src_at[dst] = src  # element at dst position p lies at src position src_at[p]
    chunk = probe.unit_elems // chunks
    if stream.remote_chunk_bytes != chunk * elem or stream.length % elem:
        raise LayoutError(f"group {group_id}: pieces do not cover whole head rows")
    n = stream.length // elem
    per_chunk = np.stack(
        [
            np.concatenate(
                [src_at[q * chunk + off // elem + np.arange(n)] for off in stream.remote_offsets]
            )
            for q in range(chunks)
        ]
    )
    # every chunk must be the same pieces, shifted: each chunk then starts where its first
    # element lies. Chunks of a sender whose kernel blocks are smaller than its blocks are
    # not evenly spaced (the next kernel block is further away): the stream lists each
    # chunk's start then
    chunk_starts = per_chunk[:, 0]
    shape = per_chunk - chunk_starts[:, None]
    if not (shape == shape[:1]).all():
        raise LayoutError(
            f"group {group_id}: the sender's {rewrite.src} blocks cannot be read as "
            f"{rewrite.dst} chunks without a rewrite (its chunks are not laid out alike)"
        )
    stride = int(chunk_starts[1] - chunk_starts[0]) if chunks > 1 else 0
    even = bool((chunk_starts == chunk_starts[0] + stride * np.arange(chunks)).all())
    first = per_chunk[0] if even else shape[0]
    breaks = np.flatnonzero(np.diff(first) != 1) + 1
    starts = np.concatenate([breaks, np.arange(0, first.size, n)])
    run = int(np.gcd.reduce(np.concatenate([[n], starts])))
    length = run * elem
    if length < min_piece_bytes:
        raise LayoutError(
            f"group {group_id}: reading the sender's {rewrite.src} blocks as {rewrite.dst} "
            f"chunks without a rewrite needs {length}-byte pieces (fewer than "
            f"{min_piece_bytes}); the sender does not rewrite blocks in place (HND blocks "
            f"keep each head's tokens in one run: vLLM's VLLM_KV_CACHE_LAYOUT=HND)"
        )
    local_offsets = []
    remote_offsets = []
    for k, off in enumerate(stream.local_offsets):
        for j in range(0, n, run):
            local_offsets.append(off + j * elem)
            remote_offsets.append(int(first[k * n + j]) * elem)
    return PieceStream(
        local_region=stream.local_region,
        remote_region=stream.remote_region,
        local_offsets=tuple(local_offsets),
        remote_offsets=tuple(remote_offsets),
        length=length,
        local_chunk_bytes=stream.local_chunk_bytes,
        remote_chunk_bytes=stride * elem if chunks > 1 else stream.remote_chunk_bytes,
        remote_chunk_starts=() if even else tuple(int(x) * elem for x in chunk_starts),
    )
