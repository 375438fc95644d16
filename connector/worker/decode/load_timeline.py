"""Where a load's time goes: the handover profile of one decode request.

::

    added --peer--> started --prepare--> posted --data--> arrived --finish--> finished
      |  handshake   | Prepare round trip | READs, or     | stage in,
      |  (first      | (rewrite on the    | prefill's     | receiver rewrites,
      |  contact)    | sender), or none   | WRITEs (push) | repacks

Each phase's seconds add up in :class:`ConnectorMetrics` (``load_<phase>_seconds``, and
the ``kvbridge_load_phase_seconds`` histogram), so a slow handover shows which phase is
slow; a load slower than ``SLOW_LOAD_S`` is logged with its phases.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvbridge.connector.common.metrics import ConnectorMetrics

logger = logging.getLogger(__name__)

SLOW_LOAD_S = 1.0  # log a load's phases at INFO when it took longer than this


@dataclass
class LoadTimeline:
    """Clock readings at a load's phase boundaries (0.0: not reached yet)."""

    added: float
    started: float = 0.0  # the peer was ready: Prepare, Push or READ went out
    posted: float = 0.0  # the first READ (or the Push) went out
    arrived: float = 0.0  # every source's data is in place

    def phases(self, finished: float) -> dict[str, float]:
        """Seconds per phase; a phase a load skipped (no Prepare) counts 0."""
        started = self.started or self.added
        posted = self.posted or started
        arrived = self.arrived or posted
        return {
            "peer": started - self.added,
            "prepare": posted - started,
            "data": arrived - posted,
            "finish": finished - arrived,
        }

    def record(self, request_id: str, finished: float, metrics: ConnectorMetrics) -> None:
        phases = self.phases(finished)
        metrics.observe_load(phases)
        total = finished - self.added
        level = logging.INFO if total > SLOW_LOAD_S else logging.DEBUG
        if logger.isEnabledFor(level):
            text = ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in phases.items())
            logger.log(level, "load %s took %.1f ms: %s", request_id, 1e3 * total, text)
