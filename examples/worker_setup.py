"""A worker from its command line: the parser, the connector's config, and the factory
the engine thread runs to build the runner, the connector and the engine.

Everything is read and checked here, before a thread starts: a bad ``--device``, a
kv-transfer-config that disagrees with ``--role``, an unknown key, all raise a
:class:`KVBridgeError` that names the option.

``kv_buffer_device`` (where the memory NIXL moves lives) follows ``--device`` unless the
kv-transfer-config sets it: ``--device cuda`` alone moves the cache's VRAM, and
``--device cuda`` with ``"kv_buffer_device": "cpu"`` stages it through host memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import torch

from kvbridge.connector.common.config import ConfigError, KVRole, KVTransferConfig
from kvbridge.examples.engine import Engine, EngineConfig
from kvbridge.examples.engine_loop import EngineLoop
from kvbridge.examples.faults import FAULTS, inject
from kvbridge.examples.runner import ModelRunner, RunnerConfig
from kvbridge.layouts.specs import dtype_name

ROLE_KV = {"prefill": KVRole.PRODUCER, "decode": KVRole.CONSUMER, "both": KVRole.BOTH}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="kvbridge example worker (HTTP)")
    parser.add_argument("--role", choices=sorted(ROLE_KV), default="both")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: an ephemeral port")
    parser.add_argument(
        "--ready-file", default=None, help="write the bound ports here as JSON (examples/ready.py)"
    )
    parser.add_argument("--kv-transfer-config", default=None, help="JSON, or a JSON file path")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--fault-inject", choices=sorted(FAULTS), default=None)
    parser.add_argument("--log-level", default="INFO")
    RunnerConfig.add_arguments(parser)
    return parser


def build(args: argparse.Namespace) -> tuple[EngineLoop, dict]:
    """The engine loop of a worker (built on its own thread by ``start()``) and the info
    ``/health`` reports; bad configuration raises before anything starts."""
    runner_config = RunnerConfig.from_args(args)
    info = {"model": args.model, "role": args.role, "device": str(runner_config.device)}
    config = transfer_config(args, runner_config.device)

    def factory() -> Engine:
        runner = ModelRunner(runner_config)
        scheduler = worker = None
        if config is not None:
            scheduler, worker = _connector(config, runner, info)
        engine = Engine(
            runner,
            EngineConfig(max_num_seqs=args.max_num_seqs),
            scheduler=scheduler,
            worker=worker,
            exclusive_blocks=config is not None and config.is_producer,
        )
        if args.fault_inject:
            inject(args.fault_inject, engine)
        return engine

    return EngineLoop(factory), info


def transfer_config(args: argparse.Namespace, device: torch.device) -> KVTransferConfig | None:
    """The connector's config (None: role "both" without one): ``--kv-transfer-config``
    over the defaults ``--role`` gives (``kv_role``, ``engine_id`` ROLE-PORT), so a config
    that sets only ``kv_port`` or ``secret`` keeps them; ``kv_buffer_device`` is
    ``device``'s type unless given."""
    role = ROLE_KV[args.role]
    if args.role == "both" and not args.kv_transfer_config:
        return None
    given = _given(args.kv_transfer_config) if args.kv_transfer_config else {}
    defaults = {"kv_role": role.value, "engine_id": f"{args.role}-{args.port}"}
    config = KVTransferConfig.from_dict(defaults | given)
    if config.kv_role is not role:
        raise ConfigError(
            f"--role {args.role} needs kv_role {role.value!r}, the "
            f"kv-transfer-config says {config.kv_role.value!r}"
        )
    if "kv_buffer_device" not in given:
        config = msgspec.structs.replace(config, kv_buffer_device=device.type)
    return config


def _given(text_or_path: str) -> dict:
    """The keys a kv-transfer-config spells out (JSON, or the path of a JSON file)."""
    text = text_or_path
    if not text_or_path.lstrip().startswith("{"):
        path = Path(text_or_path)
        if not path.is_file():
            raise ConfigError(f"kv-transfer-config {text_or_path!r} is neither JSON nor a file")
        text = path.read_text()
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"kv-transfer-config is not valid JSON: {exc}") from None
    if not isinstance(given, dict):
        raise ConfigError(f"kv-transfer-config must be a JSON object, not {type(given).__name__}")
    return given


def _connector(config: KVTransferConfig, runner: ModelRunner, info: dict):
    # Imported here: role "both" without a connector needs neither NIXL nor ZMQ.
    from kvbridge.connector.scheduler.scheduler import KVBridgeScheduler
    from kvbridge.connector.worker.worker import KVBridgeWorker, ModelInfo

    mc = runner.model_config
    model = ModelInfo(
        model_name=mc.name,
        dtype=dtype_name(mc.dtype),
        num_kv_heads=mc.num_kv_heads,
        head_size=mc.head_size,
    )
    worker = KVBridgeWorker(config, model)
    worker.register_kv_caches(runner.buffers)
    scheduler = KVBridgeScheduler(config, runner.kv_config)
    # the port the listener bound (kv_port 0: ephemeral) is the one the params advertise
    scheduler.set_side_channel_ports([worker.side_channel_port])
    info |= {"engine_id": config.engine_id, "kv_port": worker.side_channel_port}
    return scheduler, worker
