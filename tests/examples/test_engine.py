"""The example engine (role "both", no connector) against the single-process reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.common.metadata import ConnectorMetadata, LoadFailure, WorkerOutput
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.scheduler.scheduler import KVBridgeScheduler
from kvbridge.examples.engine import Engine, EngineConfig
from kvbridge.examples.model import MODEL_NAMES
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.request import (
    EngineError,
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
)
from kvbridge.examples.runner import ModelRunner, RunnerConfig
from kvbridge.examples.tokenizer import ByteTokenizer
from kvbridge.layouts.layout import KVLayout, KVPacking

ATOL = 1e-4
TEXT = (
    "Prefill computes the prompt; decode continues from its KV cache. "
    "Blocks move between workers of different shapes. "
)
FORMATS = [
    dict(block_size=16, kernel_block_size=16, layout=KVLayout.NHD, cross_layer=False),
    dict(block_size=16, kernel_block_size=8, layout=KVLayout.HND, cross_layer=True),
    dict(
        block_size=64,
        kernel_block_size=16,
        layout=KVLayout.HND,
        cross_layer=False,
        packing=KVPacking.KV_SPLIT,
    ),
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompt(n: int, shift: int = 0) -> list[int]:
    return ByteTokenizer().encode((TEXT * 4)[shift:])[:n]


def make_engine(model: str, *, num_blocks: int = 128, **kwargs) -> Engine:
    fmt = {k: kwargs.pop(k) for k in list(kwargs) if k in RunnerConfig.__dataclass_fields__}
    runner = ModelRunner(RunnerConfig(model=model, num_blocks=num_blocks, **fmt))
    return Engine(runner, EngineConfig(**kwargs))


def run(engine: Engine, requests: list[Request]) -> dict[str, list[RequestOutput]]:
    for req in requests:
        engine.add_request(req)
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for _ in range(10_000):
        if not engine.has_unfinished:
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert not engine.has_unfinished
    return outputs


def tokens_and_logits(outs: list[RequestOutput]) -> tuple[list[int], np.ndarray]:
    assert outs[-1].finished and sum(o.finished for o in outs) == 1
    toks = [t for o in outs for t in o.new_token_ids]
    return toks, np.stack([row for o in outs for row in o.new_logits])


def assert_matches_reference(model: str, req: Request, outs: list[RequestOutput]) -> None:
    want = reference_generate(load_model(model), req.prompt_token_ids, req.sampling.max_tokens)
    toks, logits = tokens_and_logits(outs)
    assert toks == want.token_ids
    diff = float(np.abs(logits - want.logits).max())
    assert diff < ATOL, f"{req.request_id}: logits differ by {diff}"


@pytest.mark.parametrize("fmt", FORMATS, ids=["16-NHD", "16k8-HND-cross", "64k16-HND-split"])
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_batched_engine_matches_reference(model, fmt):
    # A small token budget chunks the prompts at odd offsets (the state group's scratch
    # slot carries the running state across them).
    engine = make_engine(model, max_num_batched_tokens=40, **fmt)
    sampling = SamplingParams(max_tokens=10, return_logits=True)
    reqs = [
        Request(f"r{i}", prompt(n, shift=i * 7), sampling) for i, n in enumerate((23, 64, 97, 130))
    ]
    outs = run(engine, reqs)
    for req in reqs:
        assert_matches_reference(model, req, outs[req.request_id])
    engine.pool.assert_all_free()


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_prefix_cache_reuse_gives_identical_output(model):
    engine = make_engine(model, block_size=16, kernel_block_size=8, layout=KVLayout.HND)
    sampling = SamplingParams(max_tokens=8, return_logits=True)
    first = Request("first", prompt(120), sampling)
    run(engine, [first])
    again = Request("again", prompt(120), sampling)  # whole prompt cached: hit len-1, aligned
    longer = Request("longer", prompt(150), sampling)  # shares 7 full blocks
    other = Request("other", prompt(90, shift=5), sampling)  # shares nothing
    for req in (again, longer, other):
        outs = run(engine, [req])
        assert_matches_reference(model, req, outs[req.request_id])
        cached = outs[req.request_id][-1].num_cached_tokens
        want = {"again": 112, "longer": 112, "other": 0}[req.request_id]
        assert cached == want, f"{req.request_id}: {cached} cached tokens, expected {want}"
    engine.pool.assert_all_free()


def test_generated_tokens_are_cached_too():
    engine = make_engine("tiny-hybrid-state", block_size=16)
    out = run(engine, [Request("b", prompt(40), SamplingParams(max_tokens=30))])["b"]
    generated = [t for o in out for t in o.new_token_ids]
    follow = Request("c", prompt(40) + generated, SamplingParams(max_tokens=4, return_logits=True))
    out_c = run(engine, [follow])["c"]
    assert out_c[-1].num_cached_tokens == 64  # 69 computed before: 4 full blocks
    assert_matches_reference("tiny-hybrid-state", follow, out_c)


def test_small_pool_queues_requests_and_frees_every_block():
    # 6 blocks per request (2 groups x 3 blocks of 16 tokens); 14 blocks fit two at a time.
    engine = make_engine("tiny-hybrid", num_blocks=14, block_size=16)
    sampling = SamplingParams(max_tokens=6, return_logits=True)
    reqs = [Request(f"r{i}", prompt(40, shift=i), sampling) for i in range(5)]
    outs = run(engine, reqs)
    for req in reqs:
        assert_matches_reference("tiny-hybrid", req, outs[req.request_id])
    engine.pool.assert_all_free()


def test_stop_token_ends_the_request():
    want = reference_generate(load_model("tiny-hybrid"), prompt(50), 5).token_ids
    engine = make_engine("tiny-hybrid")
    req = Request("s", prompt(50), SamplingParams(max_tokens=5, eos_id=want[2]))
    out = run(engine, [req])["s"]
    assert [t for o in out for t in o.new_token_ids] == want[:3]
    assert out[-1].finish_reason is FinishReason.STOP


def test_abort_frees_blocks_and_reports():
    engine = make_engine("tiny-hybrid-state")
    req = Request("x", prompt(60), SamplingParams(max_tokens=50))
    engine.add_request(req)
    engine.step()
    engine.step()
    assert engine.pool.num_used > 0
    engine.abort_request("x", "client went away")
    (out,) = engine.step()
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert out.error == "client went away"
    engine.pool.assert_all_free()


def test_bad_requests_raise_engine_errors():
    engine = make_engine("tiny-hybrid", num_blocks=8, block_size=16)
    with pytest.raises(EngineError, match="empty"):
        engine.add_request(Request("a", []))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.add_request(Request("b", [1, 2, 999]))
    with pytest.raises(EngineError, match="needs 10 blocks"):
        engine.add_request(Request("c", prompt(70), SamplingParams(max_tokens=10)))
    with pytest.raises(EngineError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    engine.add_request(Request("d", prompt(10)))
    with pytest.raises(EngineError, match="already in use"):
        engine.add_request(Request("d", prompt(10)))
    assert not engine.pool.num_used


# -- the connector calls, with the real scheduler side and a stub worker side ----------------


class StubWorker:
    """Worker side without NIXL: every posted load fails (or every hold ends) at once."""

    unhealthy_reason: str | None = None

    def __init__(self) -> None:
        self.meta = ConnectorMetadata()
        self.loads: list = []
        self.sends: list[str] = []
        self.release_sends = False

    def register_kv_caches(self, buffers) -> None: ...

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self.meta = metadata

    def start_load_kv(self) -> None:
        self.loads += self.meta.reqs_to_load
        self.sends += [s.request_id for s in self.meta.reqs_to_send]

    def wait_for_save(self) -> None: ...

    def get_finished(self) -> WorkerOutput:
        failed = tuple(
            LoadFailure(
                request_id=s.request_id,
                reason="stub: peer went away",
                invalid_block_ids=s.local_block_ids,
                num_valid_tokens=s.start_token,
            )
            for s in self.loads
        )
        done = frozenset(self.sends) if self.release_sends else frozenset()
        self.loads = []
        if self.release_sends:
            self.sends = []
        return WorkerOutput(failed_loads=failed, finished_sending=done)

    def shutdown(self) -> None: ...


def connected_engine(model: str, role: str, **config) -> tuple[Engine, StubWorker]:
    runner = ModelRunner(RunnerConfig(model=model, block_size=16, num_blocks=128))
    kv_config = KVTransferConfig.from_dict({"kv_role": role, "engine_id": role, **config})
    scheduler = KVBridgeScheduler(kv_config, runner.kv_config)
    worker = StubWorker()
    engine = Engine(
        runner,
        scheduler=scheduler,
        worker=worker,
        exclusive_blocks=kv_config.is_producer,
    )
    return engine, worker


def remote_params(n_tokens: int, num_groups: int) -> KVTransferParams:
    blocks = list(range(-(-n_tokens // 16)))
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="prefill",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_block_ids=[blocks] * num_groups,
        remote_block_size=16,
        num_tokens=n_tokens,
        remote_request_id="remote-1",
        resume_tokens=n_tokens - 1,
    )


@pytest.mark.parametrize("model", ["tiny-hybrid", "tiny-hybrid-state"])
def test_decode_recomputes_a_failed_load_and_still_matches(model):
    engine, _ = connected_engine(model, "kv_consumer")
    ids = prompt(90)
    params = remote_params(len(ids), len(engine.group_specs))
    req = Request("d", ids, SamplingParams(max_tokens=6, return_logits=True), params)
    out = run(engine, [req])["d"]
    assert out[-1].num_loaded_tokens == 0
    assert_matches_reference(model, req, out)
    engine.pool.assert_all_free()


def test_decode_with_fail_policy_reports_the_failed_load():
    engine, _ = connected_engine("tiny-hybrid", "kv_consumer", failure_policy="fail")
    ids = prompt(60)
    req = Request("d", ids, SamplingParams(max_tokens=4), remote_params(len(ids), 2))
    (out,) = run(engine, [req])["d"]
    assert out.finish_reason is FinishReason.ERROR and not out.invalid_request
    assert "KV load failed: stub: peer went away" in out.error
    engine.pool.assert_all_free()


def test_params_for_the_other_role_are_the_clients_error():
    engine, _ = connected_engine("tiny-hybrid", "kv_consumer")
    params = KVTransferParams(do_remote_decode=True)
    (out,) = run(engine, [Request("x", prompt(30), kv_transfer_params=params)])["x"]
    assert out.finish_reason is FinishReason.ERROR and out.invalid_request
    assert "kv_producer" in out.error
    bad = remote_params(30, 1)  # one block list for a two-group model
    (out,) = run(engine, [Request("y", prompt(30), kv_transfer_params=bad)])["y"]
    assert out.invalid_request and "2 KV-cache groups" in out.error


def test_prefill_holds_blocks_for_the_reader_and_never_shares_them():
    engine, worker = connected_engine("tiny-hybrid", "kv_producer")
    ids = prompt(70)
    hold = KVTransferParams(do_remote_decode=True)
    out = run(engine, [Request("p1", ids, SamplingParams(max_tokens=1), hold)])["p1"]
    params = out[-1].kv_transfer_params
    assert params is not None and params.do_remote_prefill and params.num_tokens == 70
    assert params.remote_block_ids[0] and params.remote_request_id == "p1"
    held = engine.pool.num_used
    assert held > 0
    # While held (the sender may rewrite them in place), the blocks serve no prefix hit.
    out = run(engine, [Request("p2", ids, SamplingParams(max_tokens=1), hold)])["p2"]
    assert out[-1].num_cached_tokens == 0
    worker.release_sends = True  # the readers are done
    engine.step()
    engine.pool.assert_all_free()
    out = run(engine, [Request("p3", ids, SamplingParams(max_tokens=2))])["p3"]
    assert out[-1].num_cached_tokens == 64
