"""Pipeline stages: plan over the layers both ranks hold.

Under pipeline parallelism a rank holds only its stage's layers, so its KV-cache groups list
a contiguous run of each group's layers (vLLM splits the model's layers over the stages
with ``get_pp_indices``; prefill and decode may split them differently, or not at all). A
decode rank reads from a prefill rank exactly the layers both hold: :func:`layer_window`
cuts both descriptions down to those layers, and negotiation then plans as if the model
had only them::

    prefill PP 2 (layers 0-1 | 2-3), decode PP 1 (0-3):
        decode reads layers 0-1 from stage 0 and 2-3 from stage 1
    prefill PP 1 (0-3), decode PP 2 (0-1 | 2-3):
        each decode stage reads its own layers from the one prefill rank

A per-layer region in the window is renumbered inside it; one outside it keeps its index
(plans name regions by index) but belongs to no group, so no plan moves it. A
cross-layer region holds every layer of its group in one page per block, so it can only
be read whole: a window that cuts it is refused by name (the bytes of a layer run inside
a cross-layer page are not one contiguous range once the sender rewrites them).
"""

from __future__ import annotations

from dataclasses import replace

from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.errors import IncompatiblePeerError


def layer_window(local: PeerLayout, remote: PeerLayout, peer: str) -> tuple[PeerLayout, PeerLayout]:
    """``local`` and ``remote`` cut down to the layers both hold (both unchanged when they
    hold the same layers), or :class:`IncompatiblePeerError` naming the group whose layers
    cannot be matched."""
    lgroups, rgroups = local.config.groups, remote.config.groups
    if len(lgroups) != len(rgroups) or all(
        lg.layer_names == rg.layer_names for lg, rg in zip(lgroups, rgroups, strict=True)
    ):
        return local, remote  # same layers (or a mismatch negotiation names)
    window: list[tuple[str, ...]] = []
    for lg, rg in zip(lgroups, rgroups, strict=True):
        mine, theirs = set(lg.layer_names), set(rg.layer_names)
        common = tuple(n for n in lg.layer_names if n in theirs)
        if common != tuple(n for n in rg.layer_names if n in mine):
            raise IncompatiblePeerError(
                [(f"groups[{lg.group_id}].layer_names", lg.layer_names, rg.layer_names)],
                peer=peer,
                hint="the layers both ranks hold are in a different order",
            )
        if not common:
            raise IncompatiblePeerError(
                [(f"groups[{lg.group_id}].layer_names", lg.layer_names, rg.layer_names)],
                peer=peer,
                hint="no layer of this group is held by both ranks: a load between these "
                "pipeline stages would leave the group's KV unwritten",
            )
        window.append(common)
    return _cut(local, window, peer, "local"), _cut(remote, window, peer, "remote")


def _cut(side: PeerLayout, window: list[tuple[str, ...]], peer: str, which: str) -> PeerLayout:
    groups = tuple(
        replace(g, layer_names=names) for g, names in zip(side.config.groups, window, strict=True)
    )
    regions = []  # every region stays, at its index: plans name regions by index
    for info in side.regions:
        if info.group_id < 0:
            regions.append(info)
            continue
        names = side.config.groups[info.group_id].layer_names
        kept = window[info.group_id]
        if info.layer_index < 0:
            if kept != names:
                raise IncompatiblePeerError(
                    [
                        (
                            f"groups[{info.group_id}].layers ({which} cross-layer)",
                            len(names),
                            f"{len(kept)} shared",
                        )
                    ],
                    peer=peer,
                    hint="a cross-layer block holds all of its stage's layers in one page and "
                    "is read whole; give the two engines the same pipeline split, or "
                    "per-layer caches on the side that holds more layers",
                )
            regions.append(info)
        elif names[info.layer_index] in kept:
            regions.append(replace(info, layer_index=kept.index(names[info.layer_index])))
        else:  # a layer this pair does not move: no group's plan looks at it
            regions.append(replace(info, group_id=-1))
    config = replace(side.config, groups=groups)
    return replace(side, config=config, regions=tuple(regions))
