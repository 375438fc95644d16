"""vLLM's scheduler-side connector calls, mapped onto :class:`KVBridgeScheduler`.

vLLM frees a delayed request's blocks only when a worker lists the request in
``finished_sending`` / ``finished_recving``; kvbridge's scheduler decides frees itself
(decode done, lease expiry, aborts). The worker side therefore reports every request the
scheduler released (``ConnectorMetadata.reqs_freed``) as finished, and the scheduler side
only drains kvbridge's block books (vLLM owns the blocks).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvbridge.connector.common.config import ConfigError, KVTransferConfig
from kvbridge.connector.common.engine_calls import EngineCallTimes
from kvbridge.connector.common.metadata import WorkerOutput
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.common.signing import ParamsSignatureError
from kvbridge.connector.scheduler.lifecycle import LoadState, SendState
from kvbridge.connector.scheduler.scheduler import KVBridgeScheduler
from kvbridge.connector.vllm.stats import (
    CounterDelta,
    KVBridgeStats,
    PeerDelta,
    engine_call_data,
)
from kvbridge.connector.vllm.step_metadata import (
    KVBridgeHandshakeMetadata,
    KVBridgeMetadata,
    KVBridgeWorkerMetadata,
)
from kvbridge.connector.vllm.translate import (
    engine_block_ids,
    parse_params,
    position_block_ids,
)
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.specs import KVCacheKind

logger = logging.getLogger(__name__)

# vLLM request states whose KV is complete and may be handed to a remote decode.
_HANDOVER_STATES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class RequestView:
    """A vLLM ``Request`` as :class:`kvbridge.connector.common.api.ConnectorRequest` (params parsed
    once). ``withheld``: prompt tokens the prefill engine was told not to compute (see
    :meth:`VLLMSchedulerSide.on_new_request`); the view's prompt still ends with them."""

    __slots__ = ("kv_transfer_params", "prompt_token_ids", "request_id")

    def __init__(
        self, request: Any, params: KVTransferParams | None, withheld: Sequence[int] = ()
    ) -> None:
        self.request_id: str = request.request_id
        prompt = request.prompt_token_ids or ()
        self.prompt_token_ids: Sequence[int] = [*prompt, *withheld] if withheld else prompt
        self.kv_transfer_params = params


