"""Failed loads whose transfers may still run: their blocks stay out of the engine's hands.

Releasing a NIXL handle does not stop an RMA operation already posted (NIXL's UCX backend
cancels the request, UCX does not cancel a GET in flight): a READ abandoned at its deadline
can still write into decode's blocks. So a failed load is not reported to the engine, and
its staging slots do not go back to their pool, until every READ it posted has *ended*::

    load fails (deadline, abort, peer failed, shutdown)
      -> Held: its handles and staging round, its failure kept back
      -> each step: poll every handle        DONE / TransferError  -> ended, released
      -> every handle ended                  -> slots back, failure reported
      -> still running after ``overdue_s``   -> logged once and counted (held_overdue);
                                                still held

Push mode the same way: a failed load whose Push round prefill has not answered yet (its
WRITEs may still land in our blocks and slots) is held until that round's ``Pushed``
comes (prefill answers each round once, after every WRITE it posted ended), or until
prefill is found gone.

Tearing the peer down does not end a READ either: measured with NIXL 1.5 over
``UCX_TLS=tcp`` (tests/connector/test_worker_multiprocess.py), a READ from a SIGSTOPped
prefill whose handle was released and whose agent was removed still wrote decode's blocks
once the prefill resumed. So the quarantine never tears a peer down to end a hold: a READ
ends when NIXL reports it done or failed. A handle released by ``remove_peer`` ends only
once the transport confirmed that peer gone (``TransferEngine.peer_gone``: NIXL reported
it disconnected, i.e. its process died or UCX failed the connection), since a dead process
sends nothing more; its unanswered push rounds likewise (``peer_gone`` below, from the
directory's ``on_drop``). A peer removed for any other reason (unreachable, refused) keeps
its released READs here, and no NIXL call exists that proves they stopped: their blocks
stay out of the engine's pool until the peer is confirmed gone, however long.

The worst case for a frozen peer is therefore as long as it stays frozen: the load waits,
visible in the log and per prefill agent in the metrics (``kvbridge_quarantined_blocks``
and ``_bytes``), and no byte lands in a block the engine got back. The wait is bounded in
space: once one agent's quarantined bytes (its READs', and the blocks of the push rounds
it owes) pass ``max_peer_bytes``
(``extra.max_quarantined_mib``), :meth:`Quarantine.refusal` refuses new loads from it
(the peer directory's admission check) until they drop below it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.connector.common.config import DEFAULT_MAX_QUARANTINED_MIB
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.transfer.transport import (
    TransferEngine,
    XferHandle,
    release_if_ended,
)
from kvbridge.connector.worker.peers import PeerKey
from kvbridge.connector.worker.staging.staged_reads import StageBatch, StagedReads

logger = logging.getLogger(__name__)

Round = tuple[str, str, int]  # a push round: (prefill agent, prefill's request id, round)


@dataclass
class Held:
    """One failed load's transfers that had not ended when it failed."""

    request_id: str
    remote_request_id: str
    on_end: Callable[[], None]  # report the failure (and tell prefill): blocks are safe
    since: float
    handles: dict[PeerKey, list[XferHandle]] = field(default_factory=dict)
    batches: list[StageBatch] = field(default_factory=list)
    rounds: set[Round] = field(default_factory=set)  # push rounds prefill has not answered
    # (blocks, bytes) each of those rounds may still write: counted against the cap
    round_sizes: dict[Round, tuple[int, int]] = field(default_factory=dict)
    overdue: bool = False

    @property
    def num_handles(self) -> int:
        """Transfers that may still land: READs, staging READs, unanswered push rounds."""
        return (
            sum(len(hs) for hs in self.handles.values())
            + sum(len(b.handles) for b in self.batches)
            + len(self.rounds)
        )


