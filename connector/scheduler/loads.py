"""Decode side of the scheduler: which remote KV a request loads, and where each load stands.

:class:`Loads` follows a ``do_remote_prefill`` request through the
:class:`~kvbridge.connector.scheduler.lifecycle.LoadState` machine, from
``get_num_new_matched_tokens`` to its outcome, and queues what the next metadata carries: loads,
releases (nothing to read), aborts and heartbeats for requests still waiting for blocks. Which
tokens and blocks a load covers: :mod:`kvbridge.connector.scheduler.prompt_span`.
:class:`~kvbridge.connector.scheduler.scheduler.KVBridgeScheduler` owns one and forwards the
engine's calls.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

from kvbridge.connector.common.api import ConnectorRequest
from kvbridge.connector.common.config import FailurePolicy, KVTransferConfig
from kvbridge.connector.common.metadata import LoadFailure, LoadSpec, WorkerOutput
from kvbridge.connector.common.params import KVTransferParams, ParamsError
from kvbridge.connector.common.signing import ParamsSigner
from kvbridge.connector.scheduler.lifecycle import Ignored, LifecycleError, LoadRecord, LoadState
from kvbridge.connector.scheduler.prompt_span import load_block_ids, load_end
from kvbridge.layouts.specs import KVCacheSpec

Queued = tuple[tuple[str, KVTransferParams], ...]

logger = logging.getLogger(__name__)


class Loads:
    """Live decode loads and the next metadata's queues; ``ignored`` is shared with the
    scheduler (worker reports and calls that matched no live request)."""

    def __init__(
        self,
        config: KVTransferConfig,
        specs: Sequence[KVCacheSpec],
        signer: ParamsSigner,
        ignored: Counter[Ignored],
        *,
        clock: Callable[[], float],
        ranks: int = 1,
    ) -> None:
        """``ranks``: worker ranks that load every request (every TP rank of every
        pipeline stage); a load ends when each of them has reported it (loaded only if
        none failed)."""
        self.config = config
        self.ranks = ranks
        self._specs = tuple(specs)
        self._signer = signer
        self._clock = clock
        self.ignored = ignored
        self._records: dict[str, LoadRecord] = {}
        self._consumed: set[str] = set()  # remote KV used up; never load it again
        self._to_load: dict[str, LoadSpec] = {}
        self._to_release: dict[str, KVTransferParams] = {}
        self._to_abort: list[tuple[str, KVTransferParams]] = []
        self._waiting: dict[str, KVTransferParams] = {}
        self._to_free: set[str] = set()  # aborted while loading; the load has ended now
        # ABORTING loads whose abort went out to the workers: a failure reported from then
        # on may be the abort's own doing ("aborted by the engine"), not the load's
        self._aborts_out: set[str] = set()
        self.outcomes: Counter[LoadState] = Counter()
        self.num_unserved = 0  # loads the params could not serve: decode computed them

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def state(self, request_id: str) -> LoadState | None:
        record = self._records.get(request_id)
        return None if record is None else record.state

    # ------------------------------------------------------------------ engine calls

    def match(
        self, request: ConnectorRequest, params: KVTransferParams, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """See ``KVBridgeScheduler.get_num_new_matched_tokens``."""
        rid = request.request_id
        if not params.do_remote_prefill or rid in self._consumed:
            return 0, False
        if not self.config.is_consumer:
            raise ParamsError(
                f"request {rid!r}: do_remote_prefill=true reached a "
                f"{self.config.kv_role.value} engine; send it to a kv_consumer"
            )
        if num_computed_tokens < 0:
            raise LifecycleError(f"request {rid!r}: num_computed_tokens={num_computed_tokens}")
        record = self._records.get(rid)
        first_ask = record is None
        if record is None:
            params.validate_for_load(len(self._specs))
            self._signer.verify(params)  # once: later, heartbeats keep the lease alive
            record = LoadRecord(rid, params)
        elif record.state not in (LoadState.MATCHED, LoadState.FULL_HIT):
            raise LifecycleError(
                f"request {rid!r} is {record.state.name}; get_num_new_matched_tokens is only "
                f"asked before its blocks are allocated"
            )
        end, why = load_end(self._specs, params, len(request.prompt_token_ids), num_computed_tokens)
        if why and first_ask:  # once per request, not each step it waits for blocks
            self.num_unserved += 1
            logger.warning(
                "request %s: prefill %s cannot serve its load (%s); computing the prompt locally",
                rid,
                params.remote_engine_id,
                why,
            )
        record.num_load_tokens = end
        record.num_computed_tokens = num_computed_tokens
        self._records[rid] = record
        if record.num_load_tokens > num_computed_tokens:
            record.advance(LoadState.MATCHED)
            return record.num_load_tokens - num_computed_tokens, True
        record.advance(LoadState.FULL_HIT)
        return 0, False

    def allocated(
        self,
        request: ConnectorRequest,
        block_ids_per_group: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """See ``KVBridgeScheduler.update_state_after_alloc``."""
        rid = request.request_id
        record = self._records.get(rid)
        if record is None:
            if num_external_tokens:
                raise LifecycleError(
                    f"request {rid!r}: num_external_tokens={num_external_tokens} but the "
                    f"connector promised no tokens for it"
                )
            return
        if record.state not in (LoadState.MATCHED, LoadState.FULL_HIT):
            raise LifecycleError(
                f"request {rid!r} is {record.state.name}; update_state_after_alloc comes "
                f"once, after get_num_new_matched_tokens"
            )
        if num_external_tokens == 0:
            record.advance(LoadState.RELEASING)
            self._to_release[rid] = record.params
            self._waiting.pop(rid, None)
            return
        promised = record.num_load_tokens - record.num_computed_tokens
        if record.state is LoadState.FULL_HIT or num_external_tokens != promised:
            raise LifecycleError(
                f"request {rid!r}: num_external_tokens={num_external_tokens}, but "
                f"get_num_new_matched_tokens offered {max(0, promised)} "
                f"(state {record.state.name})"
            )
        local_block_ids = load_block_ids(
            self._specs,
            rid,
            block_ids_per_group,
            record.num_load_tokens,
            record.num_computed_tokens,
        )
        record.advance(LoadState.ALLOCATED)
        self._waiting.pop(rid, None)
        self._to_load[rid] = LoadSpec(
            request_id=rid,
            params=record.params,
            local_block_ids=local_block_ids,
            start_token=record.num_computed_tokens,
            end_token=record.num_load_tokens,
        )

    def refuse(
        self, request_id: str, block_ids_per_group: Sequence[Sequence[int]], reason: str
    ) -> LoadFailure | None:
        """Fail a load the engine's calls no longer fit (:meth:`allocated` raised), without
        raising into the engine: nothing is read, prefill is told to free, and the load
        ends RECOMPUTED or FAILED (``failure_policy``) with the next metadata. Returns the
        failure the engine must hear of (every block it allocated invalid, the local
        prefix hit valid); None when a load already went out for the request (its own
        report ends it) or no request is known."""
        record = self._records.get(request_id)
        if record is None or record.state not in (LoadState.MATCHED, LoadState.FULL_HIT):
            return None
        record.failure = LoadFailure(
            request_id=request_id,
            reason=reason,
            invalid_block_ids=tuple(tuple(ids) for ids in block_ids_per_group),
            num_valid_tokens=record.num_computed_tokens,
        )
        record.advance(LoadState.RELEASING)
        self._to_release[request_id] = record.params
        self._waiting.pop(request_id, None)
        return record.failure

    def keep_alive(self, request_id: str) -> None:
        """Still waiting for blocks: heartbeat prefill at most once per ``heartbeat_s``."""
        record = self._records.get(request_id)
        if record is None or record.state not in (LoadState.MATCHED, LoadState.FULL_HIT):
            return
        now = self._clock()
        if now - record.last_heartbeat >= self.config.heartbeat_s:
            record.last_heartbeat = now
            self._waiting[record.request_id] = record.params

    def busy(self, request_id: str) -> bool:
        """A load is in flight (aborted or not): the worker may write into the blocks."""
        record = self._records.get(request_id)
        return record is not None and record.state in (LoadState.LOADING, LoadState.ABORTING)

    def forget(self, request_id: str) -> None:
        """The request ended: a new one under the same id may load again."""
        self._consumed.discard(request_id)

    def abort(self, rid: str) -> bool:
        """Give a live load up; True when its blocks wait for free_request_ids."""
        record = self._records[rid]
        match record.state:
            case LoadState.RELEASING:  # prefill is told to free by the queued release
                return False
            case LoadState.ABORTING:
                self.ignored[Ignored.ABORT] += 1
                return True
            case LoadState.LOADING:
                record.advance(LoadState.ABORTING)
                self._to_abort.append((rid, record.params))
                return True
            case _:  # MATCHED, FULL_HIT, ALLOCATED: no load posted, nothing writes
                self._to_load.pop(rid, None)
                self._waiting.pop(rid, None)
                self._to_abort.append((rid, record.params))
                self._finish(rid, LoadState.ABORTED)
                return False

    # ------------------------------------------------------------------ per step

    def drain(self) -> tuple[tuple[LoadSpec, ...], Queued, Queued, Queued]:
        """The next metadata's loads (now LOADING), aborts, waiting requests and releases
        (now RELEASED); empties the queues."""
        for rid in self._to_load:
            self._records[rid].advance(LoadState.LOADING)
        for rid, _ in self._to_abort:
            record = self._records.get(rid)
            if record is not None and record.state is LoadState.ABORTING:
                self._aborts_out.add(rid)
        for rid in self._to_release:
            failed = self._records[rid].failure is not None  # refused
            self._finish(rid, self._failed_outcome() if failed else LoadState.RELEASED)
        out = (
            tuple(self._to_load.values()),
            tuple(self._to_abort),
            tuple(self._waiting.items()),
            tuple(self._to_release.items()),
        )
        self._to_load, self._to_release, self._waiting = {}, {}, {}
        self._to_abort = []
        return out

    def fold(self, output: WorkerOutput) -> tuple[list[str], list[LoadFailure], list[LoadFailure]]:
        """One worker rank's load reports: (loaded ids, failures to recompute, failed
        loads), each for loads every rank has now reported; and, ``failure_policy:
        fail``, a load one rank reports failing (transfers of it may still land) fails at
        once: the engine ends the request and keeps its blocks (``busy``) until every rank
        reported the load ended (then ``take_freed``, if the engine aborted it meanwhile)."""
        recompute: list[LoadFailure] = []
        failed: list[LoadFailure] = []
        loaded: list[str] = []
        for failure in output.failing_loads:
            record = self._records.get(failure.request_id)
            if (
                record is None
                or record.state not in (LoadState.LOADING, LoadState.ABORTING)
                or record.told
                or self.config.failure_policy is not FailurePolicy.FAIL
            ):
                continue
            record.told = True
            record.failure = record.failure or failure
            if record.state is LoadState.LOADING:
                failed.append(failure)
            # else the engine already ended it on the same report (vLLM reads its
            # failed_recving before the connector's output): it ends FAILED all the same
        reports = [(f.request_id, f) for f in output.failed_loads]
        reports += [(rid, None) for rid in output.finished_recving]
        for rid, failure in reports:
            kind = Ignored.FINISHED_RECVING if failure is None else Ignored.FAILED_LOAD
            ended = self._reported(rid, kind, failure)
            if ended is None:
                continue
            outcome, first = ended
            if outcome is LoadState.LOADED:
                loaded.append(rid)
            elif first is not None and outcome is LoadState.RECOMPUTED:
                recompute.append(first)
            elif first is not None and outcome is LoadState.FAILED:
                failed.append(first)
        return loaded, recompute, failed

    def take_freed(self) -> set[str]:
        """Aborted requests whose load has ended since the last call: free their blocks."""
        out, self._to_free = self._to_free, set()
        return out

    # ------------------------------------------------------------------ internals

    def _reported(
        self, rid: str, kind: Ignored, failure: LoadFailure | None
    ) -> tuple[LoadState, LoadFailure | None] | None:
        """A worker rank says a load ended (``failure`` None: loaded); once every rank has
        said so, the outcome and the first rank's failure, else None (also when the report
        is ignored).

        An aborted load ends FAILED when it failed on its own: a rank reported the failure
        before our abort went out to the workers (or reported it *failing*, ``told``).
        Under ``failure_policy: fail`` vLLM ends the request on that very report, before
        the connector reads it (``failed_recving`` first), so the abort we saw was the
        failure's doing. A failure reported after our abort went out is the worker
        cancelling the load ("aborted by the engine"): ABORTED."""
        record = self._records.get(rid)
        if record is None or record.state not in (LoadState.LOADING, LoadState.ABORTING):
            self.ignored[kind] += 1
            return None
        record.ranks_reported += 1
        if rid not in self._aborts_out:  # else the failure may be our abort's doing
            record.failure = record.failure or failure
        if record.ranks_reported < self.ranks:
            return None  # another rank may still write into the request's blocks
        if record.state is LoadState.ABORTING:
            failed = record.told or record.failure is not None
            outcome = LoadState.FAILED if failed else LoadState.ABORTED
            self._to_free.add(rid)
        elif record.failure is None:
            outcome = LoadState.LOADED
        else:
            outcome = self._failed_outcome()
        self._finish(rid, outcome)
        return outcome, None if record.told else record.failure

    def _failed_outcome(self) -> LoadState:
        if self.config.failure_policy is FailurePolicy.RECOMPUTE:
            return LoadState.RECOMPUTED
        return LoadState.FAILED

    def _finish(self, rid: str, outcome: LoadState) -> None:
        self._records.pop(rid).advance(outcome)
        self._aborts_out.discard(rid)
        self.outcomes[outcome] += 1
        if outcome is not LoadState.ABORTED:
            self._consumed.add(rid)