class VLLMSchedulerSide:
    def __init__(
        self,
        config: KVTransferConfig,
        kv_config: KVCacheConfig,
        *,
        tp_size: int = 1,
        pp_layers: Sequence[tuple[int, int]] = (),
        single_block_groups: frozenset[int] = frozenset(),
    ) -> None:
        """``pp_layers``: the model layers ``[first, end)`` of each pipeline stage (empty:
        none). ``single_block_groups``: state groups vLLM gives one block per request
        (:func:`kvbridge.connector.vllm.translate.single_block_groups`)."""
        self._single = single_block_groups
        self.sched = KVBridgeScheduler(config, kv_config, tp_size=tp_size, pp_layers=pp_layers)
        self._views: dict[str, RequestView] = {}  # requests kvbridge may still load for
        self._bad_params: set[str] = set()
        self.counters: Counter[str] = Counter()
        # the engine core's calls into this side, per hook (KVBridgeConnector times them)
        self.engine_calls = EngineCallTimes()
        self._delta = CounterDelta()
        # prefills whose params fail this decode's secret, by address (peer_state gauge)
        self._peer_states: dict[str, str] = {}
        self._peer_failures: Counter[str] = Counter()
        self._peers = PeerDelta()
        # state (Mamba) groups: vLLM keeps one running state per request, so a prefill
        # must stop one token short (decode resumes from the state after N - 1 tokens);
        # sliding-window groups: vLLM frees the out-of-window blocks of the computed
        # tokens at finish, so a prefill of all N would free the block of token N - w,
        # which decode's window for token N - 1 reads
        self._state_groups = [g.group_id for g in kv_config.groups if g.kind is KVCacheKind.STATE]
        self._withholds = any(
            g.kind in (KVCacheKind.STATE, KVCacheKind.SLIDING_WINDOW) for g in kv_config.groups
        )
        self._withheld: dict[str, list[int]] = {}  # prompt tokens a prefill did not compute
        self._refused: list[str] = []  # loads refused since the last metadata

    def _view(self, request: Any) -> RequestView | None:
        """The request's view; None (and counted, logged once) when its params are bad."""
        rid = request.request_id
        view = self._views.get(rid)
        if view is not None:
            return view
        if rid in self._bad_params:
            return None
        try:
            params = parse_params(request.kv_transfer_params)
        except KVBridgeError as exc:
            self._bad_params.add(rid)
            self.counters["bad_params"] += 1
            logger.error("request %s: %s; serving it without kvbridge", rid, exc)
            return None
        return RequestView(request, params)

    def on_new_request(self, request: Any) -> None:
        """A request reached the engine. A prefill of a model with state or sliding-window
        groups withholds the prompt's last token, which decode computes itself:

        - state: vLLM keeps one running state per request, and decode needs the state
          after the tokens before the last one (vLLM's own NixlConnector does the same);
        - sliding window ``w``: when a request of ``n`` computed tokens finishes, vLLM
          frees the blocks wholly before token ``n - w + 1`` before the connector sees
          them (``Scheduler._connector_finished`` calls ``remove_skipped_blocks``). Decode
          computes token ``N - 1``, which attends to tokens ``N - w ..``: with ``n = N``
          the block of token ``N - w`` is gone whenever ``N - w + 1`` starts a block; with
          ``n = N - 1`` it never is.

        The request then computes ``N - 1`` tokens and stops after one output token, its
        params marked ``_p_side_truncated`` as vLLM's NixlConnector marks them; its
        kvbridge params still describe ``N``. A prompt that cannot be shortened this way
        (see :meth:`_not_withheld`) is computed whole: a state model's is handed over to
        no decode; a sliding-window model's is, and a decode whose window prefill could
        not keep computes it (a counted warning there)."""
        if not self._withholds or not self.sched.config.is_producer:
            return
        view = self._view(request)
        params = None if view is None else view.kv_transfer_params
        if params is None or not params.do_remote_decode:
            return
        rid = request.request_id
        if rid in self._withheld:  # preempted and added again: withheld already
            return
        if self._not_withheld(request):
            return
        prompt = list(request.prompt_token_ids)
        withheld = prompt[-1:]
        # a new list: the engine's output side may hold the one the request came with
        request.prompt_token_ids = prompt[:-1]
        del request._all_token_ids[-1:]  # in place: request.all_token_ids views this list
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        if isinstance(request.kv_transfer_params, dict):
            request.kv_transfer_params["_p_side_truncated"] = True
        self._withheld[rid] = [int(t) for t in withheld]
        logger.debug(
            "request %s: prefill computes %d of %d prompt tokens", rid, len(prompt) - 1, len(prompt)
        )

    @staticmethod
    def _not_withheld(request: Any) -> str:
        """Why the last prompt token of ``request`` cannot be withheld ('' if it can)."""
        prompt = request.prompt_token_ids
        raw = request.kv_transfer_params
        if prompt is None or getattr(request, "prompt_embeds", None) is not None:
            return "a prompt given as embeddings"
        if len(prompt) < 2:
            return "a one-token prompt"
        if getattr(request, "skip_reading_prefix_cache", False):
            return "prompt logprobs asked for (decode computes the whole prompt)"
        if getattr(request, "mm_features", None):
            return "a multimodal prompt (the last token may be inside a placeholder)"
        if isinstance(raw, dict) and raw.get("_p_side_truncated"):
            return "another connector shortened the prompt already"
        return ""

    def set_handshake_metadata(self, metadata: Mapping[int, object]) -> None:
        """Every rank's bound side-channel port, keyed by its engine rank (``pp_rank *
        tp_size + tp_rank``; vLLM gathers them from the workers at startup, after the
        caches are registered and before any request): the params advertise them. Without
        this call a ``kv_port`` 0 prefill hands out no params (its requests end without
        them, logged); a fixed ``kv_port`` is checked against them."""
        ranks = self.sched.num_ranks
        ports: list[int] = []
        for rank in range(ranks):
            meta = metadata.get(rank)
            if not isinstance(meta, KVBridgeHandshakeMetadata) or meta.rank != rank:
                raise ConfigError(
                    f"vLLM's handshake metadata for rank {rank} of {ranks} (pipeline stage "
                    f"{rank // self.sched.tp_size}, TP rank {rank % self.sched.tp_size}) is "
                    f"{meta!r}; expected KVBridgeHandshakeMetadata(rank={rank}, ...) from "
                    f"every rank (ranks given: {sorted(metadata)})"
                )
            ports.append(meta.side_channel_port)
        self.sched.set_side_channel_ports(ports)
        logger.info("kvbridge side channels of ranks 0..%d: ports %s", ranks - 1, ports)

    # -- decode ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        view = self._view(request)
        if view is None or view.kv_transfer_params is None:
            return 0, False
        try:
            count, is_async = self.sched.get_num_new_matched_tokens(view, num_computed_tokens)
        except KVBridgeError as exc:
            self._bad_params.add(view.request_id)
            self.counters["bad_params"] += 1
            if not self._bad_secret(view.kv_transfer_params, exc):
                logger.error("request %s: %s; computing it locally", view.request_id, exc)
            return 0, False
        if self.sched.load_state(view.request_id) is not None:
            self._views[view.request_id] = view
            logger.info(
                "request %s: %d prompt tokens, %d computed locally, %d to load from %s",
                view.request_id,
                len(request.prompt_token_ids),
                num_computed_tokens,
                count,
                view.kv_transfer_params.remote_engine_id if view.kv_transfer_params else "",
            )
        return count, is_async

    def _bad_secret(self, params: KVTransferParams, exc: KVBridgeError) -> bool:
        """Params that fail this decode's signature check, unexpired: the prefill signs
        with another secret (or none), and every request from it is recomputed. Its
        address shows as ``bad_secret`` (``kvbridge_peer_state``); the first request from
        it is logged at ERROR with the fix, the next ones at DEBUG. False: another
        error."""
        expired = params.expires_at and time.time() > params.expires_at
        if not isinstance(exc, ParamsSignatureError) or expired:
            return False
        peer = f"{params.remote_host}:{params.remote_port}"
        self._peer_failures["bad_secret"] += 1
        if self._peer_states.get(peer) == "bad_secret":
            logger.debug("request of %s: %s; computing it locally", peer, exc)
            return True
        self._peer_states[peer] = "bad_secret"
        logger.error(
            "kvbridge: peer %s (engine %s) is bad_secret: %s. Every request it prefills is "
            "recomputed here until fixed.\nfix: set the same `secret` on every prefill and "
            "decode worker, and pass kv_transfer_params on unchanged "
            '(docs/troubleshooting.md, "secret mismatch")',
            peer,
            params.remote_engine_id,
            exc,
        )
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Queue the load. A call that does not fit what ``get_num_new_matched_tokens``
        offered (vLLM may round ``num_external_computed_tokens`` down to a block boundary
        after it, e.g. for a sliding-window replay) never raises into vLLM's
        ``schedule()``: the load is refused (prefill told to free, nothing read) and
        every worker reports it finished and failed (``failed_recving``), so vLLM
        recomputes it (``kv_load_failure_policy``) and never counts the tokens as
        computed."""
        view = self._views.get(request.request_id)
        if view is None:
            return
        block_ids: list[list[int]] = []
        try:
            block_ids = position_block_ids(engine_block_ids(blocks.get_block_ids()), self._single)
            self.sched.update_state_after_alloc(view, block_ids, num_external_tokens)
        except KVBridgeError as exc:
            failure = self.sched.refuse_load(view, block_ids, str(exc))
            self.counters["loads_refused"] += 1
            if failure is not None and num_external_tokens > 0:
                self._refused.append(view.request_id)  # vLLM waits for it: report it
            logger.warning(
                "request %s: update_state_after_alloc(num_external_tokens=%d) does not fit "
                "the load offered: %s; %s",
                view.request_id,
                num_external_tokens,
                exc,
                "load failed, vLLM recomputes it"
                if failure is not None
                else "a load already went out for it: its own report ends it",
            )

    def build_connector_meta(self) -> KVBridgeMetadata:
        for rid, view in list(self._views.items()):
            state = self.sched.load_state(rid)
            if state is None:
                del self._views[rid]
            elif state in (LoadState.MATCHED, LoadState.FULL_HIT):
                self.sched.request_waiting(view)  # still queued: keep prefill's lease alive
        refused, self._refused = tuple(self._refused), []
        return KVBridgeMetadata(self.sched.build_connector_meta(), refused=refused)

    # -- both -----------------------------------------------------------------------------

    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        withheld = self._withheld.pop(rid, [])
        view = self._views.pop(rid, None) or self._view(request)  # bad params: counted once
        self._bad_params.discard(rid)
        if view is None:
            return False, None
        if withheld:
            view = RequestView(request, view.kv_transfer_params, withheld)
        status = getattr(request.status, "name", str(request.status))
        if status not in _HANDOVER_STATES:
            # Aborted or failed: nothing to hand over; release whatever kvbridge holds.
            try:
                self.sched.request_aborted(rid)
            except KVBridgeError as exc:  # never into vLLM: its blocks wait if a load runs
                logger.warning("request %s: aborting its transfer: %s", rid, exc)
            return self.sched.defers_free(rid), None
        ids = position_block_ids(engine_block_ids(block_ids), self._single)
        if self._state_groups and not withheld and self.sched.config.is_producer:
            raw = view.kv_transfer_params
            if raw is not None and raw.do_remote_decode:
                # its state is the one after the whole prompt, not where decode resumes
                logger.info(
                    "request %s: not handed over to a decode (%s); decode computes it",
                    rid,
                    self._not_withheld(request) or "the prompt was not shortened",
                )
                return False, None
        try:
            resume = self._resume_blocks(view, ids) if withheld else None
            delay, params = self.sched.request_finished(view, ids, resume_state_block_ids=resume)
        except KVBridgeError as exc:
            logger.error("request %s: cannot keep its KV for a remote decode: %s", rid, exc)
            return False, None
        if params is not None:
            self.sched.take_blocks_to_free(rid)  # vLLM frees all of them on finished_sending
        return delay, None if params is None else params.to_dict()

    def _resume_blocks(self, view: RequestView, ids: Sequence[Sequence[int]]) -> dict[int, int]:
        """Per state group, the block that holds the state after ``N - 1`` tokens: vLLM
        keeps a request's running state in the block of its last computed token (prefix
        caching's "align" mode; without prefix caching the group has one block)."""
        computed = len(view.prompt_token_ids) - 1
        out = {}
        for g in self._state_groups:
            spec = self.sched.kv_cache_config.groups[g].spec
            group = ids[g]
            index = (computed - 1) // spec.block_size
            if computed < 1 or index >= len(group) or group[index] < 0:
                raise KVBridgeError(
                    f"state group {g}: no block holds the state after {computed} tokens "
                    f"(block ids {list(group)}, {spec.block_size}-token blocks)"
                )
            out[g] = group[index]
        return out

    def update_connector_output(self, worker_meta: Any) -> None:
        """Each TP rank's report in turn (a step with none still advances leases)."""
        outputs = (
            worker_meta.outputs
            if isinstance(worker_meta, KVBridgeWorkerMetadata) and worker_meta.outputs
            else (WorkerOutput(),)
        )
        for output in outputs:
            events = self.sched.update_connector_output(output)
            for rid in events.free_request_ids:
                self.sched.take_blocks_to_free(rid)
            for failure in (*events.recompute, *events.failed):
                logger.warning("KV load of %s failed: %s", failure.request_id, failure.reason)

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> KVBridgeStats:
        s = self.sched
        current: dict[str, float] = dict(self.counters)
        for state in SendState:
            if state in (SendState.DONE, SendState.EXPIRED, SendState.ABORTED):
                current[f"sends_{state.name.lower()}"] = s.send_outcomes[state]
        for state in (
            LoadState.LOADED,
            LoadState.RECOMPUTED,
            LoadState.FAILED,
            LoadState.ABORTED,
            LoadState.RELEASED,
        ):
            current[f"loads_{state.name.lower()}"] = s.load_outcomes[state]
        current["loads_unserved"] = s.num_unserved_loads
        data: dict[str, float] = self._delta.take(current)
        data["held_requests"] = s.num_held_sends
        data["held_blocks"] = s.num_held_blocks
        data["loading_requests"] = s.num_live_loads
        peers = self._peers.take(self._peer_states, dict(self._peer_failures))
        return KVBridgeStats(data={**data, **engine_call_data(self.engine_calls), **peers})
