"""What ``kvbridge serve`` and ``kvbridge describe`` take: a role, then every option of
the example server (``kvbridge.examples.worker_setup.make_parser``), so ``--help`` lists
them all and a describe of the arguments a server runs with describes that server::

    kvbridge serve    decode --port 8200 --block-size 16 --kv-transfer-config '{...}'
    kvbridge describe decode --port 8200 --block-size 16 --kv-transfer-config '{...}'

The role may also come as ``--role ROLE`` (the server's own spelling).
"""

from __future__ import annotations

import argparse

ROLES = ("prefill", "decode", "both")

_DESCRIPTIONS = {
    "serve": "Run the example worker (python -m kvbridge.examples.server) as ROLE.",
    "describe": "Print, as JSON, the description the worker `kvbridge serve` starts with "
    "these arguments would publish. Computed offline: no port is bound and no NIXL agent "
    "made, so it runs beside that worker.",
}


def server_parser(cmd: str) -> argparse.ArgumentParser:
    """The parser of ``kvbridge CMD`` (``serve`` or ``describe``): the example server's,
    renamed, with ``--role`` left unset (the role is required) and ``describe``'s
    ``--out``."""
    from kvbridge.examples.worker_setup import make_parser

    parser = make_parser()
    parser.prog = f"kvbridge {cmd}"
    parser.usage = f"%(prog)s {{{','.join(ROLES)}}} [options]"
    parser.description = _DESCRIPTIONS[cmd] + " ROLE may also be given as --role ROLE."
    parser.set_defaults(role=None)
    if cmd == "describe":
        parser.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    return parser


def parse_server_args(cmd: str, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The parsed arguments of ``kvbridge CMD ARGV`` (``--help`` prints every option and
    exits), and ARGV as the example server takes it (``--role ROLE`` first)."""
    parser = server_parser(cmd)
    role = None
    if argv and argv[0] in ROLES:
        role, argv = argv[0], argv[1:]
    args = parser.parse_args(argv)
    if role is not None and args.role is not None and role != args.role:
        parser.error(f"the role is {role} but --role says {args.role}: give one")
    args.role = role or args.role
    if args.role is None:
        parser.error(f"the role is required: kvbridge {cmd} {{{','.join(ROLES)}}} [options]")
    return args, ["--role", args.role, *argv]
