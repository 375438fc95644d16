"""Completions client, deterministic prompts, and the greedy-output comparison.

Requests use vLLM 0.32's completions API with token-id prompts, ``temperature=0``,
``logprobs=1``, ``ignore_eos`` (every answer has ``max_tokens`` tokens) and
``return_token_ids`` (the answer's ``choices[0].token_ids`` are the generated ids;
``choices[0].logprobs.token_logprobs`` their log-probabilities; ``logprobs=None`` in
``extra`` asks for none, and ``Completion.logprobs`` is then empty).
"""

from __future__ import annotations

import http.client
import json
import random
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvbridge.examples.vllm.models import BOS_ID, VOCAB_SIZE

FIRST_PLAIN_TOKEN = 4  # ids 0..3 are <unk> <s> </s> <pad>


def make_prompts(count: int, approx_tokens: int, seed: int = 0) -> list[list[int]]:
    """``count`` token-id prompts (``<s>`` then random ordinary tokens), lengths spread
    over roughly 0.6x .. 1.4x ``approx_tokens`` (at least 2), the same for a given seed."""
    if count < 0 or approx_tokens < 1:
        raise ValueError("need count >= 0 and approx_tokens >= 1")
    prompts = []
    for i in range(count):
        rng = random.Random(f"kvbridge-prompt-{seed}-{i}")
        frac = 0.6 + 0.8 * (i / max(count - 1, 1))  # spread evenly, then jitter a little
        length = max(2, round(approx_tokens * frac) + rng.randint(-3, 3))
        body = [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB_SIZE) for _ in range(length - 1)]
        prompts.append([BOS_ID, *body])
    return prompts


class RequestError(RuntimeError):
    """A completion request failed: ``status`` is the HTTP status, 0 if none came."""

    def __init__(self, url: str, status: int, reason: str) -> None:
        where = f"HTTP {status}" if status else "no answer"
        super().__init__(f"{url}: {where}: {reason}")
        self.status = status
        self.reason = reason


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    seconds: float
    kv_transfer_params: dict | None = None


def complete(
    url: str,
    model: str,
    prompt: list[int],
    *,
    max_tokens: int,
    timeout_s: float,
    extra: dict | None = None,
) -> Completion:
    """One greedy completion from the server (or router) at ``url``."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_token_ids": True,
        **(extra or {}),
    }
    parts = urlsplit(url)
    assert parts.hostname and parts.port, url
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    start = time.monotonic()
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        raw = resp.read()
    except TimeoutError:
        raise RequestError(url, 0, f"no answer within {timeout_s:.0f} s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise RequestError(url, 0, f"{type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    seconds = time.monotonic() - start
    if resp.status != 200:
        raise RequestError(url, resp.status, _error_text(raw))
    try:
        answer = json.loads(raw)
        choice = answer["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        asked = choice.get("logprobs")  # None: the request set "logprobs": None
        logprobs = [float(x) for x in asked["token_logprobs"]] if asked is not None else []
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RequestError(
            url, resp.status, f"unexpected answer ({exc!r}): {raw[:300]!r}"
        ) from None
    return Completion(
        token_ids, logprobs, choice.get("text", ""), seconds, answer.get("kv_transfer_params")
    )


def _error_text(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:500].decode(errors="replace")
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(data)[:500]


@dataclass
class Comparison:
    """Greedy tokens and logprobs of one prompt, reference vs disaggregated."""

    tokens_equal: int  # leading tokens that agree
    total: int
    max_logprob_diff: float  # over the agreeing prefix
    first_mismatch: tuple[int, int, int] | None  # (position, reference id, P/D id)

    def ok(self, tolerance: float) -> bool:
        return self.first_mismatch is None and self.max_logprob_diff <= tolerance


def compare(reference: Completion, got: Completion) -> Comparison:
    total = max(len(reference.token_ids), len(got.token_ids))
    equal = 0
    for a, b in zip(reference.token_ids, got.token_ids, strict=False):
        if a != b:
            break
        equal += 1
    mismatch = None
    if equal < total:
        ref = reference.token_ids[equal] if equal < len(reference.token_ids) else -1
        pd = got.token_ids[equal] if equal < len(got.token_ids) else -1
        mismatch = (equal, ref, pd)
    diffs = [
        abs(a - b) for a, b in zip(reference.logprobs[:equal], got.logprobs[:equal], strict=False)
    ]
    return Comparison(equal, total, max(diffs, default=0.0), mismatch)
