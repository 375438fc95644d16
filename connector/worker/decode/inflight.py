"""What a decode worker tracks per load in flight: the load, one source per prefill rank, and
where its time goes.

A load reads from one prefill rank, or from several under tensor parallelism. Each source
moves through::

    pull  WAITING_PEER --(peer ready)--> PREPARING --(Prepared)--> READING --(all DONE and
               |                   (skipped when no     the claim covers them)--> done
               |                    rewrite is due: the READ is posted with the claim)
    push  WAITING_PEER --(peer ready)--> PUSHED --(Pushed: prefill wrote)--> done
                                           ^  |  (staged pages left: the next round)
                                           |  v
                                   STAGING (no staging slot free yet)

``kvbridge.connector.worker.decode.receiver`` drives the machine;
``kvbridge.connector.worker.decode.transfers`` asks the pushes.

**Where a load's time goes** (:class:`LoadTimeline`), the handover profile of one decode
request:

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

import enum
import logging
from dataclasses import dataclass, field

import numpy as np

from kvbridge.connector.common.metadata import LoadFailure, LoadSpec
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import GroupDigest, GroupRewrite, Push
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.transport import XferHandle
from kvbridge.connector.worker.packed_rows import PackedRows
from kvbridge.connector.worker.peers import Peer, PeerKey
from kvbridge.connector.worker.routing import Route
from kvbridge.connector.worker.rows import GroupRows, group_rows
from kvbridge.connector.worker.staging.staged_reads import StageBatch, Staged, StagedSums
from kvbridge.handshake.plan_model import GroupPlan, TransferPlan
from kvbridge.layouts.specs import KVCacheSpec


class LoadState(enum.Enum):
    WAITING_PEER = "waiting_peer"
    PREPARING = "preparing"
    READING = "reading"
    PUSHED = "pushed"  # push mode: asked prefill to write, waiting for Pushed
    STAGING = "staging"  # push mode: the next round waits for free staging slots
    DONE = "done"


@dataclass(frozen=True)
class PushEndpoint:
    """Push mode: where prefill finds this decode rank (its own handshake listener)."""

    engine_id: str
    rank: int
    host: str
    port: int


@dataclass
class Source:
    """One prefill rank a load reads from."""

    key: PeerKey
    state: LoadState = LoadState.WAITING_PEER
    # the prefill incarnation (its NIXL agent) this source claimed from or asked to push:
    # what it grants counts only from that process; one restarted under the same engine id
    # and address is another peer, and the source fails (Receiver's step)
    agent: str = ""
    handles: list[XferHandle] = field(default_factory=list)
    staged: list[Staged] = field(default_factory=list)  # remote pages still to stage
    batch: StageBatch | None = None  # the staging round in flight (read, or pushed)
    push: Push | None = None  # push mode: round 0 as sent; later rounds copy it
    round: int = 0  # push mode: the round in flight (or the next one)
    round_agent: str = ""  # ... and the agent asked
    # pull: the claim (Prepare) in flight and what the answered ones proved, on our clock
    rewrites: list[GroupRewrite] = field(default_factory=list)  # every claim repeats them
    claim_sent: float = 0.0  # when the first claim in flight was sent (0: none in flight)
    claim_last: float = 0.0  # when the last claim (first or sent again) was sent
    claims: dict[int, float] = field(default_factory=dict)  # in flight: number -> sent at
    asked: dict[int, str] = field(default_factory=dict)  # in flight: number -> asked_key
    push_asked: str = ""  # push mode: asked_key of the round in flight, as sent
    # every claim number this source sent (capped): its Done names them, so prefill ends
    # this reader's claim and no other reader's
    claim_ids: list[int] = field(default_factory=list)
    held_until: float = 0.0  # prefill holds the blocks at least until then
    held_s: float = 0.0  # the last answered claim's hold (a refresh goes out at half)
    reads_done: float = 0.0  # when the READs were seen complete (0: not yet)
    handshaken_again: bool = False  # the peer was gone at the claim: handshaken once more
    # the plan its READs were posted with (push: the Push was asked with): landing rewrites
    # by it, whatever became of the peer since (dropped, handshaken again, another plan)
    plan: TransferPlan | None = None
    # a verified load: prefill's digests of what this source moves (None: none came yet),
    # or why prefill gave none
    digests: list[GroupDigest] | None = None
    digest_reason: str = "no answer carried them"
    staged_sums: StagedSums = field(default_factory=dict)  # verified: pages as they landed
    # a packed read (kvbridge.connector.worker.decode.packed_reads): our rows in the packed
    # order, the landing pages (with the READ, once posted), and where prefill packed them
    packed: PackedRows | None = None
    landing: StageBatch | None = None
    packed_at: int = -1
    packed_bytes: int = 0


@dataclass
class Load:
    spec: LoadSpec
    route: Route
    deadline: float
    sources: list[Source]
    timeline: LoadTimeline
    touched: dict[int, np.ndarray] = field(default_factory=dict)  # group -> local block ids
    num_bytes: int = 0
    started: float = 0.0
    verify: bool = False  # prove what moved (extra.verify): claims and Push ask digests
    # kernels (the engine's splits of staged pages, kvbridge's copies and rewrites) wrote
    # the load's blocks: landing fences them before the engine hears of the load
    kernels: bool = False

    def source(self, key: PeerKey) -> Source | None:
        return next((s for s in self.sources if s.key == key), None)

    def touch(self, group_id: int, ids: np.ndarray) -> None:
        """Local blocks ``ids`` of a group receive data (receiver rewrites, repacks)."""
        before = self.touched.get(group_id)
        self.touched[group_id] = np.unique(ids if before is None else np.concatenate([before, ids]))

    def rows(self, g: GroupPlan, local_spec: KVCacheSpec) -> GroupRows:
        """The rows of group ``g`` this load moves (``kvbridge.connector.worker.rows``)."""
        spec, params = self.spec, self.spec.params
        return group_rows(
            g,
            local_spec,
            np.asarray(spec.local_block_ids[g.group_id], dtype=np.int64),
            np.asarray(params.remote_block_ids[g.group_id], dtype=np.int64),
            params.remote_first_block[g.group_id] if params.remote_first_block else 0,
            spec.start_token,
            spec.end_token,
        )


def outside(params: KVTransferParams, peer: Peer) -> str:
    """Why ``params`` name blocks ``peer`` does not have ('' when they all exist)."""
    assert peer.plan is not None and peer.layout is not None
    regions = peer.layout.regions
    for g in peer.plan.groups:
        ids = params.remote_block_ids[g.group_id]
        if not g.streams:  # nothing of this group on that peer (a state replica read elsewhere)
            continue
        limit = min((regions[s.remote_region].region.num_blocks for s in g.streams), default=0)
        if ids and (min(ids) < 0 or max(ids) >= limit):
            return (
                f"kv_transfer_params name remote blocks {min(ids)}..{max(ids)} of group "
                f"{g.group_id}, outside the {limit} blocks {peer.key} advertised: not issued "
                f"by that prefill; nothing read"
            )
    return ""


def failure(spec: LoadSpec, reason: str) -> LoadFailure:
    """The load failed: every local block that would have received data is invalid."""
    return LoadFailure(
        request_id=spec.request_id,
        reason=reason,
        invalid_block_ids=tuple(tuple(ids) for ids in spec.local_block_ids),
        num_valid_tokens=spec.start_token,
    )


def describe_source(src: Source, now: float) -> str:
    """What a source waits for, for a timed-out load's reason: its state, and in pull mode
    whether its READs ended and how long its claim is unanswered."""
    parts = [src.state.value]
    if src.state is LoadState.WAITING_PEER:
        parts.append("no handshake answer yet")
    if src.reads_done:
        parts.append("READs ended")
    elif src.handles or src.batch is not None or src.staged:
        parts.append("READs running")
    if src.claim_sent:
        parts.append(f"claim unanswered for {now - src.claim_sent:.1f} s ({len(src.claims)} sent)")
    return "; ".join(parts)


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
