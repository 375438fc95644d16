"""UCX settings that keep GPU memory between processes of one host off CUDA IPC are named.

Neither setting fails a transfer: a READ under ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n`` ran as
software emulation at 0.55 GB/s on an H100 (1,399 GB/s over CUDA IPC). The NIXL engine
warns once per process when it registers GPU memory under one (GPU tier); here the rules.
"""

from __future__ import annotations

import logging

import pytest

from kvbridge.connector.transfer import gpu_paths
from kvbridge.connector.transfer.gpu_paths import slow_gpu_path, warn_slow_gpu_path


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n"),
        ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "NO"}, "software emulation"),
        ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "0"}, "transfer_mode 'push'"),
        ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}, "between GPUs not joined by NVLink"),
        ({"UCX_TLS": "tcp"}, "UCX_TLS=tcp leaves out cuda_ipc"),
        ({"UCX_TLS": "rc,cuda_copy"}, "UCX_TLS=rc,cuda_copy leaves out cuda_ipc"),
        ({"UCX_TLS": "^cuda_ipc"}, "UCX_TLS=^cuda_ipc leaves out cuda_ipc"),
        ({"UCX_TLS": "^tcp,cuda"}, "add cuda_ipc to UCX_TLS"),
    ],
)
def test_a_setting_that_keeps_gpu_memory_off_cuda_ipc_is_named(environ, named):
    reason = slow_gpu_path(environ)
    assert reason is not None and named in reason


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"},
        {"UCX_TLS": "all"},
        {"UCX_TLS": "rc,cuda_copy,cuda_ipc"},
        {"UCX_TLS": "tcp,cuda"},
        {"UCX_TLS": "^tcp"},
        {"UCX_TLS": ""},
    ],
)
def test_settings_that_keep_cuda_ipc_say_nothing(environ):
    assert slow_gpu_path(environ) is None


def test_the_warning_is_logged_once_per_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(gpu_paths, "_warned", set())
    environ = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    with caplog.at_level(logging.WARNING, logger=gpu_paths.__name__):
        first = warn_slow_gpu_path(environ)
        again = warn_slow_gpu_path(environ)
    assert first == again == slow_gpu_path(environ)
    assert caplog.text.count("kvbridge registered GPU memory, but UCX_CUDA_IPC") == 1


@pytest.mark.gpu
def test_registering_gpu_memory_under_such_a_setting_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """gpu tier: the engine checks when it registers GPU memory (not host memory)."""
    import torch

    from kvbridge.connector.transfer.nixl_engine import NixlEngineConfig, NixlTransferEngine

    monkeypatch.setattr(gpu_paths, "_warned", set())
    monkeypatch.setenv("UCX_TLS", "tcp")  # read at registration, after the agent exists
    with NixlTransferEngine(NixlEngineConfig(agent_name="gpu-paths")) as engine:
        with caplog.at_level(logging.WARNING, logger=gpu_paths.__name__):
            engine.register([torch.zeros(1024, dtype=torch.uint8)])
            assert "registered GPU memory" not in caplog.text
            engine.register([torch.zeros(1024, dtype=torch.uint8, device="cuda")])
    assert "registered GPU memory, but UCX_TLS=tcp leaves out cuda_ipc" in caplog.text
