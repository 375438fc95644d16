"""How a ``NixlTransferEngine`` is set up: its frozen config, progress and merge modes,
and NIXL's per-transfer telemetry (kept apart from ``nixl_engine``, which owns the agent).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbridge.connector.transfer.errors import TransferError

MAX_NOTIF_BYTES = 64 * 1024  # larger notifications take milliseconds (NIXL_NOTES)


class ProgressMode(enum.Enum):
    PROGRESS_THREAD_OFF = "off"  # the owner drives progress via poll()/get_notifs()
    PROGRESS_THREAD_SPIN = "spin"  # the wrapper's thread: zero delay, one busy core per agent
    # NIXL's progress thread sleeping ``progress_delay_us`` between rounds: transfers and
    # connection set-up move while the owner is idle (an engine with nothing scheduled)
    PROGRESS_THREAD_DELAY = "delay"


class MergeRuns(enum.Enum):
    """How a transfer whose rows run adjacent on both sides (``kvbridge.layouts.runs``) is posted.

    The bytes move the same either way: NIXL's ``make_prepped_xfer`` already coalesces
    adjacent prepared descriptors itself (its telemetry counts 100 consecutive blocks as
    one), so ON changes how many descriptors kvbridge hands NIXL, not how many it moves.
    It costs CPU instead, never less time than posting by index (figures and command:
    ``docs/performance.md``, "What the figures mean"): finding runs and building two lists
    in numpy costs more per row than NIXL's own pass over the indices in C++, and
    ``initialize_xfer`` checks each built list against the registrations again. Hence OFF
    by default; ON is for a NIXL that stops coalescing (``skip_desc_merge`` is
    deprecated) or to see how fragmented requests are.
    """

    OFF = "off"  # by index through the prepared lists; NIXL coalesces adjacent rows
    ON = "on"  # one descriptor per run, through lists built per transfer, whenever fewer


@dataclass(frozen=True, kw_only=True)
class NixlEngineConfig:
    """``agent_name`` must be unique per process incarnation, e.g.
    ``f"{engine_id}-{rank}-{uuid4().hex[:8]}"``: NIXL refuses new metadata under a name
    it still holds."""

    agent_name: str
    backends: tuple[str, ...] = ("UCX",)
    progress: ProgressMode = ProgressMode.PROGRESS_THREAD_OFF
    progress_delay_us: int = 1000  # PROGRESS_THREAD_DELAY only
    capture_telemetry: bool = False
    # True: several threads call in turn (the worker's lock serialises them); the agent
    # locks its API (STRICT) and any thread may call. False: only the creating thread.
    shared: bool = False
    merge: MergeRuns = MergeRuns.OFF

    def __post_init__(self) -> None:
        if not self.agent_name:
            raise TransferError("NixlEngineConfig.agent_name is empty; pass a unique name")
        if not self.backends:
            raise TransferError(f"NixlEngineConfig({self.agent_name!r}).backends is empty")


@dataclass(frozen=True)
class XferTelemetry:
    """NIXL's per-transfer telemetry; ``num_descs`` counts descriptors after NIXL's own
    coalescing of adjacent ones."""

    num_descs: int
    num_bytes: int
    post_us: int
    xfer_us: int
