"""``--device``: parsed once at the edge into a ``torch.device``; a misspelled or missing
device fails at startup with a :class:`DeviceError` naming the option, and the engine and
the reference run on the device they are given (the CUDA rows need the gpu tier)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge.examples import check, reference, server
from kvbridge.examples.device import DeviceError, parse_device
from kvbridge.examples.engine import Engine
from kvbridge.examples.paged_attention import AttentionCache, read_kv, write_kv
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.request import Request, SamplingParams
from kvbridge.examples.runner import ModelRunner, RunnerConfig
from kvbridge.examples.tokenizer import ByteTokenizer
from kvbridge.examples.worker_setup import build, make_parser
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.layout import KVLayout

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    before = torch.get_num_threads()  # the CLIs' main() sets one thread
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_cpu_parses_to_the_host_device():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(torch.device("cpu")) == torch.device("cpu")
    assert parse_device(" cpu ") == torch.device("cpu")


@pytest.mark.parametrize(
    "text", ["gpu", "", "CUDA", "cuda:", "cuda:-1", "cuda:x", "cuda:0:1", "cpu:0", "mps"]
)
def test_a_misspelled_device_names_the_option_and_the_choices(text):
    with pytest.raises(DeviceError) as info:
        parse_device(text)
    assert (
        str(info.value)
        == f"--device {text.strip()!r} is not a device: expected cpu, cuda or cuda:N"
    )
    assert isinstance(info.value, KVBridgeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("text", ["cuda", "cuda:0"])
def test_cuda_without_cuda_says_so(no_cuda, text):
    with pytest.raises(DeviceError, match=rf"^--device {text}: CUDA is not available .*"):
        parse_device(text)
    with pytest.raises(DeviceError, match="use --device cpu"):
        parse_device(text)


def test_a_gpu_index_past_the_last_names_how_many_there_are(one_gpu):
    with pytest.raises(DeviceError) as info:
        parse_device("cuda:7")
    assert str(info.value) == (
        "--device cuda:7: this machine has 1 CUDA device (cuda:0 .. cuda:0); pick an index below 1"
    )


def test_plain_cuda_resolves_to_the_current_index(one_gpu):
    assert parse_device("cuda") == torch.device("cuda", 0)
    assert parse_device("cuda:0") == torch.device("cuda", 0)


def test_the_error_names_the_option_it_came_from(no_cuda):
    with pytest.raises(DeviceError, match=r"^RunnerConfig\.device 'gpu' is not a device"):
        RunnerConfig(device="gpu")
    with pytest.raises(DeviceError, match=r"^RunnerConfig\.device cuda: CUDA is not available"):
        RunnerConfig(device="cuda")
    assert RunnerConfig(device="cpu").device == torch.device("cpu")


def test_a_worker_with_an_unusable_device_fails_before_anything_starts(no_cuda):
    args = make_parser().parse_args(["--role", "prefill", "--device", "cuda"])
    with pytest.raises(DeviceError, match=r"^--device cuda: CUDA is not available"):
        build(args)


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (server.main, ["--port", "0"]),
        (reference.main, ["--prompt", "hi"]),
        (check.main, ["run", "--router", "http://127.0.0.1:9"]),
    ],
    ids=["server", "reference", "check"],
)
@pytest.mark.parametrize("device", ["gpu", "cuda:3"])
def test_clis_exit_2_with_the_reason_and_no_traceback(no_cuda, capsys, main, argv, device):
    assert main([*argv, "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --device {device}") or err.startswith(
        f"error: --device {device!r}"
    )
    assert "Traceback" not in err


def test_bench_e2e_checks_the_device_before_starting_servers():
    proc = subprocess.run(
        [sys.executable, "scripts/bench_e2e.py", "--device", "gpu"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error: --device 'gpu' is not a device" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_one_model_per_name_and_device():
    model = load_model("tiny-dense")
    assert model is load_model("tiny-dense", "cpu") is load_model("tiny-dense", torch.device("cpu"))
    assert model.device == torch.device("cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_a_device_matches_the_reference_on_it(device):
    """The runner holds weights and cache on ``device``; tokens and logits reach the
    request's output as host values equal to the reference run on the same device."""
    config = RunnerConfig(model="tiny-hybrid", block_size=16, num_blocks=64, device=device)
    runner = ModelRunner(config)
    assert runner.device.type == device
    assert all(t.device.type == device for t in runner.buffers.tensors)
    engine = Engine(runner)
    ids = ByteTokenizer().encode("Blocks move between workers of different shapes. " * 2)
    sampling = SamplingParams(max_tokens=6, eos_id=None, return_logits=True)
    engine.add_request(Request("r", ids, sampling))
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    rows = [r for o in outs for r in o.new_logits]
    assert all(isinstance(r, np.ndarray) for r in rows)
    want = reference_generate(load_model("tiny-hybrid", device), ids, 6, eos_id=None)
    assert tokens == want.token_ids
    np.testing.assert_allclose(np.stack(rows), want.logits, atol=1e-4, rtol=0)
    engine.pool.assert_all_free()


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_inputs_on_the_device_are_read_there(device):
    """Token ids and block tables may come as tensors on the device (np.asarray cannot
    read a CUDA tensor): same results as lists and numpy tables."""
    model = load_model("tiny-dense", device)
    ids = ByteTokenizer().encode("paged and dense agree")
    want = model.reference_logits(ids)
    got = model.reference_logits(torch.tensor(ids, device=device))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    cache = AttentionCache.allocate(
        num_blocks=4,
        block_size=8,
        kernel_block_size=4,
        num_kv_heads=2,
        head_size=8,
        layout=KVLayout.HND,
        device=device,
    )
    table = np.array([5, 2, 7])
    positions = torch.arange(10, device=device)
    kv = torch.randn(10, 2, 8, device=device)
    write_kv(cache, torch.tensor(table, device=device), positions, kv, -kv)
    k, v = read_kv(cache, table, positions)
    assert torch.equal(k, kv) and torch.equal(v, -kv)
