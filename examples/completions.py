"""The ``POST /v1/completions`` wire format of the example worker: the body it accepts
(validated at the edge into a typed struct), the engine request made from it, and the
JSON it answers, whole or as one streamed chunk. No sockets or threads here.
"""

from __future__ import annotations

import uuid
from typing import Annotated, TypeVar

import msgspec
import numpy as np
import torch

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.examples.request import Request, RequestOutput, SamplingParams
from kvbridge.examples.tokenizer import ByteTokenizer
from kvbridge.layouts.errors import KVBridgeError


class CompletionBody(msgspec.Struct, kw_only=True):
    """``POST /v1/completions`` (unknown OpenAI fields are ignored)."""

    prompt: str | Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    temperature: float = 0.0
    model: str | None = None
    stream: bool = False
    return_logits: bool = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    ignore_eos: bool = False
    kv_transfer_params: KVTransferParams | None = None


T = TypeVar("T")


class HTTPFailure(KVBridgeError):
    """A request that ends in an HTTP error: the status and the reason to send."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status


def decode_body(raw: bytes, type_: type[T]) -> T:
    """``raw`` JSON as ``type_``; ``kv_transfer_params`` keys set to ``null`` mean "not set"
    (vllm-router sends ``"remote_engine_id": null`` and the like to prefill)."""
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError for invalid UTF-8 inside a JSON string
        raise HTTPFailure(f"body is not valid JSON: {exc}") from None
    if isinstance(obj, dict) and isinstance(obj.get("kv_transfer_params"), dict):
        params = obj["kv_transfer_params"]
        obj["kv_transfer_params"] = {k: v for k, v in params.items() if v is not None}
    try:
        return msgspec.convert(obj, type=type_)
    except msgspec.ValidationError as exc:
        raise HTTPFailure(f"invalid request: {exc}") from None


def parse_body(raw: bytes, model: str) -> CompletionBody:
    body = decode_body(raw, CompletionBody)
    return validate(body, model)


def validate(body: CompletionBody, model: str) -> CompletionBody:
    """``body`` if this worker can serve it (greedy, its model, a prompt)."""
    if body.temperature != 0:
        raise HTTPFailure(f"temperature={body.temperature}: only greedy decoding (0) is served")
    if body.model not in (None, model):
        raise HTTPFailure(f"model {body.model!r} is not served here; this worker serves {model!r}")
    if isinstance(body.prompt, str) and not body.prompt:
        raise HTTPFailure("prompt is empty")
    return body


def to_request(body: CompletionBody) -> Request:
    """The engine's request for a parsed body, under a fresh id."""
    prompt = body.prompt
    ids = ByteTokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
    eos = None if body.ignore_eos else ByteTokenizer.eos_id
    wants_logits = body.return_logits or bool(body.logprobs)
    sampling = SamplingParams(max_tokens=body.max_tokens, eos_id=eos, return_logits=wants_logits)
    rid = f"cmpl-{uuid.uuid4().hex[:16]}"
    return Request(rid, ids, sampling, body.kv_transfer_params)


def response_body(
    request: Request, body: CompletionBody, outs: list[RequestOutput], *, delta: bool = False
) -> dict:
    """The JSON answer (or one streamed chunk, ``delta=True``) of a completion."""
    tokens = [t for o in outs for t in o.new_token_ids]
    rows = [r for o in outs for r in o.new_logits]
    last = outs[-1]
    text = ByteTokenizer().decode(tokens)
    finish = last.finish_reason.value if last.finish_reason else None
    out: dict = {
        "id": request.request_id,
        "object": "text_completion.chunk" if delta else "text_completion",
        "model": body.model,
        # OpenAI's shape for its clients; the flat fields below for kvbridge's checks
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        "text": text,
        "token_ids": tokens,
        "finish_reason": finish,
    }
    if body.return_logits:
        out["logits"] = [r.tolist() for r in rows]
    if body.logprobs:
        out["logprobs"] = [top_logprobs(r, body.logprobs) for r in rows]
    if last.finished:
        params = last.kv_transfer_params
        out["kv_transfer_params"] = params.to_dict() if params is not None else None
        out["usage"] = {
            "prompt_tokens": len(request.prompt_token_ids),
            "completion_tokens": len(request.output_token_ids),
            "cached_tokens": last.num_cached_tokens,
            "loaded_tokens": last.num_loaded_tokens,
        }
    return out


def top_logprobs(logits: np.ndarray, k: int) -> list[list[float]]:
    """``[[token_id, logprob], ...]`` of the ``k`` most likely tokens, best first."""
    lp = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    values, ids = lp.topk(k)
    return [[int(i), float(v)] for i, v in zip(ids, values, strict=True)]
