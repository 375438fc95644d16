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

A group of which the two hold no layer in common (a hybrid model's stages can share a
sliding-window layer but no full-attention one) gets a plan that moves nothing: another
stage holds those layers. A per-layer region in the window is renumbered inside it; one
outside it keeps its index (plans name regions by index) but belongs to no group, so no
plan moves it. A cross-layer region holds every layer of its group in one page per
block, so it can only be read whole: a window that cuts it is refused by name (the bytes
of a layer run inside a cross-layer page are not one contiguous range once the sender
rewrites them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.errors import IncompatiblePeerError


@dataclass(frozen=True)
class LayerWindow:
    """The two sides cut down to the layers both hold, and per group the local layers a
    plan between them moves: None when the group is not cut (every local layer moves),
    () when the two hold none of its layers (another stage holds them: the group's plan
    moves nothing)."""

    local: PeerLayout
    remote: PeerLayout
    layers: tuple[tuple[str, ...] | None, ...]

    def moves_nothing(self, group_id: int) -> bool:
        return self.layers[group_id] == ()


def layer_window(local: PeerLayout, remote: PeerLayout, peer: str) -> LayerWindow:
    """``local`` and ``remote`` cut down to the layers both hold (both unchanged when they
    hold the same layers), or :class:`IncompatiblePeerError` naming the group whose layers
    cannot be matched, or all groups when the two share no layer at all."""
    lgroups, rgroups = local.config.groups, remote.config.groups
    if len(lgroups) != len(rgroups) or all(
        lg.layer_names == rg.layer_names for lg, rg in zip(lgroups, rgroups, strict=True)
    ):  # same layers (or a mismatch negotiation names)
        return LayerWindow(local, remote, tuple(None for _ in lgroups))
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
        window.append(common)
    if not any(window):
        raise IncompatiblePeerError(
            [("layer_names", local.config.layer_names, remote.config.layer_names)],
            peer=peer,
            hint="the two ranks hold no layer in common: pipeline stages whose layers do "
            "not overlap have nothing to move",
        )
    layers = tuple(
        None if names == lg.layer_names else names
        for names, lg in zip(window, lgroups, strict=True)
    )
    return LayerWindow(
        _cut(local, window, peer, "local"), _cut(remote, window, peer, "remote"), layers
    )


def _cut(side: PeerLayout, window: list[tuple[str, ...]], peer: str, which: str) -> PeerLayout:
    # a group with no shared layer keeps its layers (a group has some), but none of its
    # regions: negotiation gives it a plan that moves nothing
    groups = tuple(
        replace(g, layer_names=names) if names else g
        for g, names in zip(side.config.groups, window, strict=True)
    )
    regions = []  # every region stays, at its index: plans name regions by index
    for info in side.regions:
        if info.group_id < 0:
            regions.append(info)
            continue
        names = side.config.groups[info.group_id].layer_names
        kept = window[info.group_id]
        if not kept:
            regions.append(replace(info, group_id=-1))
        elif info.layer_index < 0:
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
