"""vllm-router in front of kvbridge workers, on ports nobody else can take.

vllm-router (``pip install 'kvbridge[router]'``, a Rust binary in a wheel) is the front
door of a P/D deployment: in ``--vllm-pd-disaggregation`` mode it sends the client's body
to a prefill worker with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode":
true, ...}``, copies the ``kv_transfer_params`` prefill returns into the decode request,
and streams decode's answer back. kvbridge's workers (the example servers and vLLM with
kvbridge's connector) answer everything it asks for.

The router refuses ``--port 0`` and serves its own Prometheus endpoint on a fixed port
(29000) unless told otherwise, so this launcher reserves two ephemeral ports first: it
binds sockets with ``SO_REUSEADDR`` to port 0 and never listens on them (nobody else can
bind those ports while they are held; the router, which binds with ``SO_REUSEADDR`` too,
can), starts the router on them, and lets go once the router answers. Then it writes the
ready file (``examples/ready.py``) and waits for the router, passing SIGTERM/SIGINT on::

    python -m kvbridge.examples.router --prefill http://10.0.0.1:8100 \\
        --decode http://10.0.0.2:8200 --ready-file router.ready.json

``--port N`` binds a fixed port instead (a deployment's front door); it is held the same
way until the router binds it, and a port another process listens on is refused at once,
naming the holder (the router itself would bind only after every worker answers).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvbridge.examples.ready import write_ready_file
from kvbridge.handshake.port_holder import bind_error_text

POLICIES = ("round_robin", "power_of_two", "cache_aware", "random")


class RouterNotInstalled(RuntimeError):
    pass


class RouterPortTaken(RuntimeError):
    """The router's port cannot be bound; the message names the address and its holder."""


def router_binary() -> str:
    """The ``vllm-router`` next to this Python, or on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if found is None:
        raise RouterNotInstalled(
            "vllm-router is not installed: pip install 'kvbridge[router]' (vllm-router 0.1.17)"
        )
    return found


def reserve_port(host: str, port: int = 0) -> socket.socket:
    """A socket bound (SO_REUSEADDR, not listening) to ``port`` of ``host`` (0: an
    ephemeral one). Raises RouterPortTaken, naming the holder, when that fails (a port
    another process listens on cannot be bound even with SO_REUSEADDR)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RouterPortTaken(bind_error_text("vllm-router", host, port, exc)) from exc
    return sock


def router_argv(
    prefill: list[str],
    decode: list[str],
    *,
    host: str,
    port: int,
    metrics_port: int,
    policy: str = "round_robin",
    health_check_interval_s: int = 5,
    extra: list[str] | None = None,
) -> list[str]:
    """The vllm-router command line of a P/D router over these workers."""
    argv = [router_binary(), "--vllm-pd-disaggregation", "--host", host, "--port", str(port)]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    return [
        *argv,
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--worker-startup-check-interval",
        "1",
        "--health-check-interval-secs",
        str(health_check_interval_s),
        *(extra or []),
    ]


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        return False
    return True


def start_router(
    prefill: list[str],
    decode: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout_s: float = 120.0,
    log: Path | None = None,
    **kwargs: object,
) -> tuple[subprocess.Popen, int, int]:
    """Start vllm-router (port 0: an ephemeral one, held until the router binds it); the
    process, its HTTP port and its Prometheus port once it answers. Raises RouterPortTaken
    (naming the holder) when ``port`` is taken, RuntimeError
    (and kills the router) when it exits or does not listen within ``startup_timeout_s``
    (the router binds only once every worker answers ``/health``)."""
    held = [reserve_port(host, port)]
    try:
        held.append(reserve_port(host))
        port = held[0].getsockname()[1]
        metrics_port = held[1].getsockname()[1]
        argv = router_argv(
            prefill, decode, host=host, port=port, metrics_port=metrics_port, **kwargs
        )  # type: ignore[arg-type]
        if log is None:  # the router logs to this process's stdout and stderr
            proc = subprocess.Popen(argv)
        else:
            with log.open("ab") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout_s
        while not _listening(host, port):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vllm-router exited ({proc.returncode}) before it listened{_tail(log)}"
                )
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(
                    f"vllm-router did not listen on {host}:{port} within {startup_timeout_s} s "
                    f"(it waits until every worker's /health answers 200){_tail(log)}"
                )
            time.sleep(0.1)  # polling a port the router binds once; bounded by the deadline
        return proc, port, metrics_port
    finally:
        for sock in held:
            sock.close()


def _tail(log: Path | None, n: int = 2000) -> str:
    if log is None or not log.exists():
        return ""
    return ":\n" + log.read_text(errors="replace")[-n:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="vllm-router in P/D mode over kvbridge workers")
    parser.add_argument("--prefill", action="append", required=True, help="URL (repeat)")
    parser.add_argument("--decode", action="append", required=True, help="URL (repeat)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: an ephemeral port")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin")
    parser.add_argument("--health-check-interval", type=int, default=5, help="seconds")
    parser.add_argument("--startup-timeout", type=float, default=120.0)
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("extra", nargs="*", help="after --: more vllm-router arguments")
    args = parser.parse_args(argv)
    try:
        proc, port, metrics_port = start_router(
            args.prefill,
            args.decode,
            host=args.host,
            port=args.port,
            startup_timeout_s=args.startup_timeout,
            policy=args.policy,
            health_check_interval_s=args.health_check_interval,
            extra=args.extra,
        )
    except (RouterNotInstalled, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    if args.ready_file:
        write_ready_file(args.ready_file, args.host, port, metrics_port=metrics_port)
    print(f"vllm-router on http://{args.host}:{port} (metrics :{metrics_port})", flush=True)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