class Quarantine:
    """Holds failed loads until NIXL says their READs ended; reports them afterwards."""

    def __init__(
        self,
        engine: TransferEngine,
        staged: StagedReads,
        metrics: ConnectorMetrics,
        *,
        overdue_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_peer_bytes: int = DEFAULT_MAX_QUARANTINED_MIB << 20,
    ) -> None:
        """``overdue_s``: after this long a held READ is logged (once) and counted as
        overdue; it stays held until it ends. ``max_peer_bytes``: past this many bytes of
        one agent's READs held, :meth:`refusal` refuses new loads from it."""
        self._engine = engine
        self._staged = staged
        self._metrics = metrics
        self._overdue_s = overdue_s
        self._clock = clock
        self._max_peer_bytes = max_peer_bytes
        self._held: list[Held] = []
        self._over_cap: dict[str, str] = {}  # agent -> why no new load may start from it

    @property
    def num_held(self) -> int:
        """Failed loads not yet reported, because a READ of theirs may still run."""
        return len(self._held)

    def refusal(self, agent: str) -> str:
        """'' or why no new load may start from ``agent`` (its quarantined READs passed
        ``max_peer_bytes``): an admission check of the peer directory."""
        return self._over_cap.get(agent, "")

    def holds_remote(self, remote_request_id: str) -> bool:
        """A held load read (or was pushed) prefill's request ``remote_request_id``."""
        return any(held.remote_request_id == remote_request_id for held in self._held)

    def holds(self, request_id: str) -> bool:
        """A failed load of that request is held (its failure is still to be reported)."""
        return any(held.request_id == request_id for held in self._held)

    def hold(
        self,
        request_id: str,
        remote_request_id: str,
        handles: dict[PeerKey, list[XferHandle]],
        batches: list[StageBatch],
        on_end: Callable[[], None],
        rounds: dict[Round, tuple[int, int]] | None = None,
    ) -> bool:
        """Take a failed load's handles, staging rounds and unanswered push rounds; call
        ``on_end`` once none of them can still run (at once when none is running now,
        else from ``step`` or ``answered``). True: held (some may still run)."""
        held = Held(
            request_id=request_id,
            remote_request_id=remote_request_id,
            on_end=on_end,
            since=self._clock(),
            handles=handles,
            batches=batches,
            rounds=set(rounds or ()),
            round_sizes=dict(rounds or {}),
        )
        self._settle(held)
        if held.num_handles == 0:
            self._give_back(held)
            on_end()
            return False
        self._held.append(held)
        self._metrics.loads_held += 1
        self._account()
        logger.info(
            "load %s failed with %d transfer(s) still running: its blocks stay held until they end",
            request_id,
            held.num_handles,
        )
        return True

    def answered(self, round_: Round) -> bool:
        """Prefill answered a push round of a failed load: its WRITEs ended. False: no
        held load waits for it."""
        for held in self._held:
            if round_ in held.rounds:
                held.rounds.discard(round_)
                self.step()
                return True
        return False

    def peer_gone(self, agent: str) -> None:
        """``agent`` was removed (found dead): its rounds will never be answered, and
        nothing more comes from it (the next ``step`` ends what waited only for it)."""
        for held in self._held:
            held.rounds = {r for r in held.rounds if r[0] != agent}

    @property
    def awaited_rounds(self) -> set[Round]:
        """Push rounds held loads wait for an answer to (asked about while they do)."""
        return {r for held in self._held for r in held.rounds}

    def step(self) -> None:
        """Poll held transfers; end (report) the loads whose transfers all ended."""
        now = self._clock()
        for held in list(self._held):
            self._settle(held)
            if held.num_handles and not held.overdue and now - held.since > self._overdue_s:
                held.overdue = True
                self._metrics.held_overdue += 1
                peers = sorted({str(k) for k, hs in held.handles.items() if hs})
                peers += sorted({f"agent {r[0]} (push round {r[2]})" for r in held.rounds})
                released = sum(h.released for h in self._handles(held))
                logger.warning(
                    "load %s failed %.1f s ago and %d transfer(s) from %s may still land: "
                    "its blocks stay held until they end (a frozen or unreachable peer)%s",
                    held.request_id,
                    now - held.since,
                    held.num_handles,
                    ", ".join(peers) or "staging",
                    f"; {released} of them released with a peer not confirmed gone: no "
                    "NIXL call proves they stopped, so these blocks stay out of the pool "
                    "until the peer is found dead"
                    if released
                    else "",
                )
            if held.num_handles == 0:
                self._held.remove(held)
                self._give_back(held)
                held.on_end()
        self._account()

    def _settle(self, held: Held) -> None:
        """Drop (and release) every handle that ended: DONE, failed or already released."""
        for key, hs in held.handles.items():
            held.handles[key] = [h for h in hs if not self._ended(h)]
        for batch in held.batches:
            batch.handles[:] = [h for h in batch.handles if not self._ended(h)]

    def _ended(self, handle: XferHandle) -> bool:
        return release_if_ended(self._engine, handle)

    @staticmethod
    def _handles(held: Held) -> list[XferHandle]:
        return [h for hs in held.handles.values() for h in hs] + [
            h for b in held.batches for h in b.handles
        ]

    def _account(self) -> None:
        """The per-agent gauge of held READs and push rounds (block rows, bytes), and the
        cap on it: a frozen prefill that still answers probes holds decode's pool as
        much through its rounds as through READs."""
        per_agent: dict[str, tuple[int, int]] = {}
        for held in self._held:
            owed = [(h.peer, h.num_rows, h.num_bytes) for h in self._handles(held)]
            owed += [(r[0], *held.round_sizes.get(r, (0, 0))) for r in held.rounds]
            for agent, num_rows, n in owed:
                rows, num_bytes = per_agent.get(agent, (0, 0))
                per_agent[agent] = (rows + num_rows, num_bytes + n)
        self._metrics.quarantined = per_agent
        over = {a: n for a, (_, n) in per_agent.items() if n > self._max_peer_bytes}
        for agent in self._over_cap.keys() - over.keys():
            logger.info("prefill agent %s: quarantined READs below the cap again", agent)
        for agent in over.keys() - self._over_cap.keys():
            self._metrics.quarantine_caps += 1
            logger.warning(
                "prefill agent %s: %d block rows (%d bytes) of failed loads' READs from it "
                "may still land, over extra.max_quarantined_mib (%d bytes): no new loads "
                "from it until they end or it is confirmed gone (NIXL cannot stop a READ in "
                "flight; those blocks stay out of the engine's pool)",
                agent,
                per_agent[agent][0],
                over[agent],
                self._max_peer_bytes,
            )
        self._over_cap = {
            a: f"{n} bytes of failed loads' READs from it may still land, over "
            f"extra.max_quarantined_mib ({self._max_peer_bytes} bytes)"
            for a, n in over.items()
        }

    def _give_back(self, held: Held) -> None:
        for batch in held.batches:
            self._staged.cancel(batch)  # no handle left: only the slots go back

    def close(self) -> None:
        """Shutdown: the engine's memory goes with the process; report every held load."""
        for held in self._held:
            for hs in held.handles.values():
                for h in hs:
                    self._engine.release(h)
            held.rounds.clear()
            self._give_back(held)
            held.on_end()
        self._held.clear()
        self._account()
