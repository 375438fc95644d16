"""Prefill side of the scheduler: what a finished request keeps for its decode, until when.

:class:`Sends` turns a finished ``do_remote_decode`` request into the blocks kept for the
reader (``kvbridge.connector.scheduler.retention``), the :class:`SendSpec` for the workers and the
``kv_transfer_params`` for the decode; it holds them until every worker rank reported the
request finished (Done, a lease ended on the worker's clock, or an abort the workers
ended), and releases each exactly once.
:class:`~kvbridge.connector.scheduler.scheduler.KVBridgeScheduler` owns one and forwards the
engine's calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from kvbridge.connector.common.api import ConnectorRequest
from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.common.metadata import SendSpec
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.scheduler.advertised import AdvertisedPorts
from kvbridge.connector.scheduler.lifecycle import LifecycleError, SendState
from kvbridge.connector.scheduler.retention import (
    LeaseBook,
    SendRecord,
    resume_point,
    retained_block_range,
)
from kvbridge.layouts.specs import KVCacheKind, KVCacheSpec


class Sends:
    """Held prefill requests; ``released`` collects ids whose blocks the engine may free."""

    def __init__(
        self,
        config: KVTransferConfig,
        specs: Sequence[KVCacheSpec],
        *,
        tp_size: int,
        pp_layers: Sequence[tuple[int, int]] = (),
    ) -> None:
        """``pp_layers``: the model layers ``[first, end)`` of each pipeline stage (empty:
        one stage); every TP rank of every stage holds a request's blocks."""
        self.config = config
        self.tp_size = tp_size
        self.pp_layers = [list(span) for span in pp_layers]
        self.num_ranks = tp_size * (len(self.pp_layers) or 1)
        self.ports = AdvertisedPorts(config.kv_port, self.num_ranks)
        self._specs = tuple(specs)
        self._block_size = specs[0].block_size
        self._state_groups = [g for g, s in enumerate(specs) if s.kind is KVCacheKind.STATE]
        self.book = LeaseBook()
        self.to_send: dict[str, SendSpec] = {}  # the next metadata's new sends
        self.freed: list[str] = []  # aborted before any worker had them
        self.to_end: list[str] = []  # aborted held sends: the workers end their holds
        self.released: set[str] = set()
        self.outcomes: Counter[SendState] = Counter()

    def hold(
        self,
        request: ConnectorRequest,
        block_ids_per_group: Sequence[Sequence[int]],
        resume_state_block_ids: Mapping[int, int] | None,
        now: float,
    ) -> KVTransferParams:
        """Keep what the decode reads (see ``KVBridgeScheduler.request_finished``)."""
        rid = request.request_id
        if rid in self.book:
            raise LifecycleError(f"request {rid!r}: request_finished called twice")
        remote_port, remote_ports = self.ports.advertise(rid)  # before anything is held
        if len(block_ids_per_group) != len(self._specs):
            raise LifecycleError(
                f"request {rid!r}: {len(block_ids_per_group)} block lists for "
                f"{len(self._specs)} KV-cache groups"
            )
        resume = dict(resume_state_block_ids or {})
        if set(resume) - set(self._state_groups):
            raise LifecycleError(
                f"request {rid!r}: resume_state_block_ids names groups {sorted(resume)}; the "
                f"state groups are {self._state_groups}"
            )
        num_tokens = len(request.prompt_token_ids)
        exact = all(g in resume for g in self._state_groups)
        end = resume_point(num_tokens, self._block_size, resume_state=exact)
        kept_lists, first_blocks, kept, free = [], [], [], []
        for g, (spec, group_ids) in enumerate(zip(self._specs, block_ids_per_group, strict=True)):
            ids = list(map(int, group_ids))
            first, stop = retained_block_range(spec, end)
            if len(ids) < stop:
                raise LifecycleError(
                    f"request {rid!r}, group {g}: {len(ids)} blocks for a {num_tokens}-token "
                    f"prompt; blocks 0..{stop - 1} of {spec.block_size} tokens are needed"
                )
            # Negative ids are placeholders (no block kept there): trim them off the ends.
            while first < stop and ids[first] < 0:
                first += 1
            while stop > first and ids[stop - 1] < 0:
                stop -= 1
            group_kept = ids[first:stop]
            if g in resume:
                if exact and end > 0:
                    group_kept, first = [int(resume[g])], (end - 1) // spec.block_size
                else:
                    free.append(int(resume[g]))
            kept_lists.append(group_kept)
            first_blocks.append(first)
            kept.extend(b for b in group_kept if b >= 0)
            held = set(group_kept)
            free.extend(b for b in ids if b >= 0 and b not in held)
        self.book.hold(rid, kept, free)
        self.to_send[rid] = SendSpec(
            request_id=rid,
            block_ids=tuple(map(tuple, kept_lists)),
            first_block=tuple(first_blocks),
            lease_s=self.config.lease_s,
        )
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.config.engine_id,
            remote_host=self.config.kv_ip,
            remote_port=remote_port,  # rank 0's: the scheduler speaks for rank 0
            remote_rank=0,
            remote_tp_size=self.tp_size,
            remote_pp_layers=[list(span) for span in self.pp_layers],
            remote_block_ids=kept_lists,
            remote_first_block=first_blocks,
            remote_block_size=self._block_size,
            num_tokens=num_tokens,
            remote_request_id=rid,
            resume_tokens=end,
            remote_ports=remote_ports,
        )

    def finished(self, record: SendRecord, *, expired: bool) -> bool:
        """A worker rank's hold ended; True once every rank's has (the blocks are free)."""
        record.ranks_reported += 1
        record.expired = record.expired or expired
        if record.ranks_reported < self.num_ranks:
            return False  # another rank may still serve a READ of its blocks
        if record.abort_queued:
            why = SendState.ABORTED
        else:
            why = SendState.EXPIRED if record.expired else SendState.DONE
        self._release(record, why)
        return True

    def abort(self, record: SendRecord) -> None:
        """The engine dropped a held request. A worker that has it ends the hold (no
        sooner than the claims it granted) and reports it; one that never had it
        (PENDING) is told to refuse its readers, and the blocks are free at once."""
        if record.state is SendState.PENDING:
            del self.to_send[record.request_id]
            self.freed.append(record.request_id)
            self._release(record, SendState.ABORTED)
        elif not record.abort_queued:
            record.abort_queued = True
            self.to_end.append(record.request_id)

    def _release(self, record: SendRecord, why: SendState) -> None:
        self.book.release(record, why)
        self.outcomes[why] += 1
        self.released.add(record.request_id)

    def drain(self) -> tuple[tuple[SendSpec, ...], tuple[str, ...], tuple[str, ...]]:
        """The next metadata's new sends (now HELD), sends aborted before any worker had
        them, and held sends whose holds the workers must end (aborted)."""
        for rid in self.to_send:
            send = self.book.live(rid)
            assert send is not None, f"queued SendSpec of {rid!r} outlived its record"
            send.advance(SendState.HELD)
        out = tuple(self.to_send.values()), tuple(self.freed), tuple(self.to_end)
        self.to_send, self.freed, self.to_end = {}, [], []
        return out

    def take_released(self) -> set[str]:
        out, self.released = self.released, set()
        return out
