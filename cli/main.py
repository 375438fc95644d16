"""``kvbridge``: the one command an operator learns.

::

    kvbridge describe decode --model tiny-hybrid --block-size 16 ... > decode.json
    kvbridge plan prefill.json decode.json [--prompt-tokens 1000]
    kvbridge probe 10.0.0.1:5600 [--as decode.json] [--secret-env KVBRIDGE_SECRET]
    kvbridge serve prefill|decode|both [example server arguments]
    kvbridge bench [--list | NAME [benchmark arguments]]   (kvbridge.cli.bench.NAME)

``describe`` and ``serve`` take the same arguments: a role, then the example server's
options (``--help`` lists them all); ``describe`` computes the description offline
(``kvbridge.cli.describe``: no port bound, no NIXL agent), so it runs beside a worker.

Exit status: ``plan`` 0 when the pair works, 1 when it is refused (not a prefill ->
decode pair by role, or the fields, both values and the fix are printed), 2 on bad
input; ``probe`` 0 when the worker answered (and, with ``--as``, pairs), 1 when it
answered but would refuse the pairing, 3 when it did not answer or refused the
handshake (a readiness check: ``until kvbridge probe ...``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbridge.cli.roles import RoleRefusal

OK, REFUSED, BAD_INPUT, UNREACHABLE = 0, 1, 2, 3


def _plan(args: argparse.Namespace) -> int:
    from kvbridge.cli.pairing import load_description, pair, plan_text
    from kvbridge.cli.roles import check_roles

    prefill, decode = load_description(args.prefill), load_description(args.decode)
    refusal = check_roles(prefill, decode)
    if refusal is not None:
        print(refusal.text(args.prefill, args.decode, _plan_fix(refusal, args)))
        return REFUSED
    pairing = pair(prefill, decode)
    print(plan_text(pairing, args.prompt_tokens))
    return OK if pairing.plan is not None else REFUSED


def _plan_fix(refusal: RoleRefusal, args: argparse.Namespace) -> str:
    return _role_fix(
        refusal,
        swap=f"pass them the other way round: kvbridge plan {args.decode} {args.prefill}",
        prefill="pass as PREFILL a prefill worker's description (kvbridge probe "
        "PREFILL_HOST:KV_PORT --save prefill.json, or kvbridge describe prefill ... "
        "--out prefill.json)",
        decode="pass as DECODE a decode worker's description (kvbridge probe "
        "DECODE_HOST:KV_PORT --save decode.json, or kvbridge describe decode ... "
        "--out decode.json)",
    )


def _role_fix(refusal: RoleRefusal, *, swap: str, prefill: str, decode: str) -> str:
    """``swap`` when the two pair the other way round; else how to fix each wrong side
    (the decode side's for one worker given twice)."""
    if refusal.swapped:
        return swap
    fixes = [] if refusal.prefill_sends else [prefill]
    if not refusal.decode_loads or (refusal.same_worker and not fixes):
        fixes.append(decode)
    return "; ".join(fixes)


def _probe(args: argparse.Namespace) -> int:
    from kvbridge.cli.pairing import (
        describe_text,
        load_description,
        pair,
        plan_text,
        save_description,
    )
    from kvbridge.cli.probe import fetch_description
    from kvbridge.cli.roles import check_roles
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
    refusal = check_roles(prefill, decode)
    if refusal is not None:
        names = {"decode": (args.address, args.as_), "prefill": (args.as_, args.address)}
        print(refusal.text(*names[args.as_role], _probe_fix(refusal, args)))
        return REFUSED
    pairing = pair(prefill, decode)
    print(plan_text(pairing, args.prompt_tokens))
    return OK if pairing.plan is not None else REFUSED


def _probe_fix(refusal: RoleRefusal, args: argparse.Namespace) -> str:
    other = "prefill" if args.as_role == "decode" else "decode"
    fix = {  # what gives a right side, where the probed worker is the other one's
        args.as_role: f"pass --as a {args.as_role} worker's description (kvbridge describe "
        f"{args.as_role} ... --out {args.as_role}.json)",
        other: f"probe a {other} worker's side channel",
    }
    return _role_fix(
        refusal,
        swap=f"--as {args.as_} describes the {other} side: pass --as-role {other}",
        prefill=fix["prefill"],
        decode=fix["decode"],
    )


def _describe(server_args: argparse.Namespace, out: str | None) -> int:
    import msgspec

    from kvbridge.cli.describe import offline_description

    data = msgspec.json.encode(offline_description(server_args))
    if out:
        Path(out).write_bytes(data)
    else:
        sys.stdout.buffer.write(data + b"\n")
    return OK


def _serve(server_argv: list[str]) -> int:
    from kvbridge.examples.server import main as serve

    return serve(server_argv)


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
    # their options are the example server's: parsed, and listed by --help, in
    # kvbridge.cli.server_args
    sub.add_parser(
        "describe",
        add_help=False,
        help="print the description (JSON) of the worker `serve` starts with the same "
        "arguments, offline (no port bound)",
    )
    sub.add_parser(
        "serve",
        add_help=False,
        help="an example prefill/decode server (python -m kvbridge.examples.server)",
    )
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
        if args.cmd in ("describe", "serve"):
            from kvbridge.cli.server_args import parse_server_args

            server_args, server_argv = parse_server_args(args.cmd, rest)
            if args.cmd == "describe":
                return _describe(server_args, server_args.out)
            return _serve(server_argv)
        return _bench(args)
    except KVBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
