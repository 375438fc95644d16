"""How a decode load ends: landed and reported, or failed and held until nothing of it can
still land; either way its prefill ranks are told ``Done``.

- **Landed**: every source's transfers ended. The verifier checks what moved (when the
  load proves it), the landing finishes the blocks (receiver rewrites, the host mirror
  copied in) and marks its kernels; prefill is told ``Done(ok=True)`` at once (our
  kernels write our blocks only), and the engine hears of the load from the first call
  that finds the mark complete (no host wait).
- **Failed**: releasing a handle does not stop a READ in flight, nor can we stop
  prefill's WRITEs of a push round it has not answered; the READs, staging rounds,
  packed landings and unanswered rounds go to the quarantine, and the engine hears of the
  failure only once none of them can still land. Prefill gets ``Done(ok=False)`` then too
  (pull: it keeps the blocks until our READs ended), or at once when a push round is
  unanswered (it stops writing, answers once its WRITEs ended). With ``fail_early`` the
  engine also hears at once that the load is *failing*, so it can end the request while
  it keeps the blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvbridge.connector.common.metadata import LoadFailure, LoadSpec
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import Done
from kvbridge.connector.transfer.transport import XferHandle
from kvbridge.connector.worker.decode.claims import Writers
from kvbridge.connector.worker.decode.inflight import Load, LoadState, failure
from kvbridge.connector.worker.decode.landing import Landing, Verifier
from kvbridge.connector.worker.decode.packed_reads import PackedReads
from kvbridge.connector.worker.decode.quarantine import Quarantine, Round
from kvbridge.connector.worker.device_order import Mark
from kvbridge.connector.worker.peers import PeerDirectory, PeerKey, PeerState
from kvbridge.connector.worker.routing import Router
from kvbridge.connector.worker.staging.staged_reads import StageBatch
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)

# (peer, (host, port), message): queue a notification for a peer, connected or not yet
Notify = Callable[[PeerKey, tuple[str, int], object], None]


class Outcomes:
    """The ends of one receiver's loads, and what the engine hears of them."""

    def __init__(
        self,
        metrics: ConnectorMetrics,
        peers: PeerDirectory,
        notify: Notify,
        quarantine: Quarantine,
        writers: Writers,
        landing: Landing,
        forget: Callable[[Load], None],
        *,
        router: Router,
        pushed: bool,
        verifier: Verifier | None = None,
        packed: PackedReads | None = None,
        fail_early: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``forget(load)``: the receiver drops the load (it is in flight no more).
        ``pushed``: push mode (a Done ends prefill's claim 0, made for our Push)."""
        self._metrics = metrics
        self._peers = peers
        self._notify = notify
        self._quarantine = quarantine
        self._writers = writers
        self._landing = landing
        self._forget = forget
        self._router = router
        self._pushed = pushed
        self._verifier = verifier
        self._packed = packed
        self._fail_early = fail_early
        self._clock = clock
        self._done: set[str] = set()
        # landed loads not reported yet: their kernels may still run on the device
        self._landed: list[tuple[Load, Mark | None]] = []
        self._failed: list[LoadFailure] = []
        # failed loads whose blocks kvbridge's kernels wrote (splits, scatters, rewrites):
        # reported once the mark taken at the failure completed (never a host wait)
        self._fenced: list[tuple[Mark, LoadFailure]] = []
        self._failing: list[LoadFailure] = []

    @property
    def num_landed(self) -> int:
        """Landed loads not reported yet, and failed ones waiting for the same (their
        kernels may still run)."""
        return len(self._landed) + len(self._fenced)

    def refused(self, spec: LoadSpec, reason: str) -> None:
        """A load that never started (nothing posted, nobody to tell): failed at once."""
        self._failed.append(failure(spec, reason))
        self._metrics.transfer_failures += 1

    def take(self) -> tuple[set[str], list[LoadFailure], list[LoadFailure]]:
        """Loads (done, failed, failing) since the last call: failed loads have nothing
        left that can write their blocks; failing ones (``fail_early``) may, and are
        reported failed once nothing can. Landed loads whose kernels finished are
        reported here too, when a deferred round did not step (no NIXL call needed)."""
        self.report_landed()
        fenced, self._fenced = self._fenced, []
        for mark, failed_load in fenced:
            if mark.done():
                self._failed.append(failed_load)
            else:
                self._fenced.append((mark, failed_load))
        done, failed, failing = self._done, self._failed, self._failing
        self._done, self._failed, self._failing = set(), [], []
        return done, failed, failing

    def complete(self, load: Load) -> None:
        """Every source's transfers ended: finish the blocks (landing) by the plans the
        sources were posted with, report; a load landing cannot finish fails."""
        # verified before any rewrite of ours touches the landed bytes (a source without
        # a plan is landing's to refuse, below)
        if load.verify and all(src.plan is not None for src in load.sources):
            assert self._verifier is not None
            mismatch = self._verifier.check(load)
            if mismatch:
                self.fail(load, mismatch)
                return
        try:
            mark = self._landing.finish(load)
        except KVBridgeError as exc:
            self.fail(load, f"could not land the load: {exc}")
            return
        self.notify_done(load, ok=True)  # our kernels write our blocks only: prefill may free
        self._forget(load)
        self._landed.append((load, mark))
        self.report_landed()

    def report_landed(self) -> None:
        """Report the landed loads whose kernels finished (no mark, or a completed one;
        no wait on the host: an incomplete mark is looked at again by the next call). A
        load's figures count up to here, the device's time included."""
        waiting: list[tuple[Load, Mark | None]] = []
        for load, mark in self._landed:
            if mark is not None and not mark.done():
                waiting.append((load, mark))
                continue
            now = self._clock()
            self._metrics.transfers += 1
            self._metrics.bytes_read += load.num_bytes
            self._metrics.transfer_seconds += now - load.started
            load.timeline.record(load.spec.request_id, now, self._metrics)
            self._done.add(load.spec.request_id)
        self._landed = waiting

    def fail(self, load: Load, reason: str, *, notify: bool = True, early: bool = True) -> None:
        """Fail ``load``: what of it may still land goes to the quarantine, and the
        engine hears once none of it can (module docstring). ``notify=False``: prefill is
        not told (params it never issued); ``early=False``: the engine's own abort (no
        *failing* report)."""
        handles: dict[PeerKey, list[XferHandle]] = {}
        batches: list[StageBatch] = []
        rounds: dict[Round, tuple[int, int]] = {}  # push rounds owed -> what they may write
        rid = load.spec.params.remote_request_id
        for src in load.sources:
            if src.state is LoadState.PUSHED and src.round_agent not in self._writers.gone | {""}:
                rounds[(src.round_agent, rid, src.round)] = self._landing.footprint(load)
            landing = self._packed.held(src) if self._packed is not None else None
            if landing is not None:  # its READ may still land: held with its pages
                src.handles = [h for h in src.handles if h not in landing.handles]
                batches.append(landing)
            handles[src.key] = list(src.handles)
            src.handles.clear()
            if src.batch is not None:
                batches.append(src.batch)
                src.batch = None
            src.staged.clear()
        self._forget(load)
        self._metrics.transfer_failures += 1
        logger.warning("load %s failed: %s", load.spec.request_id, reason)
        told = notify and bool(rounds)
        # kernels of ours queued on the blocks (a staged split, a packed scatter, a
        # rewrite that raised midway) may still run on the device: report after them
        mark = self._landing.mark("load failed") if load.kernels else None

        def end() -> None:
            try:
                if notify and not told:
                    self.notify_done(load, ok=False)
            finally:  # reported whatever the message did: the engine is never left waiting
                if mark is None or mark.done():
                    self._failed.append(failure(load.spec, reason))
                else:
                    self._fenced.append((mark, failure(load.spec, reason)))

        try:
            if told:
                self.notify_done(load, ok=False)  # the cancel: prefill stops, then answers
        finally:  # held (then reported) whatever the message did: forgotten above
            held = self._quarantine.hold(load.spec.request_id, rid, handles, batches, end, rounds)
            if held and early and self._fail_early:
                self._failing.append(failure(load.spec, reason))

    def notify_done(self, load: Load, *, ok: bool) -> None:
        """Tell every prefill rank the load's route names that we are done with its
        request (it frees the blocks, or stops writing)."""
        rid = load.spec.params.remote_request_id
        for key, readers in load.route.notify:
            peer = self._peers.get(key)
            if peer is not None and peer.state is PeerState.FAILED:
                continue  # unreachable: it frees by lease (a new handshake would not help)
            msg = Done(
                request_id=rid,
                ok=ok,
                readers=readers,
                reader_rank=self._router.engine_rank,
                claims=self._claims_of(load, key),
            )
            self._notify(key, load.route.endpoints[key], msg)

    def _claims_of(self, load: Load, key: PeerKey) -> list[int]:
        """The claims our Done to prefill rank ``key`` ends: the numbers of the claims
        this load sent it (push: 0, the claim prefill made for our Push); none for a rank
        we only notify."""
        src = load.source(key)
        if src is None:
            return []
        return [0] if self._pushed else list(src.claim_ids)
