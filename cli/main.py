"""``kvbridge``: the one command an operator learns.

::

    kvbridge describe --role decode --model tiny-hybrid --block-size 16 ... > decode.json
    kvbridge plan prefill.json decode.json [--prompt-tokens 1000]
    kvbridge probe 10.0.0.1:5600 [--as decode.json] [--secret-env KVBRIDGE_SECRET]
    kvbridge serve prefill|decode|both [example server arguments]
    kvbridge bench [--list | NAME [benchmark arguments]]   (kvbridge.cli.bench.NAME)

Exit status: ``plan`` 0 when the pair works, 1 when it is refused (the fields, both
values and the fix are printed), 2 on bad input; ``probe`` 0 when the worker answered
(and, with ``--as``, pairs), 1 when it answered but would refuse the pairing, 3 when it did
not answer or refused the handshake (a readiness check: ``until kvbridge probe ...``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

OK, REFUSED, BAD_INPUT, UNREACHABLE = 0, 1, 2, 3


def _plan(args: argparse.Namespace) -> int:
    from kvbridge.cli.pairing import load_description, pair, plan_text

    prefill, decode = load_description(args.prefill), load_description(args.decode)
    pairing = pair(prefill, decode)
    print(plan_text(pairing, args.prompt_tokens))
    return OK if pairing.plan is not None else REFUSED


def _probe(args: argparse.Namespace) -> int:
    from kvbridge.cli.pairing import (
        describe_text,
        load_description,
        pair,
        plan_text,
        save_description,
    )
    from kvbridge.cli.probe import fetch_description
    from kvbridge.handshake.errors import HandshakeError

    secret = os.environ.get(args.secret_env) if args.secret_env else None
    try:
        desc = fetch_description(
            args.address, secret=secret, timeout_s=args.timeout, retries=args.retries
        )
    except HandshakeError as exc:
        print(f"UNREACHABLE: {exc}", file=sys.stderr)
        return UNREACHABLE
    print(describe_text(desc))
    if args.save:
        save_description(desc, args.save)
    if args.as_ is None:
        return OK
    other = load_description(args.as_)
    # the probed worker is the prefill unless --as describes one
    prefill, decode = (other, desc) if args.as_role == "prefill" else (desc, other)
    pairing = pair(prefill, decode)
    print(plan_text(pairing, args.prompt_tokens))
    return OK if pairing.plan is not None else REFUSED


def _describe(args: argparse.Namespace, rest: list[str]) -> int:
    import msgspec

    from kvbridge.examples.worker_setup import build, make_parser

    server_args = make_parser().parse_args(rest)
    if server_args.role == "both" and not server_args.kv_transfer_config:
        print(
            "error: describe needs --role prefill|decode (or --kv-transfer-config)", file=sys.stderr
        )
        return BAD_INPUT
    loop, _ = build(server_args)
    loop.start()
    try:
        assert loop.worker is not None
        data = msgspec.json.encode(loop.worker.description)
    finally:
        loop.close()
    if args.out:
        Path(args.out).write_bytes(data)
    else:
        sys.stdout.buffer.write(data + b"\n")
    return OK


def _serve(role: str, rest: list[str]) -> int:
    from kvbridge.examples.server import main as serve

    return serve(["--role", role, *rest])


def _bench(args: argparse.Namespace) -> int:
    from kvbridge.cli.bench import UnknownBenchmarkError, listing, run

    if args.list or args.name is None:
        print(listing())
        return OK
    try:
        return run(args.name, args.args)
    except UnknownBenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="the transfer plan of a prefill -> decode pair, or why not")
    p.add_argument("prefill", help="prefill's description (JSON: kvbridge describe / probe --save)")
    p.add_argument("decode", help="decode's description (JSON)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    q = sub.add_parser("probe", help="handshake with a running worker's side channel")
    q.add_argument("address", help="HOST:PORT of the worker's side channel (kv_ip:kv_port)")
    q.add_argument("--as", dest="as_", default=None, help="a description (JSON) to pair with it")
    q.add_argument("--as-role", choices=("decode", "prefill"), default="decode")
    q.add_argument("--secret-env", default="KVBRIDGE_SECRET", help="env var holding the secret")
    q.add_argument("--timeout", type=float, default=5.0, help="seconds per attempt")
    q.add_argument("--retries", type=int, default=1)
    q.add_argument("--save", default=None, help="write the worker's description here (JSON)")
    q.add_argument("--prompt-tokens", type=int, default=1024)
    d = sub.add_parser(
        "describe",
        help="build a worker (example server arguments) and print "
        "its description as JSON, without serving",
    )
    d.add_argument("--out", default=None)
    s = sub.add_parser(
        "serve", help="an example prefill/decode server (python -m kvbridge.examples.server)"
    )
    s.add_argument("role", choices=("prefill", "decode", "both"))
    from kvbridge.cli.bench import listing

    b = sub.add_parser(
        "bench",
        help="run a benchmark (kvbridge bench --list names them)",
        description="Run benchmark NAME with its own arguments (NAME --help: its options; "
        "every one takes --json PATH). Benchmarks:\n\n" + listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    b.add_argument("name", nargs="?", help="the benchmark (none: list them)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvbridge.layouts.errors import KVBridgeError

    parser = make_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.cmd not in ("serve", "describe"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.cmd == "plan":
            return _plan(args)
        if args.cmd == "probe":
            return _probe(args)
        if args.cmd == "describe":
            return _describe(args, rest)
        if args.cmd == "serve":
            return _serve(args.role, rest)
        return _bench(args)
    except KVBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
