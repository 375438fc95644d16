"""The two objects an engine plugs in, as Protocols (the implementations live in
``scheduler.py`` and ``worker.py``).

An engine step looks like::

    sched.get_num_new_matched_tokens(req, n_local)   # new request: how much can be loaded?
    sched.update_state_after_alloc(req, blocks, n)   # blocks allocated for it
    meta = sched.build_connector_meta()              # per-step work for the workers
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()                           # post reads (non-blocking)
    ... forward pass ...
    worker.wait_for_save()                           # finished requests: keep blocks
    out = worker.get_finished()                      # done sends / loads, failures
    events = sched.update_connector_output(out)      # engine frees / resumes / fails
    sched.request_finished(req, blocks)              # -> (delay_free, params)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvbridge.connector.common.metadata import ConnectorMetadata, LoadFailure, WorkerOutput
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.layouts.allocation import KVCacheBuffers


class ConnectorRequest(Protocol):
    """What the connector reads from an engine's request."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def kv_transfer_params(self) -> KVTransferParams | None: ...


@dataclass(frozen=True, kw_only=True)
class SchedulerEvents:
    """What the engine must do after a step's worker output."""

    free_request_ids: frozenset[str] = frozenset()  # prefill: free these requests' blocks now
    loaded_request_ids: frozenset[str] = frozenset()  # decode: KV is in place, may run
    recompute: tuple[LoadFailure, ...] = ()  # decode: resume from num_valid_tokens
    failed: tuple[LoadFailure, ...] = ()  # decode: end these requests with the reason


class SchedulerConnector(Protocol):
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the connector can load, and whether the
        load is asynchronous (the request waits for it). Raises ParamsError on bad params."""
        ...

    def update_state_after_alloc(
        self,
        request: ConnectorRequest,
        block_ids_per_group: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """Blocks were allocated for a request; schedule its load (or its release)."""
        ...

    def build_connector_meta(self) -> ConnectorMetadata:
        """The step's work for the worker side; resets the per-step state."""
        ...

    def request_finished(
        self, request: ConnectorRequest, block_ids_per_group: Sequence[Sequence[int]]
    ) -> tuple[bool, KVTransferParams | None]:
        """A request ends. Returns (delay_free, params for the remote decode)."""
        ...

    def update_connector_output(self, output: WorkerOutput) -> SchedulerEvents:
        """Fold the workers' report into request states; says what the engine must do."""
        ...

    def request_aborted(self, request_id: str) -> None:
        """The engine dropped a request (client gone, error): release what it holds."""
        ...


class WorkerConnector(Protocol):
    def register_kv_caches(self, buffers: KVCacheBuffers) -> None: ...

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self) -> WorkerOutput: ...

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the worker cannot serve as configured (a background thread died), or None;
        a server's health endpoint says so."""
        ...

    def shutdown(self) -> None: ...
