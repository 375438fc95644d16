"""What a NIXL engine registered: regions, the tensors kept alive, and the checks that a
new registration overlaps nothing and that descriptors lie inside one registration."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.connector.transfer.errors import DescriptorError, RegistrationError
from kvbridge.layouts.region import MemoryKind


@dataclass(frozen=True)
class Registration:
    native: object  # nixlRegDList, needed to deregister
    tensors: tuple[torch.Tensor, ...]  # kept alive while registered
    spans: np.ndarray  # Nx3 int64 (addr, len, device_id)
    memory_kind: MemoryKind


def check_no_overlap(registrations: list[Registration], spans: np.ndarray, what: str) -> None:
    """Raise ``RegistrationError`` when a new span overlaps another (new or registered)."""
    everything = np.concatenate([r.spans for r in registrations] + [spans])
    order = np.argsort(everything[:, 0], kind="stable")
    starts, ends = everything[order, 0], everything[order, 0] + everything[order, 1]
    clash = np.flatnonzero(starts[1:] < ends[:-1])
    if len(clash):
        a, b = everything[order[clash[0]]], everything[order[clash[0] + 1]]
        raise RegistrationError(
            f"{what}: region {a.tolist()} overlaps {b.tolist()} "
            "(addr, len, device_id); register each allocation once"
        )


def registered_rows(
    registrations: list[Registration], descs: np.ndarray, what: str
) -> tuple[MemoryKind, np.ndarray]:
    """Check every row lies inside one registration; return their common memory kind and,
    per row, which registered span holds it (rows that merely touch across two spans are
    two allocations: never one descriptor)."""
    if not registrations:
        raise DescriptorError(f"{what}: nothing registered yet")
    spans = np.concatenate([r.spans for r in registrations])
    kinds = np.concatenate([np.full(len(r.spans), i) for i, r in enumerate(registrations)])
    order = np.argsort(spans[:, 0])
    spans, kinds = spans[order], kinds[order]
    pos = np.searchsorted(spans[:, 0], descs[:, 0], side="right") - 1
    inside = pos >= 0
    pos = np.maximum(pos, 0)
    inside &= descs[:, 0] + descs[:, 1] <= spans[pos, 0] + spans[pos, 1]
    inside &= descs[:, 2] == spans[pos, 2]
    bad = np.flatnonzero(~inside)
    if len(bad):
        raise DescriptorError(
            f"{what}: row {bad[0]} = {descs[bad[0]].tolist()} (addr, len, device_id) lies "
            f"outside every registered region ({len(spans)} registered)"
        )
    found = {registrations[i].memory_kind for i in np.unique(kinds[pos])}
    if len(found) != 1:
        kinds_seen = sorted(k.value for k in found)
        raise DescriptorError(f"{what}: rows span memory kinds {kinds_seen}")
    return found.pop(), pos
