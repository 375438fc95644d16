"""Scheduler-side overhead per engine step, at a steady population of live requests.

Decode: half the live requests wait for blocks (asked ``get_num_new_matched_tokens`` and
``request_waiting`` every step), half are loading; each step ``--churn`` loads finish,
as many waiting requests get blocks and as many new requests arrive. Prefill: every live
request holds its blocks (hybrid full + sliding window + state groups); each step
``--churn`` finish sending, and as many new ones finish prefill (decode's heartbeats reach the
worker, not the scheduler).
The figure is the step time (engine calls + ``build_connector_meta`` +
``update_connector_output``) divided by the live requests. Target: < 50 us/request/step.

    kvbridge bench scheduler --requests 1000 --steps 300
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.connector.common.config import KVRole, KVTransferConfig
from kvbridge.connector.common.metadata import WorkerOutput
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.scheduler.scheduler import KVBridgeScheduler
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.specs import FullAttentionSpec, SlidingWindowSpec, StateSpec

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: KVTransferParams | None


def hybrid_kv_config() -> KVCacheConfig:
    attn = dict(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float16)
    groups = [
        KVCacheGroup(group_id=0, layer_names=("l0",), spec=FullAttentionSpec(**attn)),
        KVCacheGroup(
            group_id=1, layer_names=("l1",), spec=SlidingWindowSpec(**attn, sliding_window=256)
        ),
        KVCacheGroup(
            group_id=2,
            layer_names=("l2",),
            spec=StateSpec(block_size=BLOCK_SIZE, shapes=((64,),), dtypes=(torch.float16,)),
        ),
    ]
    return KVCacheConfig.uniform(groups, num_blocks=1 << 20)


def config(role: KVRole) -> KVTransferConfig:
    return KVTransferConfig(kv_role=role, engine_id=role.value, lease_s=600.0, heartbeat_s=5.0)


def timed_steps(step: Callable[[], None], num_steps: int) -> list[float]:
    for _ in range(10):  # warm up
        step()
    out = []
    for _ in range(num_steps):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def bench_decode(num_requests: int, churn: int, prompt_len: int, num_steps: int) -> list[float]:
    sched = KVBridgeScheduler(config(KVRole.CONSUMER), hybrid_kv_config())
    ids = itertools.count()
    num_blocks = -(-prompt_len // BLOCK_SIZE)
    blocks = [list(range(g * num_blocks, (g + 1) * num_blocks)) for g in range(3)]
    prompt = list(range(prompt_len))

    def new_request() -> Req:
        rid = f"d{next(ids)}"
        params = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id="prefill",
            remote_host="127.0.0.1",
            remote_port=5600,
            remote_block_ids=[blocks[0], blocks[1][-20:], blocks[2][-8:]],
            remote_first_block=[0, num_blocks - 20, num_blocks - 8],
            remote_block_size=BLOCK_SIZE,
            num_tokens=prompt_len,
            remote_request_id=rid,
            resume_tokens=prompt_len - 1,
        )
        req = Req(rid, prompt, params)
        sched.get_num_new_matched_tokens(req, 0)
        return req

    def allocate(req: Req) -> None:
        num_external, _ = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, blocks, num_external)

    waiting = [new_request() for _ in range(num_requests // 2)]
    loading: list[Req] = []
    for req in [new_request() for _ in range(num_requests - len(waiting))]:
        allocate(req)
        loading.append(req)
    sched.build_connector_meta()

    def step() -> None:
        nonlocal waiting, loading
        for req in waiting:  # still no blocks: asked again, heartbeats rate-limited
            sched.get_num_new_matched_tokens(req, 0)
            sched.request_waiting(req)
        admitted, waiting = waiting[:churn], waiting[churn:]
        for req in admitted:
            allocate(req)
        waiting += [new_request() for _ in range(churn)]
        sched.build_connector_meta()
        done, loading = loading[:churn], loading[churn:] + admitted
        events = sched.update_connector_output(
            WorkerOutput(finished_recving=frozenset(r.request_id for r in done))
        )
        assert len(events.loaded_request_ids) == len(done)
        for req in done:
            sched.request_finished(req, blocks)

    return timed_steps(step, num_steps)


def bench_prefill(num_requests: int, churn: int, prompt_len: int, num_steps: int) -> list[float]:
    sched = KVBridgeScheduler(config(KVRole.PRODUCER), hybrid_kv_config())
    ids = itertools.count()
    num_blocks = -(-prompt_len // BLOCK_SIZE)
    blocks = [list(range(g * num_blocks, (g + 1) * num_blocks)) for g in range(3)]
    prompt = list(range(prompt_len))
    live: list[str] = []

    def finish_one() -> None:
        rid = f"p{next(ids)}"
        delay, _ = sched.request_finished(
            Req(rid, prompt, KVTransferParams(do_remote_decode=True)), blocks
        )
        assert delay
        sched.take_blocks_to_free(rid)
        live.append(rid)

    for _ in range(num_requests):
        finish_one()
    sched.build_connector_meta()

    def step() -> None:
        nonlocal live
        for _ in range(churn):
            finish_one()
        sched.build_connector_meta()
        done, live = live[:churn], live[churn:]
        events = sched.update_connector_output(WorkerOutput(finished_sending=frozenset(done)))
        for rid in events.free_request_ids:
            sched.take_blocks_to_free(rid)

    return timed_steps(step, num_steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="live requests per role")
    parser.add_argument("--churn", type=int, default=50, help="requests ending per step")
    parser.add_argument("--prompt-len", type=int, default=2000, help="tokens per prompt")
    parser.add_argument("--steps", type=int, default=300)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    print(
        f"{args.requests} live requests, churn {args.churn}/step, {args.prompt_len}-token "
        f"prompts, 3 KV-cache groups (full, sliding window, state), {args.steps} steps"
    )
    rows = []
    for name, bench in (("decode", bench_decode), ("prefill", bench_prefill)):
        times = bench(args.requests, args.churn, args.prompt_len, args.steps)
        median, p99 = statistics.median(times), sorted(times)[int(0.99 * (len(times) - 1))]
        print(
            f"{name:8s} step median {median * 1e6:8.1f} us  p99 {p99 * 1e6:8.1f} us  -> "
            f"{median * 1e6 / args.requests:6.2f} us/request/step (median), "
            f"{p99 * 1e6 / args.requests:6.2f} (p99)"
        )
        rows.append(
            {
                "role": name,
                "step_median_us": median * 1e6,
                "step_p99_us": p99 * 1e6,
                "us_per_request_step": median * 1e6 / args.requests,
            }
        )
    write_json(args.json, "bench_scheduler", rows, **vars(args) | {"json": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
