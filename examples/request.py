"""A completion request as the example engine sees it: what to sample, how it ends, what
one step reports, and the request's own progress through its prompt and output.

::

    WAITING --admit--> RUNNING --last token--> FINISHED (STOP, LENGTH)
       |                  ^
       |                  | loaded (or recompute after a failed load)
       +--remote KV--> WAITING_FOR_REMOTE_KV
    any state --abort, bad params, failed load--> FINISHED (ABORT, ERROR)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.examples.tokenizer import EOS_ID
from kvbridge.layouts.errors import KVBridgeError


class EngineError(KVBridgeError, ValueError):
    """A request the engine cannot serve (names the field and the limit)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # sampled the end-of-sequence token
    LENGTH = "length"  # reached max_tokens
    ABORT = "abort"  # the client went away or the server dropped it
    ERROR = "error"  # unusable params or a failed load (``RequestOutput.error`` says why)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Greedy decoding only; what to stop on and what to report."""

    max_tokens: int = 16
    eos_id: int | None = EOS_ID
    return_logits: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise EngineError(f"max_tokens={self.max_tokens} must be at least 1")


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one step produced for one request (tokens since the previous output)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logits: tuple[np.ndarray, ...]  # one [vocab] row per new token, if asked for
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    invalid_request: bool = False  # the error is the client's (bad params)
    kv_transfer_params: KVTransferParams | None = None  # prefill: for the remote decode
    num_cached_tokens: int = 0  # prompt tokens served by the local prefix cache
    num_loaded_tokens: int = 0  # prompt tokens loaded through the connector


class Request:
    """One completion request; implements
    :class:`kvbridge.connector.common.api.ConnectorRequest`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = tuple(int(t) for t in prompt_token_ids)
        self.sampling = sampling or SamplingParams()
        self.kv_transfer_params = kv_transfer_params
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.block_ids: list[list[int]] | None = None  # per group, logical block order
        self.resume_block: int | None = None  # prefill: state where its decode resumes
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # local prefix hit
        self.num_external_tokens = 0  # promised by the connector
        self.num_loaded_tokens = 0
        self.num_registered_blocks = 0  # leading blocks named in the prefix cache
        self.matched = False  # get_num_new_matched_tokens was asked
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.invalid_request = False
        self.out_params: KVTransferParams | None = None
        self._new_tokens: list[int] = []
        self._new_logits: list[np.ndarray] = []

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Tokens whose KV may ever be cached (the last sampled token never is)."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens - 1

    def append_output(self, token: int, logits: np.ndarray | None) -> None:
        self.output_token_ids.append(token)
        self._new_tokens.append(token)
        if logits is not None:
            self._new_logits.append(logits)

    def take_output(self) -> RequestOutput:
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=tuple(self._new_tokens),
            new_logits=tuple(self._new_logits),
            finished=self.status is RequestStatus.FINISHED,
            finish_reason=self.finish_reason,
            error=self.error,
            invalid_request=self.invalid_request,
            kv_transfer_params=self.out_params,
            num_cached_tokens=self.num_cached_tokens,
            num_loaded_tokens=self.num_loaded_tokens,
        )
        self._new_tokens, self._new_logits = [], []
        return out

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={len(self.prompt_token_ids)}"
            f", out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
