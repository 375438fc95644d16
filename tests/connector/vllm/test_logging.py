"""kvbridge's log lines reach vLLM's log: vLLM configures only its own logger."""

from __future__ import annotations

import logging

import pytest

from kvbridge.connector.vllm import connector as vllm_connector


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture
def vllm_handler():
    vllm_log, ours = logging.getLogger("vllm"), logging.getLogger(vllm_connector.KVBRIDGE_LOGGER)
    saved = (vllm_log.handlers, ours.handlers, ours.level, ours.propagate)
    handler = _Records()
    vllm_log.handlers = [handler]
    ours.handlers = []
    try:
        yield handler
    finally:
        vllm_log.handlers, ours.handlers, ours.level, ours.propagate = saved


def test_every_kvbridge_module_logs_through_vllms_handlers(vllm_handler) -> None:
    vllm_connector._log_through_vllm()
    # the modules' own loggers (``logging.getLogger(__name__)``), INFO included
    for name in (
        "kvbridge.connector.worker.decode.receiver",
        "kvbridge.handshake.listener",
        "kvbridge.layouts.external",
    ):
        logging.getLogger(name).info("hello from %s", name)
    assert vllm_handler.lines == [
        "kvbridge.connector.worker.decode.receiver: hello from "
        "kvbridge.connector.worker.decode.receiver",
        "kvbridge.handshake.listener: hello from kvbridge.handshake.listener",
        "kvbridge.layouts.external: hello from kvbridge.layouts.external",
    ]


def test_a_module_logger_is_under_the_routed_name() -> None:
    from kvbridge.connector.worker.decode import receiver

    assert receiver.logger.name.startswith(vllm_connector.KVBRIDGE_LOGGER + ".")
