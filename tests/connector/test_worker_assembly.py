"""A worker whose registration fails holds nothing: the parts built before the failure
(its NIXL agent, its set-up threads) are closed at once, not left for a shutdown that an
engine whose startup failed may never call (``connector/worker/assembly.py``)."""

from __future__ import annotations

import threading

import pytest

from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.nixl_setup import nixl_engine
from kvbridge.connector.worker.worker import KVBridgeWorker
from kvbridge.layouts.errors import KVBridgeError
from tests.connector.conftest import MODEL, SideFormat, make_buffers, transfer_config
from tests.ports import dead_port


def _kvbridge_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvbridge-")}


@pytest.mark.parametrize("close_fails", [False, True], ids=["closes", "a-close-fails"])
def test_a_registration_that_fails_closes_what_it_built(close_fails):
    """``a-close-fails``: the engine's close raises too; the caller still gets the error
    that stopped the registration, and the other parts are closed."""
    closed: list[str] = []

    def engine(name: str) -> TransferEngine:
        real = nixl_engine(name, 0)
        close = real.close

        def recorded_close() -> None:
            closed.append(name)
            close()
            if close_fails:
                raise KVBridgeError("deregistering failed")

        real.close = recorded_close  # type: ignore[method-assign]
        return real

    before = _kvbridge_threads()
    with dead_port() as port:  # the worker's side-channel port, taken
        config = transfer_config("kv_producer", "p-held-port", kv_ip="127.0.0.1", kv_port=port)
        worker = KVBridgeWorker(config, MODEL, engine_factory=engine)
        with pytest.raises(KVBridgeError, match=str(port)):
            worker.register_kv_caches(make_buffers(SideFormat(16), "F"))
    assert closed == [worker.agent_name], "the agent built before the failure is still open"
    assert _kvbridge_threads() - before == set(), "set-up threads still run"
    worker.shutdown()  # and a shutdown after it has nothing left to close
    assert closed == [worker.agent_name]
