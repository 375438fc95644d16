"""Decode's work on a load's blocks once every transfer into them ended: verify what
landed (:class:`Verifier`), then land it in the cache's own arrangement (:class:`Landing`).

**Verified loads**: which loads to verify, and the check before landing.

``extra.verify`` says how many loads prove what they moved: ``off``, ``sample`` (each
load with probability ``extra.verify_rate``: a canary in production) or ``all``. A
verified load asks each prefill rank it reads from for the digests of the rows it moves
(with its claim, or its Push). When every transfer of the load ended, and before any
rewrite or repack of decode's own touches the landed bytes, decode digests its rows the
same way (:mod:`kvbridge.connector.worker.digests`, reader side) and compares::

    every source DONE -> check(load): per source, per group, our digest == prefill's
                          equal      -> landing, reported loaded
                          different  -> the load fails (recomputed or failed, by the
                                        engine's policy), counted, logged with request,
                                        peer and block ids

A source without digests (prefill could not give them: it names why) fails the check
too: a load that was to be verified is never reported loaded unverified. A staged
group whose landed pages were not all summed (``digests.load_digests``) is counted in
``verify_unverified_groups``, and its load not in ``loads_verified``.

**Landing**: decode's own work on the blocks.

Runs only after NIXL reported each READ of the load done (pull) or prefill answered every
Push round (push), and before the load is reported to the engine::

    host staging    mirror -> cache (the READs landed in the host mirror)
    receiver        rewrite the wire arrangement into the cache's own (GroupPlan.receiver)
    engine merge    whole smaller remote pages side by side -> the engine's page order
    mark            a CUDA event after every kernel above (kvbridge.connector.worker
                    .device_order), when there was one: a load NIXL moved as it lands
                    needs none; the receiver reports the load once it completed

so the engine's next forward pass, on whatever stream, reads finished blocks.

The rewrite and merge of each group come from the plan each source carries
(``Source.plan``, recorded when its READs were posted or its push asked), never from the
peer as it is now: a peer dropped and handshaken again in between may have no plan yet, or
another one. A source without a plan, or two sources that would land a group differently,
fail the load (:class:`KVBridgeError`): never a load reported with blocks in wire arrangement.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from kvbridge.connector.common.config import VerifyMode
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.worker.decode.inflight import Load
from kvbridge.connector.worker.device_order import DeviceOrder, Mark
from kvbridge.connector.worker.digests import PlanSide, load_digests
from kvbridge.connector.worker.staging.host_stage import HostStage
from kvbridge.connector.worker.staging.staged_reads import Repacker
from kvbridge.handshake.plan_model import GroupPlan
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.transforms import rewrite_group


class Verifier:
    """Picks the loads to verify and checks them against prefill's digests."""

    def __init__(
        self,
        mode: VerifyMode,
        rate: float,
        landed: KVCacheBuffers,
        units: list[torch.Tensor],
        metrics: ConnectorMetrics,
        *,
        rng: random.Random | None = None,
    ) -> None:
        """``landed``: the buffers transfers land in (the cache, or its host mirror);
        ``units``: their regions' memory (``digests.region_units``)."""
        self.mode = mode
        self._rate = rate
        self._landed = landed
        self._units = units
        self._metrics = metrics
        self._rng = rng or random.Random()

    def wants(self) -> bool:
        """Whether the next load is verified."""
        if self.mode is VerifyMode.ALL:
            return True
        return self.mode is VerifyMode.SAMPLE and self._rng.random() < self._rate

    def check(self, load: Load) -> str:
        """'' when every source's bytes are what prefill digested, else why not (with
        peer and block ids). Counts the outcome."""
        groups = self._landed.config.groups
        problems: list[str] = []
        unverified = 0
        for src in load.sources:
            if src.plan is None:
                problems.append(f"{src.key}: no plan recorded, nothing to digest by")
                continue
            if src.digests is None:
                problems.append(f"{src.key}: prefill sent no digests ({src.digest_reason})")
                continue
            try:
                mine = load_digests(
                    src.plan,
                    PlanSide.READER,
                    self._units,
                    lambda g: load.rows(g, groups[g.group_id].spec),
                    src.staged_sums,
                )
            except (KVBridgeError, RuntimeError) as exc:  # RuntimeError: torch (memory)
                problems.append(f"{src.key}: could not digest the landed rows: {exc}")
                continue
            problems += [f"{src.key}: {m}" for m in mine.mismatches(src.digests)]
            unverified += len(mine.unverified)
        if not problems:
            # a load with a staged group left out is not counted as verified
            self._metrics.verify_unverified_groups += unverified
            self._metrics.loads_verified += not unverified
            return ""
        self._metrics.load_verify_failures += 1
        p = load.spec.params
        return (
            f"verify: the landed bytes are not what prefill {p.remote_engine_id} sent for "
            f"its request {p.remote_request_id} (its blocks {_ids(p.remote_block_ids)}, ours "
            f"{_ids(load.spec.local_block_ids)}): " + "; ".join(problems)
        )


