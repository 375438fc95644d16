"""Prefill side of verified loads: the digests of exactly what a reader moves.

A decode that verifies a load asks for digests with its claim (``Prepare.verify``, with
the load's token range and the digest of the plan it reads by) or its Push
(``Push.verify``). Prefill names the rows of that load with decode's own plan and the
same row function decode uses (``kvbridge.connector.worker.rows``), on its own
request's block ids, and digests them where NIXL moves them from (the cache, or its host
mirror), after the rewrites the reader asked for::

    decode's description (sent with its handshake request) + ours --negotiate--> plan
    plan.digest == Prepare.plan_digest            else refused by name
    rows of [start, end) on prefill's block ids   --load_digests(WRITER)--> GroupDigest

So a decode that read other blocks than the request's (a stale or forged params, a
swapped row), or whose bytes changed on the way, sees a digest that is not its own.

Plans are negotiated once per reader agent and kept for as long as that agent's
description is known here (``MAX_PLANS`` readers at most, the oldest forgotten first).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from kvbridge.connector.common.metadata import SendSpec
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import GroupDigest, Prepare
from kvbridge.connector.worker.digests import PlanSide, load_digests, version_refusal
from kvbridge.connector.worker.rows import GroupRows, group_rows
from kvbridge.handshake.description import PeerLayout
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.plan import negotiate
from kvbridge.handshake.plan_model import GroupPlan, TransferPlan
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.specs import KVCacheKind

logger = logging.getLogger(__name__)

MAX_PLANS = 1024  # reader agents whose plan is kept


class ReaderDigests:
    """Digests of the rows a reader moves of a request kept here."""

    def __init__(
        self,
        local: PeerLayout,
        units: list[torch.Tensor],
        reader_layout: Callable[[str], PeerLayout | None],
    ) -> None:
        """``local``: this worker's layout (as described); ``units``: the memory of its
        regions, where NIXL moves from; ``reader_layout(agent)``: the layout the reader
        with that NIXL agent described with its handshake request (None: unknown)."""
        self._local = local
        self._units = units
        self._reader_layout = reader_layout
        self._plans: OrderedDict[str, tuple[PeerLayout, TransferPlan]] = OrderedDict()

    def for_claim(
        self, spec: SendSpec, agent: str, plan_digest: str, start: int, end: int
    ) -> list[GroupDigest]:
        """The digests of tokens ``[start, end)`` of ``spec`` as the reader ``agent``
        reads them on the plan ``plan_digest``. Raises :class:`KVBridgeError` naming why
        they cannot be given."""
        layout, plan = self.plan_for(agent, plan_digest)
        return self.for_plan(plan, layout, spec, start, end)

    def plan_for(self, agent: str, plan_digest: str) -> tuple[PeerLayout, TransferPlan]:
        """The reader ``agent``'s layout and the plan it reads by, which must be
        ``plan_digest``; raises :class:`KVBridgeError` naming why not."""
        layout, plan = self._plan(agent)
        if plan.digest != plan_digest:
            raise KVBridgeError(
                f"the reader planned {plan_digest}, this prefill {plan.digest} from the "
                f"description the reader sent: the two sides see different descriptions "
                f"(restarted or reconfigured?)"
            )
        return layout, plan

    def for_plan(
        self, plan: TransferPlan, reader: PeerLayout, spec: SendSpec, start: int, end: int
    ) -> list[GroupDigest]:
        """The digests of tokens ``[start, end)`` of ``spec`` moved by ``plan`` (decode's
        plan: ``reader`` is its local side, this worker its remote side)."""
        refused = version_refusal(reader.digest_version, "the reader")
        if refused:
            raise KVBridgeError(refused)
        rows_of = writer_rows(reader, spec, start, end)
        return list(load_digests(plan, PlanSide.WRITER, self._units, rows_of).digests)

    def _plan(self, agent: str) -> tuple[PeerLayout, TransferPlan]:
        known = self._plans.get(agent)
        if known is not None:
            self._plans.move_to_end(agent)
            return known
        layout = self._reader_layout(agent)
        if layout is None:
            raise KVBridgeError(
                f"reader {agent or '?'} asked for digests or packed rows but sent no "
                f"description with its handshake request (or it was pruned here): it must "
                f"handshake again"
            )
        try:
            plan = negotiate(layout, self._local, can_repack=layout.can_repack)
        except IncompatiblePeerError as exc:
            raise KVBridgeError(f"no plan with reader {agent}: {exc}") from None
        self._plans[agent] = (layout, plan)
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return layout, plan

    def forget(self, agent: str) -> None:
        """The reader is gone (its agent pruned): its plan goes too."""
        self._plans.pop(agent, None)


def writer_rows(
    reader: PeerLayout, spec: SendSpec, start: int, end: int
) -> Callable[[GroupPlan], GroupRows]:
    """The rows of tokens ``[start, end)`` of ``spec`` a reader with layout ``reader``
    moves, group by group (its plan's writer side is ours). Raises :class:`KVBridgeError`
    for a token range that is none."""
    if not 0 <= start <= end:
        raise KVBridgeError(f"the load names tokens [{start}, {end})")

    def rows_of(g: GroupPlan) -> GroupRows:
        reader_spec = reader.config.groups[g.group_id].spec
        first = spec.first_block[g.group_id] if spec.first_block else 0
        kept_end = (first + len(spec.block_ids[g.group_id])) * g.remote_chunks_per_block
        # (a group another pipeline stage holds moves nothing: no blocks of ours to count)
        if g.streams and g.kind is not KVCacheKind.STATE and end > kept_end * g.wire_tokens:
            # before the reader's block ids are made up for the range (a peer names it)
            raise KVBridgeError(
                f"group {g.group_id}: the load names tokens up to {end}; this request's "
                f"blocks here hold {kept_end * g.wire_tokens}"
            )
        # the reader's own block ids do not change which of our rows move: number its
        # logical blocks 0.. (enough for every token of the load)
        num = -(-end // reader_spec.block_size) + 1
        dummy = (
            np.broadcast_to(np.int64(0), (num,))  # a state group reads one: no memory
            if g.kind is KVCacheKind.STATE
            else np.arange(num, dtype=np.int64)
        )
        return group_rows(
            g,
            reader_spec,
            dummy,
            np.asarray(spec.block_ids[g.group_id], dtype=np.int64),
            first,
            start,
            end,
        )

    return rows_of


def claim_digests(
    digests: ReaderDigests | None,
    metrics: ConnectorMetrics,
    spec: SendSpec,
    agent: str,
    msg: Prepare,
) -> tuple[list[GroupDigest], str]:
    """What a claim's answer carries: for a verified claim (``Prepare.verify``) the
    digests of what it reads, as NIXL will read it (after this claim's rewrites, from the
    host mirror when staged); or none and why (the claim still stands: decode fails the
    load and says Done). Nothing for a claim that does not verify."""
    if not msg.verify:
        return [], ""
    if digests is None:
        return [], "this prefill gives no digests"
    try:
        found = digests.for_claim(spec, agent, msg.plan_digest, msg.start_token, msg.end_token)
    except (KVBridgeError, RuntimeError) as exc:  # RuntimeError: torch (out of memory)
        logger.warning("no digests for %s to %s: %s", msg.request_id, agent or "?", exc)
        return [], f"no digests: {exc}"
    metrics.digests_sent += 1
    return found, ""
