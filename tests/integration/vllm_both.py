"""Small sets of kv_both vLLM servers (tiny-llama, block 32, pull, every load verified) for
the modules that each serve one vLLM configuration: fp8 caches, speculative decoding,
data parallelism. Each module starts its own set once (:func:`serving`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from kvbridge.examples.vllm.client import Completion, complete
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import Service, start_all, stop_all
from kvbridge.examples.vllm.servers import ServerSpec, vllm_service
from tests.verified_loads import verifying

MODEL = "tiny-llama"
BLOCK = 32
MAX_TOKENS = 8
TIMEOUT_S = 120.0
START_TIMEOUT_S = 900.0


def spec(name: str, model: str = MODEL, **fields: object) -> ServerSpec:
    """A kv_both server of ``model`` (a name :func:`ensure_model` builds); ``fields``
    override :class:`ServerSpec`'s."""
    return ServerSpec(
        name,
        ensure_model(model),
        **{
            "block_size": BLOCK,
            "connector": "kvbridge",
            "role": "both",
            "kv_extra": verifying({"lease_s": 30, "heartbeat_s": 3}),
            "failure_policy": "recompute",
            "max_model_len": 2048,
            "enforce_eager": True,
            **fields,
        },  # type: ignore[arg-type]
    )


@contextlib.contextmanager
def serving(specs: list[ServerSpec], logs: Path) -> Iterator[dict[str, Service]]:
    """The servers of ``specs``, started together, by name; stopped on exit."""
    services = {s.name: vllm_service(s, logs, slot=i) for i, s in enumerate(specs)}
    try:
        start_all(list(services.values()), timeout_s=START_TIMEOUT_S)
        yield services
    finally:
        stop_all(list(services.values()))


def run(
    server: Service,
    prompt: list[int],
    max_tokens: int = MAX_TOKENS,
    *,
    model: str = MODEL,
    **extra: object,
) -> Completion:
    """One greedy completion of ``model`` (as :func:`spec` served it) on ``server``."""
    return complete(
        server.url, model, prompt, max_tokens=max_tokens, timeout_s=TIMEOUT_S, extra=extra
    )


def prefilled(server: Service, prompt: list[int], *, model: str = MODEL) -> dict:
    """Prefill ``prompt`` on ``server``, kept for a decode: the params it answers."""
    first = run(
        server, prompt, max_tokens=1, model=model, kv_transfer_params={"do_remote_decode": True}
    )
    assert first.kv_transfer_params and first.kv_transfer_params["do_remote_prefill"]
    return first.kv_transfer_params
