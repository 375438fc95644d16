"""The ``POST /v1/chat/completions`` wire format of the example worker: a chat body is
rendered into a completion prompt (the byte tokenizer has no chat template, so a fixed
``role: content`` layout stands in for one) and answered in OpenAI's chat shape. No
sockets or threads here.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.examples.completions import CompletionBody, decode_body, response_body, validate
from kvbridge.examples.request import Request, RequestOutput


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(msgspec.Struct, kw_only=True):
    """``POST /v1/chat/completions`` (unknown OpenAI fields are ignored)."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    temperature: float = 0.0
    model: str | None = None
    stream: bool = False
    return_logits: bool = False
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    ignore_eos: bool = False
    kv_transfer_params: KVTransferParams | None = None


def render(messages: list[ChatMessage]) -> str:
    """The prompt of a conversation: one ``role: content`` line each, then the turn."""
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


def parse_chat(raw: bytes, model: str) -> CompletionBody:
    """The completion a chat body asks for (the same validation as a completion's)."""
    chat = decode_body(raw, ChatBody)
    top = chat.top_logprobs or 1 if chat.logprobs else None
    body = CompletionBody(
        prompt=render(chat.messages),
        max_tokens=chat.max_completion_tokens or chat.max_tokens or 16,
        temperature=chat.temperature,
        model=chat.model,
        stream=chat.stream,
        return_logits=chat.return_logits,
        logprobs=top,
        ignore_eos=chat.ignore_eos,
        kv_transfer_params=chat.kv_transfer_params,
    )
    return validate(body, model)


def chat_response_body(
    request: Request, body: CompletionBody, outs: list[RequestOutput], *, delta: bool = False
) -> dict:
    """The completion's answer in the chat shape (``choices[0].message`` or ``.delta``)."""
    out = response_body(request, body, outs, delta=delta)
    out.pop("text")
    choice = out.pop("choices")[0]
    text = choice.pop("text")
    key = "delta" if delta else "message"
    choice[key] = {"role": "assistant", "content": text}
    out["choices"] = [choice]
    out["object"] = "chat.completion.chunk" if delta else "chat.completion"
    return out
