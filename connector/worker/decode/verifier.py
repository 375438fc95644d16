"""Decode side of verified loads: which loads to verify, and the check before landing.

``extra.verify`` says how many loads prove what they moved: ``off``, ``sample`` (each
load with probability ``extra.verify_rate``: a canary in production) or ``all``. A
verified load asks each prefill rank it reads from for the digests of the rows it moves
(with its claim, or its Push). When every transfer of the load ended, and before any
rewrite or repack of decode's own touches the landed bytes, decode digests its rows the
same way (:mod:`kvbridge.connector.worker.load_digests`, reader side) and compares::

    every source DONE -> check(load): per source, per group, our digest == prefill's
                          equal      -> landing, reported loaded
                          different  -> the load fails (recomputed or failed, by the
                                        engine's policy), counted, logged with request,
                                        peer and block ids

A source without digests (prefill could not give them: it names why) fails the check
too: a load that was to be verified is never reported loaded unverified. A staged
group whose landed pages were not all summed (``load_digests``) is counted in
``verify_unverified_groups``, and its load not in ``loads_verified``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from kvbridge.connector.common.config import VerifyMode
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.worker.decode.load_records import Load
from kvbridge.connector.worker.load_digests import PlanSide, load_digests
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError


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
        ``units``: their regions' memory (``load_digests.region_units``)."""
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
