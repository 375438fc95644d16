"""Ready files: a server binds port 0 and says which port it got.

Nothing picks a "free" port for a server to bind later (another process may take it in
between): the worker server binds ``--port 0`` (the vllm-router launcher holds an ephemeral
port until the router bound it) and, once bound, writes
``--ready-file`` (JSON, written to a temporary name and renamed, so a reader never sees
half of it)::

    {"url": "http://127.0.0.1:41233", "port": 41233, "pid": 1234, ...}

The worker server adds its side channel (``kv_port``: the bound port) and ``engine_id``.
A launcher waits for the file (:func:`wait_ready_file`, or from a shell
``python -m kvbridge.examples.ready FILE --pid PID --timeout 60``, which prints the URL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvbridge.handshake.port_holder import bind_error_text


def write_ready_file(path: str | Path, host: str, port: int, **fields: object) -> None:
    """Publish the bound ``host:port`` (and ``fields``) at ``path``, atomically."""
    path = Path(path)
    record = {"url": f"http://{host}:{port}", "port": port, "pid": os.getpid(), **fields}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def wait_ready_file(
    path: str | Path, timeout_s: float, *, alive: Callable[[], bool] = lambda: True
) -> dict:
    """The ready record at ``path``, once written; raises TimeoutError after ``timeout_s``
    and RuntimeError as soon as ``alive()`` says the server is gone."""
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            pass
        if not alive():
            raise RuntimeError(f"the server exited before it wrote {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout_s} s")
        time.sleep(0.05)  # polling a file the server writes once; bounded by the deadline


def bind_failed(what: str, host: str, port: int, exc: OSError) -> int:
    """Print why ``what`` could not bind (naming who holds the port); exit status 2."""
    print(f"error: {bind_error_text(what, host, port, exc)}", file=sys.stderr)
    return 2


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its shell) counts as gone
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="wait for a server's ready file")
    parser.add_argument("file")
    parser.add_argument("--pid", type=int, default=None, help="fail early if it exits")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--field", default="url", help="what to print (url, port, kv_port)")
    args = parser.parse_args(argv)
    pid = args.pid
    alive = (lambda: _pid_alive(pid)) if pid is not None else (lambda: True)
    try:
        record = wait_ready_file(args.file, args.timeout, alive=alive)
    except (TimeoutError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(record[args.field])
    return 0


if __name__ == "__main__":
    sys.exit(main())
