"""Scheduler side of the connector: which tokens to load, which blocks to keep, when to free.

Engine contract, beyond the :class:`~kvbridge.connector.common.api.SchedulerConnector` Protocol:

- Call ``get_num_new_matched_tokens`` for a new request (again each step while it cannot
  be allocated), then ``update_state_after_alloc`` once its blocks exist, even with
  ``num_external_tokens == 0``. While a remote-prefill request waits for blocks, call
  ``request_waiting(request)`` each step: the worker then heartbeats the prefill (at most
  once per ``heartbeat_s`` per request) so its lease does not run out meanwhile.
- Prefill. When ``request_finished`` returns ``delay_free=True`` the connector owns every
  block passed in; the engine frees them only through ``take_blocks_to_free(request_id)``,
  which hands each block out exactly once. Call it right after ``request_finished`` (the
  blocks no decode will read: sliding-window blocks below the window, older states,
  blocks past the prompt) and for every id in ``SchedulerEvents.free_request_ids`` (the
  kept blocks, once decode is done, the lease ran out or the request was aborted)::

      delay, params = sched.request_finished(req, blocks)
      pool.free(sched.take_blocks_to_free(req.request_id) if delay else flatten(blocks))
      ...
      for rid in sched.update_connector_output(out).free_request_ids:
          pool.free(sched.take_blocks_to_free(rid))

- Decode. The engine owns its blocks; while ``defers_free(request_id)`` is True a load may
  still write into them. A request given up (``request_aborted``, or ``request_finished``
  before its load ended, which then returns ``delay_free=True``) keeps its blocks until
  its id shows up in ``free_request_ids`` when ``defers_free`` says so; otherwise the
  engine frees them at once. Every other remote-prefill request ends in
  ``loaded_request_ids``, ``recompute`` or ``failed``, or (nothing to read) with a release.
- Every request ends with one ``request_finished`` or ``request_aborted`` call.

This class checks roles and forwards: decode requests to
:class:`~kvbridge.connector.scheduler.loads.Loads`, prefill requests to
:class:`~kvbridge.connector.scheduler.sends.Sends`. Which prefill blocks are kept, and the lease:
see :mod:`kvbridge.connector.scheduler.retention`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from kvbridge.connector.common.api import ConnectorRequest, SchedulerEvents
from kvbridge.connector.common.config import ConfigError, KVTransferConfig
from kvbridge.connector.common.metadata import ConnectorMetadata, LoadFailure, WorkerOutput
from kvbridge.connector.common.params import KVTransferParams, ParamsError
from kvbridge.connector.common.signing import ParamsSigner
from kvbridge.connector.scheduler.lifecycle import Ignored, LoadState, SendState
from kvbridge.connector.scheduler.loads import Loads
from kvbridge.connector.scheduler.sends import Sends
from kvbridge.layouts.groups import KVCacheConfig

logger = logging.getLogger(__name__)


class KVBridgeScheduler:
    """The :class:`~kvbridge.connector.common.api.SchedulerConnector` of kvbridge, for either
    role."""

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config: KVCacheConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        tp_size: int = 1,
        pp_layers: Sequence[tuple[int, int]] = (),
    ) -> None:
        """``tp_size``: the engine's tensor-parallel size; ``pp_layers``: the model layers
        ``[first, end)`` each of its pipeline stages holds (empty: no pipeline
        parallelism). Its workers are ranks ``0..tp_size * stages - 1``, stage-major, rank
        ``r``'s side channel on ``kv_port + r``, or with kv_port 0 on the port handed to
        :meth:`set_side_channel_ports`. ``clock`` times leases and heartbeats;
        ``wall_clock`` dates signed params (both workers read it)."""
        if tp_size < 1:
            raise ConfigError(f"tp_size={tp_size} must be at least 1")
        self.tp_size = tp_size
        self.pp_layers = tuple((int(a), int(b)) for a, b in pp_layers)
        self.num_ranks = tp_size * (len(self.pp_layers) or 1)
        self.config = config
        self.kv_cache_config = kv_cache_config
        self._clock = clock
        self._specs = tuple(g.spec for g in kv_cache_config.groups)
        block_sizes = [s.block_size for s in self._specs]
        if config.is_producer and len(set(block_sizes)) > 1:
            raise ConfigError(
                f"a producer's KV-cache groups must share one block size (kv_transfer_params "
                f"carry a single remote_block_size); got {block_sizes} for groups "
                f"0..{len(self._specs) - 1}"
            )
        self._signer = ParamsSigner(config.secret_bytes, wall_clock=wall_clock)
        if not self._signer.enabled:
            logger.warning(
                "kvbridge %s (%s): no secret configured: kv_transfer_params are not signed "
                "and the side channel is not authenticated; any client that reaches a decode "
                "worker can make it read any block of a prefill's registered memory. Keep "
                "the workers on loopback or a private network, or set 'secret'",
                config.engine_id,
                config.kv_role.value,
            )
        self.ignored: Counter[Ignored] = Counter()
        self._loads = Loads(
            config, self._specs, self._signer, self.ignored, clock=clock, ranks=self.num_ranks
        )
        self._sends = Sends(config, self._specs, tp_size=tp_size, pp_layers=self.pp_layers)
        self.load_outcomes = self._loads.outcomes
        self.send_outcomes = self._sends.outcomes

    # ------------------------------------------------------------------ decode side

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens past the local prefix hit to read from the remote prefill, and whether
        the request must wait for them. Raises ParamsError on unusable params."""
        params = request.kv_transfer_params
        if params is None:
            return 0, False
        if params.do_remote_decode and not self.config.is_producer:
            raise ParamsError(
                f"request {request.request_id!r}: do_remote_decode=true reached a "
                f"{self.config.kv_role.value} engine; send it to a kv_producer"
            )
        return self._loads.match(request, params, num_computed_tokens)

    def update_state_after_alloc(
        self,
        request: ConnectorRequest,
        block_ids_per_group: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """Blocks exist: queue the load, or (nothing to load) tell prefill to free."""
        self._loads.allocated(request, block_ids_per_group, num_external_tokens)

    def refuse_load(
        self,
        request: ConnectorRequest,
        block_ids_per_group: Sequence[Sequence[int]],
        reason: str,
    ) -> LoadFailure | None:
        """For an engine adapter that must not raise into its engine: fail the load that
        ``update_state_after_alloc`` refused (a :class:`LifecycleError`, e.g. the engine
        changed the token count after ``get_num_new_matched_tokens``). Nothing is read,
        prefill is told to free; returns the failure the engine must be told of (None: a
        load already went out, its own report ends it)."""
        return self._loads.refuse(request.request_id, block_ids_per_group, reason)

    def request_waiting(self, request: ConnectorRequest) -> None:
        """The request is still queued for blocks this step: keep prefill's lease alive."""
        self._loads.keep_alive(request.request_id)

    def defers_free(self, request_id: str) -> bool:
        """True while a transfer may still use the request's blocks: a decode load in
        flight (aborted or not) or a prefill hold. The engine must not free them itself."""
        return self._loads.busy(request_id) or self._sends.book.live(request_id) is not None

    # ------------------------------------------------------------------ prefill side

    def request_finished(
        self,
        request: ConnectorRequest,
        block_ids_per_group: Sequence[Sequence[int]],
        *,
        resume_state_block_ids: Mapping[int, int] | None = None,
    ) -> tuple[bool, KVTransferParams | None]:
        """A request ends. Prefill with ``do_remote_decode``: keep the blocks decode may read
        (``delay_free=True``; see ``take_blocks_to_free``) and return the params for it.

        ``resume_state_block_ids``: per state group, a block outside the group's list that
        holds the state after the prompt's last-but-one token (the point where decode
        resumes). With one for every state group decode resumes at ``N - 1``, otherwise at
        the last state boundary below it. When ``delay_free`` is True the connector owns
        these blocks too (handed back by ``take_blocks_to_free``)."""
        rid = request.request_id
        self._loads.forget(rid)
        if rid in self._loads:  # a decode request ended before its load did
            return self._loads.abort(rid), None
        params = request.kv_transfer_params
        if params is None or not params.do_remote_decode or not self.config.is_producer:
            return False, None
        params = self._sends.hold(
            request, block_ids_per_group, resume_state_block_ids, self._clock()
        )
        return True, self._signer.sign(params, self.config.lease_s)

    def take_blocks_to_free(self, request_id: str) -> tuple[int, ...]:
        """Blocks of a delayed-free prefill request the engine may free now; each block is
        returned once over all calls (unknown or drained requests give ``()``)."""
        return self._sends.book.take(request_id)

    def set_side_channel_ports(self, ports: Sequence[int]) -> None:
        """The ports the workers' side channels bound, rank order: needed before the first
        remote-decode request finishes when ``kv_port`` is 0 (see
        :mod:`kvbridge.connector.scheduler.advertised`)."""
        self._sends.ports.bind(ports)

    # ------------------------------------------------------------------ both sides

    def build_connector_meta(self) -> ConnectorMetadata:
        """The step's work for the workers; empties the queues."""
        to_load, to_abort, waiting, to_release = self._loads.drain()
        to_send, freed, to_end = self._sends.drain()
        return ConnectorMetadata(
            reqs_to_load=to_load,
            reqs_to_send=to_send,
            reqs_to_abort=to_abort,
            reqs_waiting=waiting,
            reqs_to_release=to_release,
            reqs_freed=freed,
            sends_to_end=to_end,
        )

    def update_connector_output(self, output: WorkerOutput) -> SchedulerEvents:
        """Fold one worker rank's report in (under tensor parallelism once per rank: a
        load ends when every rank has reported it); unknown or repeated ids are counted
        in ``ignored``."""
        book = self._sends.book
        for rid in output.finished_sending:
            send = book.live(rid)
            if send is None or send.state is SendState.PENDING:  # no worker has it yet
                self.ignored[Ignored.FINISHED_SENDING] += 1
                continue
            self._sends.finished(send, expired=rid in output.expired_leases)
        loaded, recompute, failed = self._loads.fold(output)
        return SchedulerEvents(
            free_request_ids=frozenset(self._loads.take_freed() | self._sends.take_released()),
            loaded_request_ids=frozenset(loaded),
            recompute=tuple(recompute),
            failed=tuple(failed),
        )

    def request_aborted(self, request_id: str) -> None:
        """Decode: tell prefill to free; blocks a load may still write wait for
        free_request_ids (see ``defers_free``). Prefill: the workers end the hold (no
        sooner than the claims they granted, after the pushes writing from it) and the
        kept blocks come in free_request_ids; not sent to a worker yet: freed at once."""
        self._loads.forget(request_id)
        handled = False
        if request_id in self._loads:
            self._loads.abort(request_id)
            handled = True
        send = self._sends.book.live(request_id)
        if send is not None:
            self._sends.abort(send)
            handled = True
        if not handled:
            self.ignored[Ignored.ABORT] += 1

    # ------------------------------------------------------------------ introspection

    def load_state(self, request_id: str) -> LoadState | None:
        return self._loads.state(request_id)

    def send_state(self, request_id: str) -> SendState | None:
        return self._sends.book.state(request_id)

    @property
    def num_held_sends(self) -> int:
        """Prefill requests whose blocks are kept for a reader."""
        return self._sends.book.num_live

    @property
    def num_held_blocks(self) -> int:
        """Prefill blocks kept for readers."""
        return self._sends.book.num_kept_blocks

    @property
    def num_unserved_loads(self) -> int:
        """Decode requests whose params could not serve a load (a sliding window or a state
        prefill did not keep), each logged as a warning with its reason; decode computed
        them."""
        return self._loads.num_unserved

    @property
    def num_live_loads(self) -> int:
        """Decode requests not yet loaded, recomputed, failed, released or aborted."""
        return len(self._loads)

    @property
    def num_live_requests(self) -> int:
        """Decode requests not yet ended plus prefill requests still holding blocks."""
        return len(self._loads) + self._sends.book.num_live

    def __repr__(self) -> str:
        return (
            f"KVBridgeScheduler(role={self.config.kv_role.value}, "
            f"engine_id={self.config.engine_id!r}, loads={len(self._loads)}, "
            f"sends={self._sends.book.num_live})"
        )
