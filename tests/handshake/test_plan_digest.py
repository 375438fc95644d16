"""The plan digest a push writer compares with its reader's is stable across builds.

``TransferPlan.digest`` hashes the plan's repr; a field added to a plan dataclass changes
every repr, and then every push between an upgraded and a not-yet-upgraded side fails
("the two sides see different descriptions") although both planned the same bytes. The
digests below were computed by the build before ``PieceStream.remote_chunk_starts``
(commit 0707071): plans that do not use a new field must keep them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbridge.handshake.plan import negotiate
from tests.handshake.plan_harness import cache_format, make_side

PINNED = [
    ((16, "NHD", True), (16, "NHD", True), "5bdb3904ee87e796"),
    ((64, "HND", False), (16, "NHD", False), "bede1719249fc778"),
    ((128, "NHD", True), (32, "HND", False), "e10157788b5ea682"),
]


@pytest.mark.parametrize(("remote", "local", "digest"), PINNED)
def test_a_plan_keeps_the_digest_earlier_builds_computed(remote, local, digest) -> None:
    r = make_side("prefill", remote[0], cache_format(*remote[1:]), "F", num_blocks=8)
    d = make_side("decode", local[0], cache_format(*local[1:]), "F", num_blocks=8)
    assert negotiate(d.layout, r.layout, min_native_piece_bytes=1).digest == digest


def test_uneven_chunk_starts_are_part_of_the_digest() -> None:
    """A sender read natively whose 64-token kernel blocks split into 32-token chunks: the
    chunks are not evenly spaced, the plan lists their starts, and the digest covers them."""
    remote = make_side(
        "prefill",
        128,
        cache_format("HND", False, kernel=64),
        "F",
        num_blocks=8,
        rewrites_in_place=False,
    )
    local = make_side("decode", 32, cache_format("HND", False), "F", num_blocks=8)
    plan = negotiate(local.layout, remote.layout, min_native_piece_bytes=1)
    group = plan.groups[0]
    assert group.native_read
    starts = group.streams[0].remote_chunk_starts
    chunk = group.streams[0].length  # a head's 32 tokens; a kernel block: K, V x 2 heads x 64
    assert starts == (0, chunk, 8 * chunk, 9 * chunk)
    evened = replace(
        plan,
        groups=(
            replace(
                group, streams=tuple(replace(s, remote_chunk_starts=()) for s in group.streams)
            ),
            *plan.groups[1:],
        ),
    )
    assert evened.digest != plan.digest
