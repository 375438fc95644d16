"""A minimal continuous-batching engine around :class:`ModelRunner` and the connector.

One :meth:`Engine.step` follows the connector API's order (``connector/common/api.py``)::

    admit waiting requests    local prefix hit -> get_num_new_matched_tokens -> allocate
                              -> update_state_after_alloc   (remote KV: wait for the load)
    build the batch           every running request's next tokens (decode: 1; prefill:
                              the rest of its prompt, chunked by the token budget)
    meta = build_connector_meta(); bind_connector_metadata(meta); start_load_kv()
    forward, greedy sampling
    wait_for_save(); get_finished(); update_connector_output() -> free / resume / fail
    finished requests         request_finished -> free now, or hold for the remote decode

Blocks come from one :class:`BlockPool` shared by every KV-cache group. A request holds,
per group, blocks for its whole budget (prompt + max_tokens) from admission on, so it
never runs out of blocks mid-flight; a prefill for a remote decode of a model with a state
group also holds a *resume block*: the state after its prompt's last-but-one token, where
the decode resumes. Full blocks whose KV is valid are named by their prefix hash
(:class:`PrefixCache`); requests and what they report live in ``examples/request.py``.

Producer (prefill) role: the connector may rewrite a held request's blocks in place for
its reader ("permute after save"), so a block never serves two live requests there; a
prefix hit only takes cached blocks nobody holds.

The forward runs on the runner's device; a sampled token and a returned logits row are
copied to the host right after the step (``RequestOutput`` holds numpy rows).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbridge.connector.common.api import WorkerConnector
from kvbridge.connector.scheduler.scheduler import KVBridgeScheduler
from kvbridge.examples.block_pool import BlockPool
from kvbridge.examples.model import SeqInput
from kvbridge.examples.prefix_cache import PrefixCache
from kvbridge.examples.request import (
    EngineError,
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
)
from kvbridge.examples.runner import ModelRunner
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.specs import KVCacheKind

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True


class Engine:
    """Owns the requests and the block pool; every call comes from one thread."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig | None = None,
        *,
        scheduler: KVBridgeScheduler | None = None,
        worker: WorkerConnector | None = None,
        exclusive_blocks: bool = False,
    ) -> None:
        if (scheduler is None) != (worker is None):
            raise EngineError("pass both halves of the connector or neither")
        self.runner = runner
        self.config = config or EngineConfig()
        self.scheduler = scheduler
        self.worker = worker
        self.pool = BlockPool(runner.kv_config.num_blocks)
        self.block_size = runner.block_size
        self.group_specs = tuple(g.spec for g in runner.kv_config.groups)
        self.prefix_cache = PrefixCache(
            self.pool,
            self.group_specs,
            self.block_size,
            enabled=self.config.enable_prefix_caching,
            exclusive_blocks=exclusive_blocks,
        )
        self.waiting: deque[Request] = deque()
        self.loading: dict[str, Request] = {}
        self.running: list[Request] = []
        self._deferred_free: dict[str, list[int]] = {}  # decode: blocks a load may still write
        self._outputs: list[RequestOutput] = []
        self._finishing: list[tuple[Request, FinishReason]] = []  # sampled their last token
        self._computed = True  # the last step ran the model (a new request: step at once)
        self.on_loaded: Callable[[Request], None] | None = None  # fault injection hook

    # -- requests -------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        per_group = -(-num_tokens // self.block_size)
        return per_group * len(self.group_specs) + int(self.runner.has_state)

    def add_request(self, request: Request) -> None:
        """Queue a request; raises :class:`EngineError` when it can never be served."""
        vocab = self.runner.model_config.vocab_size
        prompt = request.prompt_token_ids
        if not prompt:
            raise EngineError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"prompt token ids {bad[:8]} lie outside the vocabulary [0, {vocab})")
        need = self.blocks_needed(request.max_num_tokens)
        if need > self.pool.num_blocks:
            raise EngineError(
                f"prompt ({len(prompt)}) + max_tokens ({request.sampling.max_tokens}) needs "
                f"{need} blocks of {self.block_size} tokens; the pool has {self.pool.num_blocks}"
            )
        if self.find(request.request_id) is not None:
            raise EngineError(f"request id {request.request_id!r} is already in use")
        self.waiting.append(request)

    def find(self, request_id: str) -> Request | None:
        for req in itertools.chain(self.waiting, self.loading.values(), self.running):
            if req.request_id == request_id:
                return req
        return None

    def abort_request(self, request_id: str, reason: str = "aborted") -> None:
        req = self.find(request_id)
        if req is not None:
            self._end(req, FinishReason.ABORT, error=reason)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    @property
    def has_runnable(self) -> bool:
        """Requests the next step may compute: some run, or the last step ran the model
        (a request waiting for blocks or a free sequence slot may get them by the next
        step; one that only waits for its KV, or that the last step could not admit, is
        not worth a step back to back)."""
        return bool(self.running or (self.waiting and self._computed))

    def counts_by_status(self) -> dict[str, int]:
        return {
            RequestStatus.WAITING.value: len(self.waiting),
            RequestStatus.WAITING_FOR_REMOTE_KV.value: len(self.loading),
            RequestStatus.RUNNING.value: len(self.running),
            "finished_blocks_busy": len(self._deferred_free),  # a load may still write
        }

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns what each touched request produced."""
        self._admit()
        batch = self._schedule()
        if self.scheduler is not None and self.worker is not None:
            self.worker.bind_connector_metadata(self.scheduler.build_connector_meta())
            self.worker.start_load_kv()
        self._computed = bool(batch)
        if batch:
            logits = self.runner.execute([seq for _, seq in batch])
            for (req, seq), rows in zip(batch, logits, strict=True):
                self._advance(req, seq.num_tokens, rows)
        if self.scheduler is not None and self.worker is not None:
            self.worker.wait_for_save()
            events = self.scheduler.update_connector_output(self.worker.get_finished())
            self._apply_events(events)
        for req, reason in self._finishing:  # request_finished comes last in a step
            self._end(req, reason)
        self._finishing = []
        out, self._outputs = self._outputs, []
        return out

    def _admit(self) -> None:
        budget = self.config.max_num_seqs - len(self.running) - len(self.loading)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            try:
                admitted = self._try_allocate(req)
            except KVBridgeError as exc:  # unusable kv_transfer_params
                self.waiting.popleft()
                self._end(req, FinishReason.ERROR, error=str(exc), invalid=True)
                continue
            if not admitted:
                break
            self.waiting.popleft()
            budget -= 1
        for req in list(self.waiting):  # still queued: keep the prefill's lease alive
            self._keep_waiting(req)

    def _keep_waiting(self, req: Request) -> None:
        params = req.kv_transfer_params
        if self.scheduler is None or params is None or not params.do_remote_prefill:
            return
        try:
            if not req.matched:
                self.scheduler.get_num_new_matched_tokens(req, 0)
                req.matched = True
            self.scheduler.request_waiting(req)
        except KVBridgeError as exc:
            self.waiting.remove(req)
            self._end(req, FinishReason.ERROR, error=str(exc), invalid=True)

    def _try_allocate(self, req: Request) -> bool:
        hit_tokens, hits = self.prefix_cache.hit(req)
        num_external, is_async = 0, False
        if self.scheduler is not None:
            num_external, is_async = self.scheduler.get_num_new_matched_tokens(req, hit_tokens)
            req.matched = True
        per_group = -(-req.max_num_tokens // self.block_size)
        shared = [b for ids in hits for b in ids if b is not None]
        idle = sum(1 for b in shared if self.pool.refcount(b) == 0)
        resume = self._needs_resume_block(req)
        fresh = per_group * len(hits) - len(shared) + int(resume)
        if self.pool.num_free - idle < fresh:
            return False
        self.pool.ref(shared)
        new = iter(self.pool.allocate(fresh))
        padded = (ids + [None] * (per_group - len(ids)) for ids in hits)
        req.block_ids = [[b if b is not None else next(new) for b in ids] for ids in padded]
        req.resume_block = next(new) if resume else None
        req.num_computed_tokens = req.num_cached_tokens = hit_tokens
        req.num_registered_blocks = hit_tokens // self.block_size
        if self.scheduler is not None:
            external = num_external if is_async else 0
            self.scheduler.update_state_after_alloc(req, req.block_ids, external)
        if num_external and is_async:
            req.num_external_tokens = num_external
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            self.loading[req.request_id] = req
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return True

    def _needs_resume_block(self, req: Request) -> bool:
        params = req.kv_transfer_params
        return (
            self.runner.has_state
            and self.scheduler is not None
            and self.scheduler.config.is_producer
            and params is not None
            and params.do_remote_decode
        )

    def _schedule(self) -> list[tuple[Request, SeqInput]]:
        budget = self.config.max_num_batched_tokens
        batch = []
        for req in self.running:
            todo = req.num_tokens - req.num_computed_tokens
            n = min(todo, budget) if batch else todo  # the first request always runs
            if n <= 0:
                break
            budget -= n
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start : start + n]
            seq = SeqInput(
                token_ids=tokens,
                start_pos=start,
                block_tables=self.runner.block_tables(req.block_ids),
                state_snapshot=None
                if req.resume_block is None
                else (len(req.prompt_token_ids) - 1, req.resume_block),
            )
            batch.append((req, seq))
        return batch

    def _advance(self, req: Request, num_tokens: int, logits: torch.Tensor) -> None:
        req.num_computed_tokens += num_tokens
        self.prefix_cache.register_computed(req)
        if req.num_computed_tokens < req.num_tokens:
            return  # a chunk of the prompt; no token to sample yet
        row = logits[-1]  # on the runner's device: the token and the row are copied out
        token = int(row.argmax().cpu())
        host_row = row.float().cpu().numpy() if req.sampling.return_logits else None
        req.append_output(token, host_row)
        if token == req.sampling.eos_id:
            self._finishing.append((req, FinishReason.STOP))
        elif len(req.output_token_ids) >= req.sampling.max_tokens:
            self._finishing.append((req, FinishReason.LENGTH))
        else:
            self._emit(req)

    # -- connector events -----------------------------------------------------------------

    def _apply_events(self, events) -> None:
        assert self.scheduler is not None
        for rid in events.free_request_ids:
            self.pool.free(self._deferred_free.pop(rid, []))
            self.pool.free(self.scheduler.take_blocks_to_free(rid))
        for rid in events.loaded_request_ids:
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            req.num_computed_tokens = req.num_cached_tokens + req.num_external_tokens
            req.num_loaded_tokens = req.num_external_tokens
            self.prefix_cache.register_loaded(req)
            if self.on_loaded is not None:
                self.on_loaded(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        for failure in events.recompute:
            req = self.loading.pop(failure.request_id, None)
            if req is None:
                continue
            valid = max(req.num_cached_tokens, failure.num_valid_tokens)
            req.num_computed_tokens = valid - valid % self.block_size
            req.num_registered_blocks = req.num_computed_tokens // self.block_size
            logger.warning(
                "load of %s failed (%s); recomputing from token %d",
                req.request_id,
                failure.reason,
                req.num_computed_tokens,
            )
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        for failure in events.failed:
            req = self.loading.get(failure.request_id)
            if req is not None:
                self._end(req, FinishReason.ERROR, error=f"KV load failed: {failure.reason}")

    # -- ending requests ------------------------------------------------------------------

    def _end(
        self, req: Request, reason: FinishReason, *, error: str | None = None, invalid: bool = False
    ) -> None:
        """Finish ``req``: release or hand over its blocks, and emit its last output."""
        if req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.loading.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.error, req.invalid_request = reason, error, invalid
        resume, req.resume_block = req.resume_block, None
        blocks = [b for ids in req.block_ids or [] for b in ids]
        sched = self.scheduler
        if sched is None:
            self.pool.free(blocks)
        elif reason in (FinishReason.STOP, FinishReason.LENGTH):
            state_groups = [
                g for g, spec in enumerate(self.group_specs) if spec.kind is KVCacheKind.STATE
            ]
            delay, params = sched.request_finished(
                req,
                req.block_ids or [],
                resume_state_block_ids=None if resume is None else {state_groups[0]: resume},
            )
            if not delay and resume is not None:
                self.pool.free([resume])
            req.out_params = params
            if not delay:
                self.pool.free(blocks)
            elif params is not None:  # prefill: the connector holds what decode reads
                self.pool.free(sched.take_blocks_to_free(req.request_id))
            else:  # decode: a load may still write into them
                self._deferred_free[req.request_id] = blocks
        else:
            if resume is not None:
                self.pool.free([resume])
            if req.matched:  # the connector knows the request: let it release its side
                sched.request_aborted(req.request_id)
            if sched.defers_free(req.request_id):
                self._deferred_free[req.request_id] = blocks
            else:
                self.pool.free(blocks)
                self.pool.free(sched.take_blocks_to_free(req.request_id))
        req.block_ids = None
        self._emit(req)

    def _emit(self, req: Request) -> None:
        self._outputs.append(req.take_output())
