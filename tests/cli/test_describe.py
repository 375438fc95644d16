"""``kvbridge describe`` offline: the description equals the one a live worker of the same
arguments publishes (but for what only a live worker has: its NIXL agent, the port it
bound, its memory's addresses), binds nothing, builds no scheduler, and takes exactly
what ``kvbridge serve`` takes (``--help`` lists every option of the server)."""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys

import msgspec
import pytest

from kvbridge.cli.describe import DescribeError, offline_description
from kvbridge.cli.main import main
from kvbridge.cli.server_args import parse_server_args
from kvbridge.examples.worker_setup import build, make_parser
from kvbridge.handshake.messages import WireRegion, WorkerDescription


def _unaddressed(region: WireRegion | None) -> WireRegion | None:
    return None if region is None else msgspec.structs.replace(region, base_addr=0)


def _comparable(desc: WorkerDescription) -> WorkerDescription:
    """``desc`` without what only a live worker has."""
    return msgspec.structs.replace(
        desc,
        agent_name="",
        nixl_metadata=b"",
        side_channel_port=0,
        regions=[_unaddressed(r) for r in desc.regions],
        gather=_unaddressed(desc.gather),
        staging=_unaddressed(desc.staging),
    )


def _kv(kv_role: str, **extra: object) -> str:
    return json.dumps({"kv_role": kv_role, "engine_id": "e-1", "kv_port": 0, "extra": extra})


CASES = {
    "decode": ["decode", "--kv-transfer-config", _kv("kv_consumer")],
    "prefill HND cross-layer": [
        "prefill", "--block-size", "32", "--kv-layout", "HND", "--cross-layers",
        "--kv-transfer-config", _kv("kv_producer"),
    ],
    "push decode": ["decode", "--kv-transfer-config", _kv("kv_consumer", transfer_mode="push")],
    "prefill with a gather arena": [
        "prefill", "--kv-transfer-config", _kv("kv_producer", gather_mib=1, rewrite_on_save=True),
    ],
}  # fmt: skip


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_the_offline_description_is_the_live_workers(argv):
    args, _ = parse_server_args("describe", argv)
    offline = offline_description(args)
    loop, _ = build(args)
    loop.start()
    try:
        assert loop.worker is not None
        live = loop.worker.description
    finally:
        loop.close()
    assert live.kv_role == offline.kv_role == json.loads(args.kv_transfer_config)["kv_role"]
    assert _comparable(offline) == _comparable(live)


def test_describe_binds_nothing_and_warns_of_no_secret(tmp_path, caplog, capsys):
    """Beside a worker holding its side-channel port, describe of that worker's arguments
    works and advertises the port the worker listens on."""
    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    out = tmp_path / "decode.json"
    kv = json.dumps({"kv_role": "kv_consumer", "engine_id": "d", "kv_port": port})
    with held, caplog.at_level(logging.DEBUG):
        rc = main(["describe", "decode", "--kv-transfer-config", kv, "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    desc = msgspec.json.decode(out.read_bytes(), type=WorkerDescription)
    assert (desc.side_channel_host, desc.side_channel_port) == ("127.0.0.1", port)
    assert (desc.agent_name, desc.nixl_metadata, desc.kv_role) == ("", b"", "kv_consumer")
    assert "secret" not in caplog.text + capsys.readouterr().err


def test_describe_makes_no_nixl_agent():
    code = (
        "import sys; from kvbridge.cli.main import main; "
        "rc = main(['describe', 'prefill', '--out', '/dev/null']); "
        "print(rc, 'nixl' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr


def test_a_role_needs_a_connector_to_describe(capsys):
    args, _ = parse_server_args("describe", ["both"])
    with pytest.raises(DescribeError, match="--role both without --kv-transfer-config"):
        offline_description(args)
    assert main(["describe", "both"]) == 2


@pytest.mark.parametrize("cmd", ["describe", "serve"])
def test_help_lists_every_option_the_server_takes(cmd, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([cmd, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    options = [o for a in make_parser()._actions for o in a.option_strings]
    assert len(options) > 15, options
    listed = set(re.findall(r"(?<![\w-])(--?[\w-]+)", text))
    missing = [o for o in options if o not in listed]
    assert not missing, text
    assert f"kvbridge {cmd} {{prefill,decode,both}}" in text


@pytest.mark.parametrize("cmd", ["describe", "serve"])
def test_the_role_comes_first_or_as_the_servers_option(cmd, capsys):
    args, server_argv = parse_server_args(cmd, ["decode", "--block-size", "32"])
    assert (args.role, args.block_size) == ("decode", 32)
    assert server_argv == ["--role", "decode", "--block-size", "32"]
    args, server_argv = parse_server_args(cmd, ["--block-size", "32", "--role", "prefill"])
    assert args.role == "prefill" and server_argv[:2] == ["--role", "prefill"]
    for argv, error in (
        (["decode", "--role", "prefill"], "the role is decode but --role says prefill"),
        (["--block-size", "32"], "the role is required"),
        (["decode", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    ):
        with pytest.raises(SystemExit):
            parse_server_args(cmd, argv)
        assert error in capsys.readouterr().err
