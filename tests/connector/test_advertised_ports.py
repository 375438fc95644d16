"""Which side-channel ports a prefill's params advertise, and how decode routes by them.

Fixed ``kv_port``: rank r listens on ``kv_port + r``; the params carry rank 0's port and
decode adds the rank. ``kv_port`` 0: every rank bound an ephemeral port; the scheduler
refuses to hand out params until the ports reach it, then lists every rank's port in
``remote_ports``, and decode routes each rank to its own port.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest
import torch

from kvbridge.connector.common.config import ConfigError, KVRole, KVTransferConfig
from kvbridge.connector.common.params import KVTransferParams, ParamsError
from kvbridge.connector.common.signing import ParamsSigner
from kvbridge.connector.scheduler.advertised import AdvertisedPorts, PortsNotBoundError
from kvbridge.connector.scheduler.scheduler import KVBridgeScheduler
from kvbridge.connector.worker.routing import Router
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.specs import FullAttentionSpec

TOKENS = 64


@dataclass(frozen=True)
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: KVTransferParams | None


def _scheduler(kv_port: int, tp_size: int, secret: str | None = None) -> KVBridgeScheduler:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(
        groups=(KVCacheGroup(group_id=0, layer_names=("l0",), spec=spec),), num_blocks=32
    )
    config = KVTransferConfig(
        kv_role=KVRole.PRODUCER,
        engine_id="p",
        kv_ip="127.0.0.1",
        kv_port=kv_port,
        secret=secret,
    )
    return KVBridgeScheduler(config, kv, tp_size=tp_size)


def _finish(sched: KVBridgeScheduler, rid: str = "r1") -> KVTransferParams:
    req = Req(rid, list(range(TOKENS)), KVTransferParams(do_remote_decode=True))
    delay, params = sched.request_finished(req, [list(range(TOKENS // 16))])
    assert delay and params is not None
    return KVTransferParams.from_json(params.to_json())  # through the proxy


def _ports_of(params: KVTransferParams, tp_size: int) -> dict[int, int]:
    """Prefill rank -> the port a TP-1 decode (reading every rank) would contact."""
    route = Router(0, 1, 4).route(params)
    assert {r for _, r in route.reads} == set(range(tp_size))
    return {rank: port for (_, rank), (_, port) in route.endpoints.items()}


def test_fixed_kv_port_advertises_rank_0_and_decode_adds_the_rank() -> None:
    sched = _scheduler(5600, tp_size=2)
    params = _finish(sched)
    assert (params.remote_port, params.remote_ports) == (5600, [])
    assert _ports_of(params, 2) == {0: 5600, 1: 5601}
    sched.set_side_channel_ports([5600, 5601])  # what the workers bound: agrees
    with pytest.raises(ConfigError, match=r"bound side-channel ports \[5600, 5700\].*5600, 5601"):
        sched.set_side_channel_ports([5600, 5700])


def test_kv_port_0_refuses_params_until_the_bound_ports_arrive() -> None:
    sched = _scheduler(0, tp_size=2)
    with pytest.raises(PortsNotBoundError, match="set_side_channel_ports"):
        _finish(sched)
    assert sched.num_held_sends == 0 and sched.build_connector_meta().reqs_to_send == ()
    sched.set_side_channel_ports([41233, 38111])  # ephemeral: in no particular order
    params = _finish(sched)
    assert (params.remote_port, params.remote_ports) == (41233, [41233, 38111])
    assert _ports_of(params, 2) == {0: 41233, 1: 38111}
    params.validate_for_load(1)


def test_signed_params_cover_the_ports() -> None:
    secret = "0123456789abcdef-secret"
    sched = _scheduler(0, tp_size=2, secret=secret)
    sched.set_side_channel_ports([41233, 38111])
    params = _finish(sched)
    signer = ParamsSigner(secret.encode())
    signer.verify(params)
    forged = msgspec.structs.replace(params, remote_ports=[41233, 9999])
    with pytest.raises(ParamsError, match="do not match their signature"):
        signer.verify(forged)


@pytest.mark.parametrize(
    ("ports", "message"),
    [
        ([1, 2], "one bound port"),  # TP 3: a rank missing
        ([1, 2, 0], "one bound port"),
        ([1, 2, 70000], "one bound port"),
    ],
)
def test_bad_bound_ports_are_refused(ports: list[int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AdvertisedPorts(0, 3).bind(ports)


def _params(**fields: object) -> KVTransferParams:
    base = dict(
        do_remote_prefill=True,
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=41233,
        remote_tp_size=2,
        remote_ports=[41233, 38111],
        remote_block_ids=[[0, 1]],
        remote_block_size=16,
        num_tokens=32,
        remote_request_id="r",
    )
    return KVTransferParams(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"remote_ports": [41233]}, "lists 1 ports, remote_tp_size=2"),
        ({"remote_ports": [41233, 0]}, "must all be ports"),
        ({"remote_ports": [5, 38111]}, r"remote_ports\[0\]=5 differs from remote_port=41233"),
        ({"remote_rank": 1}, r"remote_ports\[1\]=38111 differs from remote_port=41233"),
    ],
)
def test_params_with_inconsistent_ports_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ParamsError, match=message):
        _params(**fields).validate_for_load(1)


def test_params_name_rank_ports() -> None:
    assert [_params().rank_port(r) for r in range(2)] == [41233, 38111]
    fixed = _params(remote_ports=[], remote_port=5601, remote_rank=1)
    assert [fixed.rank_port(r) for r in range(2)] == [5600, 5601]
    with pytest.raises(ParamsError, match=r"lists ranks 0\.\.1"):
        _params().rank_port(2)