def _ids(per_group: Sequence[Sequence[int]], most: int = 16) -> str:
    """Block ids per group for a log line, each list cut after ``most``."""
    return (
        "["
        + ", ".join(
            str(list(ids)) if len(ids) <= most else f"[{', '.join(map(str, ids[:most]))}, ...]"
            for ids in per_group
        )
        + "]"
    )


def landing_groups(load: Load) -> list[GroupPlan]:
    """The group plans that land ``load``, one per group, from the plans its sources carry.

    A group's steps (receiver rewrite, engine merge) act on whole local blocks, which
    every source of a TP load writes a head slice of: the sources that moved the group
    must agree on them. Raises :class:`KVBridgeError` when a source carries no plan or two
    disagree."""
    rid = load.spec.request_id
    chosen: dict[int, GroupPlan] = {}
    for src in load.sources:
        if src.plan is None:
            raise KVBridgeError(
                f"load {rid}: source {src.key} carries no plan (its READs or push went out "
                f"without one), so how its bytes land is unknown; the load fails"
            )
        for g in src.plan.groups:
            first = chosen.get(g.group_id)
            if first is None or (g.streams and not first.streams):
                chosen[g.group_id] = g
            elif g.streams and (g.receiver, g.repack_from) != (first.receiver, first.repack_from):
                raise KVBridgeError(
                    f"load {rid}: sources land group {g.group_id} differently (receiver "
                    f"{first.receiver}, repack {first.repack_from} vs receiver {g.receiver}, "
                    f"repack {g.repack_from} from {src.key}); the load fails"
                )
    return [chosen[gid] for gid in sorted(chosen)]


def check_layers_covered(load: Load, buffers: KVCacheBuffers) -> None:
    """Under pipeline parallelism each source moves only the layers its stage shares with
    ours (``GroupPlan.layers``; a group it shares none of, nothing: ``GroupPlan.skipped``).
    Together they must move every layer of every group, else a layer would be reported
    loaded that nothing wrote (the params named stages that do not hold what they said).
    Raises :class:`KVBridgeError` naming the layers; loads without stages pass as they
    are."""
    plans = [g for src in load.sources if src.plan is not None for g in src.plan.groups]
    if not any(g.layers or g.skipped for g in plans):
        return  # no pipeline window cut anything: every source moves its groups whole
    for group in buffers.config.groups:
        mine = [g for g in plans if g.group_id == group.group_id and g.streams]
        if any(not g.layers for g in mine):
            continue  # a source moves the whole group
        moved = {name for g in mine for name in g.layers}
        missing = [n for n in group.layer_names if n not in moved]
        if missing:
            raise KVBridgeError(
                f"load {load.spec.request_id}: no source moves layers {missing} of group "
                f"{group.group_id} (sources {[s.key for s in load.sources]}): the prefill "
                f"stages the params name (remote_pp_layers) do not hold them; the load fails"
            )


class Landing:
    """Finishes loads whose transfers all ended."""

    def __init__(
        self,
        buffers: KVCacheBuffers,
        metrics: ConnectorMetrics,
        order: DeviceOrder,
        *,
        stage: HostStage | None = None,
        repacker: Repacker | None = None,
    ) -> None:
        self._buffers = buffers
        self._metrics = metrics
        self._order = order
        self._stage = stage
        self._repacker = repacker

    def footprint(self, load: Load) -> tuple[int, int]:
        """(blocks, bytes) of ``load``'s local blocks: what a push round of it may write."""
        ids = load.spec.local_block_ids
        num_bytes = sum(len(g) * self._buffers.group_block_bytes(i) for i, g in enumerate(ids))
        return sum(len(g) for g in ids), num_bytes

    def mark(self, why: str) -> Mark:
        """Where the calling thread's stream stands (``DeviceOrder.mark``): a failed load
        whose blocks kvbridge's kernels wrote is reported once they finished."""
        return self._order.mark(why)

    def finish(self, load: Load) -> Mark | None:
        """The load's blocks in the cache's own format: the mark to wait for before the
        engine may read them (None: no kernel ran, NIXL's READs were the last writers). Raises
        :class:`KVBridgeError` before touching a block when the sources' plans cannot
        land it (:func:`landing_groups`) or left a layer unwritten
        (:func:`check_layers_covered`)."""
        groups = landing_groups(load)
        check_layers_covered(load, self._buffers)
        if self._stage is not None:
            for group_id, ids in load.touched.items():
                load.kernels = True  # before the call: one that raises may have queued some
                self._stage.to_device(group_id, ids)
        for g in groups:
            ids = load.touched.get(g.group_id)
            if ids is None:
                continue
            if g.receiver:
                load.kernels = True
                stats = rewrite_group(
                    self._buffers, g.group_id, ids, g.receiver.src, g.receiver.dst
                )
                self._metrics.receiver_rewrites += stats.num_blocks
            if g.repack_from:
                assert self._repacker is not None  # negotiation needs one for repacks
                load.kernels = True
                self._repacker.merge(g.group_id, ids, g.repack_from)
                self._metrics.receiver_rewrites += int(ids.size)
        if load.kernels:  # NIXL's own writes are complete when it reports a READ done
            return self._order.mark("load complete")
        return None
