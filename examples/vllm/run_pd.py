"""Prefill + decode vLLM servers behind vllm-router, checked against a single vLLM server.

::

    CONNECTOR=nixl PREFILL_BLOCK_SIZE=32 DECODE_BLOCK_SIZE=64 bash scripts/run_vllm_pd.sh

Environment (defaults in brackets): ``CONNECTOR`` [kvbridge] or nixl; ``MODEL``
[tiny-llama], tiny-gemma3 (full + sliding-window groups) or tiny-granite-hybrid (Mamba2 +
attention; its servers run without prefix caching, see ``models.SERVER_ARGS``);
``PREFILL_BLOCK_SIZE`` / ``DECODE_BLOCK_SIZE`` [32] (multiples of 32 on CPU); ``PREFILL_TP``
/ ``DECODE_TP`` [1] (tensor-parallel sizes; the reference server runs at TP 1, one core per
rank); ``NUM_PROMPTS`` [4]; ``MAX_TOKENS`` [16]; ``PROMPT_TOKENS`` [100] (approximate prompt
length; prompts spread over ~0.6x..1.4x); ``KVBRIDGE_EXTRA`` (JSON object, kvbridge's
``kv_connector_extra_config``); ``LOGPROB_TOL`` [1e-3]; ``START_TIMEOUT_S`` [600];
``REQUEST_TIMEOUT_S`` [120]; ``FAILURE_POLICY`` [recompute] (decode's
``kv_load_failure_policy``: recompute or fail); ``ENFORCE_EAGER`` [1] (``--enforce-eager``
on every server: ~3x faster start on CPU; 0 gives vLLM's default torch.compile warm-up, 2-5
minutes here); ``LOG_DIR`` [out/vllm-pd/<run>]; ``REQUIRE_TRANSFER`` [1]: fail when decode's
metrics show no prompt token taken from the connector (decode recomputed everything).

Prints one line per prompt, ``RESULT: PASS`` or ``RESULT: FAIL`` and a ``SUMMARY`` line;
exits 0 iff PASS. Every server is torn down on the way out (also on Ctrl-C / SIGTERM).
:func:`kvbridge.examples.vllm.pd_servers.start_pd` gives the same set of servers to tests and
benchmarks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge.examples.vllm.client import (
    Comparison,
    Completion,
    RequestError,
    compare,
    complete,
    make_prompts,
)
from kvbridge.examples.vllm.models import MAX_POSITIONS, MODELS
from kvbridge.examples.vllm.pd_servers import PDServers, start_pd
from kvbridge.examples.vllm.procs import ServiceError
from kvbridge.examples.vllm.scraped_metrics import connector_names, scrape, transfer_figures
from kvbridge.examples.vllm.servers import (
    CONNECTORS,
)


@dataclass
class RunConfig:
    connector: str = "kvbridge"
    model: str = "tiny-llama"
    prefill_block_size: int = 32
    decode_block_size: int = 32
    prefill_tp: int = 1
    decode_tp: int = 1
    num_prompts: int = 4
    max_tokens: int = 16
    prompt_tokens: int = 100
    kv_extra: dict[str, Any] | None = None
    tolerance: float = 1e-3
    start_timeout_s: float = 600.0
    request_timeout_s: float = 120.0
    enforce_eager: bool = True
    require_transfer: bool = True
    failure_policy: str = "recompute"
    log_dir: Path | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RunConfig:
        env = dict(os.environ if env is None else env)

        def num(name: str, default: float, kind: type = int) -> Any:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None

        extra_raw = env.get("KVBRIDGE_EXTRA", "").strip()
        try:
            extra = json.loads(extra_raw) if extra_raw else None
        except ValueError as exc:
            raise ValueError(f"KVBRIDGE_EXTRA is not valid JSON: {exc}") from None
        if extra is not None and not isinstance(extra, dict):
            raise ValueError("KVBRIDGE_EXTRA must be a JSON object")
        cfg = cls(
            connector=env.get("CONNECTOR", "kvbridge").strip() or "kvbridge",
            model=env.get("MODEL", "tiny-llama").strip() or "tiny-llama",
            prefill_block_size=num("PREFILL_BLOCK_SIZE", 32),
            decode_block_size=num("DECODE_BLOCK_SIZE", 32),
            prefill_tp=num("PREFILL_TP", 1),
            decode_tp=num("DECODE_TP", 1),
            num_prompts=num("NUM_PROMPTS", 4),
            max_tokens=num("MAX_TOKENS", 16),
            prompt_tokens=num("PROMPT_TOKENS", 100),
            kv_extra=extra,
            tolerance=num("LOGPROB_TOL", 1e-3, float),
            start_timeout_s=num("START_TIMEOUT_S", 600.0, float),
            request_timeout_s=num("REQUEST_TIMEOUT_S", 120.0, float),
            enforce_eager=env.get("ENFORCE_EAGER", "1").strip() not in ("0", "false"),
            require_transfer=env.get("REQUIRE_TRANSFER", "1").strip() not in ("0", "false"),
            failure_policy=env.get("FAILURE_POLICY", "recompute").strip() or "recompute",
            log_dir=Path(env["LOG_DIR"]) if env.get("LOG_DIR") else None,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(f"CONNECTOR must be one of {CONNECTORS}, not {self.connector!r}")
        if self.model not in MODELS:
            raise ValueError(f"MODEL must be one of {tuple(MODELS)}, not {self.model!r}")
        for name in ("prefill_block_size", "decode_block_size"):
            value = getattr(self, name)
            if value <= 0 or value % 32:
                raise ValueError(f"{name.upper()}={value}: vLLM on CPU needs a multiple of 32")
        for name in ("prefill_tp", "decode_tp"):
            if getattr(self, name) not in (1, 2, 4):
                raise ValueError(f"{name.upper()}={getattr(self, name)} must be 1, 2 or 4")
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"FAILURE_POLICY must be recompute or fail, not {self.failure_policy!r}"
            )
        if self.num_prompts < 1 or self.max_tokens < 1 or self.prompt_tokens < 2:
            raise ValueError("NUM_PROMPTS, MAX_TOKENS >= 1 and PROMPT_TOKENS >= 2 are required")
        longest = int(self.prompt_tokens * 1.4) + 4 + self.max_tokens
        if longest > MAX_POSITIONS:
            raise ValueError(f"PROMPT_TOKENS={self.prompt_tokens} is too long for the model")


@dataclass
class PromptOutcome:
    index: int
    length: int
    comparison: Comparison | None = None
    error: str | None = None
    reference_s: float = 0.0
    pd_s: float = 0.0

    def ok(self, tolerance: float) -> bool:
        return (
            self.error is None and self.comparison is not None and (self.comparison.ok(tolerance))
        )

    def line(self, total: int, tolerance: float) -> str:
        head = f"prompt {self.index + 1}/{total} len={self.length}:"
        if self.error is not None:
            return f"{head} ERROR {self.error}"
        c = self.comparison
        assert c is not None
        verdict = "ok" if self.ok(tolerance) else "MISMATCH"
        text = (
            f"{head} tokens {c.tokens_equal}/{c.total} equal, "
            f"max|dlogprob|={c.max_logprob_diff:.2e} "
            f"(ref {self.reference_s:.2f} s, pd {self.pd_s:.2f} s) {verdict}"
        )
        if c.first_mismatch is not None:
            pos, ref, got = c.first_mismatch
            text += f" first difference at {pos}: reference {ref}, P/D {got}"
        return text


def run_prompts(pd: PDServers, cfg: RunConfig, prompts: list[list[int]]) -> list[PromptOutcome]:
    """Reference first, then through the router; stops sending once a server died."""
    assert pd.reference is not None
    outcomes = [PromptOutcome(i, len(p)) for i, p in enumerate(prompts)]
    refs: list[Completion | None] = []
    for outcome, prompt in zip(outcomes, prompts, strict=True):
        try:
            ref = complete(
                pd.reference.url,
                pd.model_name,
                prompt,
                max_tokens=cfg.max_tokens,
                timeout_s=cfg.request_timeout_s,
            )
            outcome.reference_s = ref.seconds
            refs.append(ref)
        except RequestError as exc:
            outcome.error = f"reference server: {exc}"
            refs.append(None)
    for outcome, prompt, ref in zip(outcomes, prompts, refs, strict=True):
        if ref is None:
            continue
        dead = pd.dead()
        if dead:
            outcome.error = f"not sent: {', '.join(dead)} exited"
            continue
        try:
            got = complete(
                pd.router_url,
                pd.model_name,
                prompt,
                max_tokens=cfg.max_tokens,
                timeout_s=cfg.request_timeout_s,
            )
        except RequestError as exc:
            outcome.error = f"P/D via vllm-router: {exc}"
            continue
        outcome.pd_s = got.seconds
        outcome.comparison = compare(ref, got)
    return outcomes


def warm_tp_servers(pd: PDServers, cfg: RunConfig) -> None:
    """One local request to each server with TP > 1 before the checked prompts.

    vLLM's first forward pass at TP > 1 compiles its masked vocabulary embedding
    (``torch.compile`` and a C++ build, even with ``--enforce-eager``): one rank builds for
    tens of seconds while the other waits in all_reduce, and neither calls the connector,
    so a load in flight meanwhile times out (measured on 2 cores: 30-35 s).
    """
    for svc, tp in ((pd.prefill, cfg.prefill_tp), (pd.decode, cfg.decode_tp)):
        if tp <= 1:
            continue
        t0 = time.monotonic()
        try:
            complete(
                svc.url,
                pd.model_name,
                make_prompts(1, 32, seed=77)[0],
                max_tokens=2,
                timeout_s=max(cfg.request_timeout_s, 300.0),
            )
        except RequestError as exc:
            print(f"  warm-up of {svc.name} (TP {tp}) failed: {exc}", flush=True)
            continue
        print(f"  {svc.name} (TP {tp}) warmed up in {time.monotonic() - t0:.1f} s", flush=True)


def wait_for_metrics(
    url: str, before: dict[str, float], connector: str, expect: int, timeout_s: float = 10.0
) -> dict[str, float]:
    """Scrape decode's /metrics until it counts ``expect`` new transfers (stats reach the
    API server asynchronously) or ``timeout_s`` passes; the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(url)
        fig = transfer_figures(before, after, connector)
        if fig.transfers is None or fig.transfers >= expect or time.monotonic() >= deadline:
            return after
        time.sleep(0.25)


