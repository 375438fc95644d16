"""Which of prefill's kept blocks are lent to readers, in which arrangement.

A block shared by several kept requests (prefix caching) may be read by several readers
at once. Each either reads it as it is (a *native* claim) or has it rewritten in place
into its plan's arrangement (permute after save). The book keeps them apart::

    rewritten for reader A as X   ->  B may share it as X (one more reader);
                                      B wanting Y, or wanting it as it is: refused
    read as it is by reader A     ->  B wanting any rewrite of it: refused
    last reader of a rewrite gone ->  the block is restored (fenced), native again

:class:`~kvbridge.connector.worker.prefill.sender.Sender` owns one book and tells it,
per kept request (``Lent``), what its readers claimed and when its hold ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvbridge.connector.common.metadata import SendSpec
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.worker.device_order import DeviceOrder
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.arrangement import BlockArrangement
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.specs import AttentionSpec
from kvbridge.layouts.transforms import rewrite_group


class Lent(Protocol):
    """A kept request as the book sees it: its blocks and what its readers claimed."""

    spec: SendSpec
    rewritten: dict[int, tuple[BlockArrangement, BlockArrangement]]  # group -> (src, dst)
    native: set[int]  # groups a reader claimed as they are


@dataclass
class _BlockRewrite:
    src: BlockArrangement
    dst: BlockArrangement
    readers: int


class BlockLending:
    """Rewrites, restores and native claims of one prefill worker's kept blocks."""

    def __init__(
        self, buffers: KVCacheBuffers, metrics: ConnectorMetrics, order: DeviceOrder
    ) -> None:
        self._buffers = buffers
        self._metrics = metrics
        self._order = order
        self._blocks: dict[tuple[int, int], _BlockRewrite] = {}  # (group, block) -> state
        # (group, block) -> requests whose reader claimed it in its native arrangement
        self._native: dict[tuple[int, int], int] = {}

    def rewrite(
        self, pending: Lent, group_id: int, src: BlockArrangement, dst: BlockArrangement
    ) -> None:
        groups = self._buffers.config.groups
        if not 0 <= group_id < len(groups) or not isinstance(groups[group_id].spec, AttentionSpec):
            raise KVBridgeError(f"rewrite names group {group_id}, which is not an attention group")
        native = self._buffers.format.native_arrangement(groups[group_id].spec.block_size)
        if src != native:
            raise KVBridgeError(
                f"group {group_id}: reader expects blocks in {src}, ours are {native}"
            )
        if group_id in pending.rewritten:
            if pending.rewritten[group_id] == (src, dst):
                return
            raise KVBridgeError(f"group {group_id} already rewritten to another arrangement")
        ids = np.unique(np.asarray(pending.spec.block_ids[group_id], dtype=np.int64))
        fresh = []
        for b in ids.tolist():
            if self._native.get((group_id, b)):
                raise KVBridgeError(
                    f"block {b} of group {group_id} is read in its native arrangement by "
                    f"another reader; cannot rewrite it as {dst} now"
                )
            state = self._blocks.get((group_id, b))
            if state is None:
                fresh.append(b)
            elif (state.src, state.dst) != (src, dst):
                raise KVBridgeError(
                    f"block {b} of group {group_id} is lent to another reader as {state.dst}; "
                    f"cannot rewrite it as {dst} at the same time"
                )
        if fresh:
            stats = rewrite_group(self._buffers, group_id, np.asarray(fresh), src, dst)
            self._metrics.sender_rewrites += stats.num_blocks
            self._order.fence("sender rewrite")  # NIXL reads what the kernels wrote
        for b in ids.tolist():
            state = self._blocks.setdefault(
                (group_id, b), _BlockRewrite(src=src, dst=dst, readers=0)
            )
            state.readers += 1
        pending.rewritten[group_id] = (src, dst)

    def claim_native(self, pending: Lent, groups: set[int], *, release: bool = False) -> None:
        """Record the groups a reader claimed as they are (no other reader may have their
        blocks rewritten meanwhile); ``release``: the hold ended, forget them all."""
        for group_id in set(pending.native) if release else groups - pending.native:
            for b in set(pending.spec.block_ids[group_id]):
                key = (group_id, b)
                self._native[key] = self._native.get(key, 0) + (-1 if release else 1)
                if self._native[key] == 0:
                    del self._native[key]
        pending.native = set() if release else pending.native | groups

    def check_native(self, pending: Lent, rewritten: set[int]) -> None:
        """The reader reads every group but ``rewritten`` as it is: refuse when a block of
        such a group is rewritten for another reader right now (it holds other bytes)."""
        for group_id, ids in enumerate(pending.spec.block_ids):
            if group_id in rewritten:
                continue
            for b in ids:
                state = self._blocks.get((group_id, b))
                if state is not None:
                    raise KVBridgeError(
                        f"block {b} of group {group_id} is lent to another reader as "
                        f"{state.dst}; cannot be read in its native arrangement now"
                    )

    def restore(self, pending: Lent, groups: set[int] | None = None) -> None:
        """Undo the request's rewrites (only ``groups``, if given) on the blocks no other
        request still holds rewritten; fenced, so the engine (or a reader of the native
        format) never sees a half-restored block."""
        restored = 0
        for group_id in sorted(set(pending.rewritten) if groups is None else groups):
            src, dst = pending.rewritten.pop(group_id)
            ids = np.unique(np.asarray(pending.spec.block_ids[group_id], dtype=np.int64))
            last = []
            for b in ids.tolist():
                state = self._blocks[(group_id, b)]
                state.readers -= 1
                if state.readers == 0:
                    del self._blocks[(group_id, b)]
                    last.append(b)
            if last:
                stats = rewrite_group(self._buffers, group_id, np.asarray(last), dst, src)
                self._metrics.sender_restores += stats.num_blocks
                restored += stats.num_blocks
        if restored:
            self._order.fence("sender restore")