def run(cfg: RunConfig) -> int:
    """The whole check; returns the exit code (0 iff PASS)."""
    print(
        f"vLLM P/D check: CONNECTOR={cfg.connector} MODEL={cfg.model} "
        f"blocks {cfg.prefill_block_size}->{cfg.decode_block_size} "
        f"tp {cfg.prefill_tp}->{cfg.decode_tp} "
        f"prompts={cfg.num_prompts} (~{cfg.prompt_tokens} tokens) max_tokens={cfg.max_tokens}",
        flush=True,
    )
    prompts = make_prompts(cfg.num_prompts, cfg.prompt_tokens)
    t0 = time.monotonic()
    pd: PDServers | None = None
    try:
        try:
            pd = start_pd(
                connector=cfg.connector,
                model=cfg.model,
                prefill_block_size=cfg.prefill_block_size,
                decode_block_size=cfg.decode_block_size,
                prefill_tp=cfg.prefill_tp,
                decode_tp=cfg.decode_tp,
                kv_extra=cfg.kv_extra,
                failure_policy=cfg.failure_policy,
                enforce_eager=cfg.enforce_eager,
                start_timeout_s=cfg.start_timeout_s,
                router_timeout_s=cfg.request_timeout_s,
                log_dir=cfg.log_dir,
            )
        except ServiceError as exc:
            print(f"error: a server did not start: {exc}", flush=True)
            print("RESULT: FAIL")
            print(
                f"SUMMARY prompts_matched=0/{cfg.num_prompts} bytes_moved=n/a transfer_ms=n/a "
                f"start_s={time.monotonic() - t0:.1f} error=start"
            )
            return 1
        print(f"all servers healthy after {pd.start_s:.1f} s", flush=True)
        # TP > 1 only, and not for the handover: vLLM's own first forward at TP > 1
        # compiles (see warm_tp_servers). TP 1 servers get no warm-up: the first P/D
        # prompt is the servers' first request, as for a user (docs/handover.md)
        warm_tp_servers(pd, cfg)
        before = scrape(pd.decode_url)
        t_run = time.monotonic()
        outcomes = run_prompts(pd, cfg, prompts)
        run_s = time.monotonic() - t_run
        sent_ok = sum(1 for o in outcomes if o.comparison is not None)
        after = wait_for_metrics(pd.decode_url, before, cfg.connector, sent_ok)
        figures = transfer_figures(before, after, cfg.connector)
        for outcome in outcomes:
            print(outcome.line(len(prompts), cfg.tolerance), flush=True)
        matched = sum(o.ok(cfg.tolerance) for o in outcomes)
        passed = matched == len(prompts)
        names = connector_names(after)
        print(f"decode /metrics connector samples: {', '.join(names) or 'none'}")
        if passed and cfg.require_transfer and not figures.external_tokens:
            passed = False
            print(
                "transfer check: decode's metrics show no prompt token taken from the "
                "connector (it recomputed the prompts): failing"
            )
        if any(o.error for o in outcomes):
            for svc in (pd.prefill, pd.decode):
                for line in svc.error_lines():
                    print(f"{svc.name} log: {line[:300]}")
        dead = pd.dead()
        if dead:
            print(f"servers that exited during the run: {', '.join(dead)} (logs in {pd.log_dir})")
        max_diff = max(
            (o.comparison.max_logprob_diff for o in outcomes if o.comparison), default=0.0
        )
        print(f"RESULT: {'PASS' if passed else 'FAIL'}")
        print(
            f"SUMMARY prompts_matched={matched}/{len(prompts)} {figures.fmt()} "
            f"{_loads(before, after, cfg.connector)} "
            f"max_logprob_diff={max_diff:.2e} start_s={pd.start_s:.1f} run_s={run_s:.1f} "
            f"connector={cfg.connector} model={cfg.model} "
            f"blocks={cfg.prefill_block_size}->{cfg.decode_block_size}",
            f"tp={cfg.prefill_tp}->{cfg.decode_tp}",
            flush=True,
        )
        return 0 if passed else 1
    finally:
        if pd is not None:
            with _signals_ignored():
                t_stop = time.monotonic()
                pd.close()
                print(
                    f"servers stopped in {time.monotonic() - t_stop:.1f} s "
                    f"(total {time.monotonic() - t0:.1f} s)",
                    flush=True,
                )


def _loads(before: dict[str, float], after: dict[str, float], connector: str) -> str:
    """``loads_loaded=.. loads_recomputed=.. loads_failed=..`` from kvbridge's decode
    counters (summed over ranks); NixlConnector exports no such counters (``n/a``)."""
    parts = []
    for kind in ("loaded", "recomputed", "failed"):
        name = f"vllm:kvbridge_loads_{kind}_total"
        if connector != "kvbridge" or name not in after:
            parts.append(f"loads_{kind}=n/a")
        else:
            parts.append(f"loads_{kind}={after[name] - before.get(name, 0.0):.0f}")
    return " ".join(parts)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Let teardown finish even if Ctrl-C is pressed again (it is bounded by timeouts)."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum: int, _frame: object) -> None:
    print(f"received {signal.Signals(signum).name}: stopping the servers", file=sys.stderr)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    if argv:
        print(
            "run_pd takes no arguments; configure it with environment variables:", file=sys.stderr
        )
        print(__doc__, file=sys.stderr)
        return 2
    try:
        cfg = RunConfig.from_env()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C raises KeyboardInterrupt even when SIGINT came in ignored (background jobs)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    try:
        return run(cfg)
    except KeyboardInterrupt:
        print("interrupted: servers were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
