"""HTTP services as subprocesses: loopback ports, health wait, whole-group teardown.

Ports: a service that can bind port 0 and say which port it got does so (the vllm-router
launcher: ``--port 0 --ready-file``, read back here; kvbridge's side channels: ``kv_port``
0). :func:`free_port` is the one place left that probes for a port another process binds
later, for what cannot report an ephemeral port: vLLM's HTTP server (``--port``) and vLLM's
own NixlConnector side channel (``VLLM_NIXL_SIDE_CHANNEL_PORT``, ranks at base + rank).
A service that died because such a port was taken meanwhile is relaunched (below).

A :class:`Service` runs one command in its own session (``start_new_session=True``, so
its process group id is its pid and every process it forks stays in that group), writes
its output to a log file and serves ``GET /health``. ``stop()`` sends SIGTERM to the whole
group, waits, then SIGKILLs what is left, so no orphan engine processes remain.
:func:`start_all` starts several services at once and waits for all of them under one
deadline; a service that died because a port was taken meanwhile is restarted on fresh
ports (its launch plan is a function, called again).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kvbridge.handshake.port_holder import port_holder

HOST = "127.0.0.1"
LOG_TAIL_LINES = 40
PORT_IN_USE_MARKERS = ("Address already in use", "EADDRINUSE", "Errno 98", "address in use")

_EXCEPTION_LINE = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception): ")

_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def free_port(host: str = HOST, span: int = 1) -> int:
    """A port on ``host`` that is free now (and ``span - 1`` after it too).

    Found by binding port 0; a port handed out before by this process is never handed out
    again, so several services started together do not get the same one. Another process
    may still take it before the service binds it: :func:`start_all` restarts on that.
    """
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        ports = range(port, port + span)
        if port + span > 65535:
            continue
        with _ports_lock:
            if any(p in _handed_out for p in ports):
                continue
            if span > 1 and not all(_bindable(host, p) for p in ports[1:]):
                continue
            _handed_out.update(ports)
            return port
    raise RuntimeError(f"no run of {span} free port(s) found on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class Launch:
    """One way to start a service: command, extra environment, the port it serves on
    (0 with a ``ready_file``: the service binds an ephemeral port and writes it there)."""

    argv: list[str]
    env: dict[str, str]
    port: int
    host: str = HOST
    details: dict[str, object] = field(default_factory=dict)
    ready_file: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def read_port(self) -> bool:
        """Whether the port is known (read from the ready file once it exists)."""
        if self.port:
            return True
        assert self.ready_file is not None, "port 0 without a ready file"
        try:
            self.port = int(json.loads(self.ready_file.read_text())["port"])
        except FileNotFoundError:
            return False
        return True


class ServiceError(RuntimeError):
    """A service did not come up (or died); the message names it and quotes its log."""

    def __init__(self, service: Service, reason: str) -> None:
        tail = service.log_tail()
        super().__init__(
            f"{service.name}: {reason}\n--- last lines of {service.log_path} ---\n{tail}"
        )
        self.service_name = service.name
        self.reason = reason


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """Status and body of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):
        return 0, b""


class Service:
    """A subprocess serving HTTP with ``/health``; ``plan()`` gives its command and port."""

    def __init__(
        self,
        name: str,
        plan: Callable[[], Launch],
        log_dir: Path,
        *,
        attempts: int = 3,
        health_path: str = "/health",
    ) -> None:
        self.name = name
        self.plan = plan
        self.log_path = Path(log_dir) / f"{name}.log"
        self.attempts = attempts
        self.health_path = health_path
        self.launch: Launch | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_s: float | None = None  # seconds from the last start to healthy
        self.tries = 0
        self._log: IO[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.launch is None:
            raise RuntimeError(f"{self.name} has not been started")
        return self.launch.url

    def start(self) -> None:
        """Launch (or relaunch) the process with a fresh plan; does not wait."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        self.tries += 1
        self.launch = self.plan()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._close_log()
        # a relaunch appends, so the log keeps why the previous try died
        self._log = open(self.log_path, "ab" if self.tries > 1 else "wb")
        header = f"# {self.name} try {self.tries}: {' '.join(self.launch.argv)}\n"
        self._log.write(header.encode())
        self._log.flush()
        self.started_at = time.monotonic()
        self.ready_s = None
        self.proc = subprocess.Popen(
            self.launch.argv,
            env={**os.environ, **self.launch.env},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        _live.add(self)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        status, _ = http_get(self.url + self.health_path, timeout_s=2.0)
        return status == 200

    def poll_ready(self) -> bool:
        """One readiness check: True once healthy; raises if the process is gone.

        A process that died because a port was taken is relaunched on fresh ports while
        tries are left (then this returns False and the caller keeps polling).
        """
        if self.ready_s is not None:
            return True
        assert self.proc is not None
        if self.proc.poll() is not None:
            code = self.proc.returncode
            taken = self._port_was_taken()
            if self.tries < self.attempts and taken:
                print(f"{self.name}: {self._holder()}; relaunching", file=sys.stderr)
                self.stop()
                self.start()
                return False
            why = f" ({self._holder()})" if taken else ""
            raise ServiceError(self, f"exited with code {code} before it was healthy{why}")
        if self.launch is not None and not self.launch.read_port():
            return False  # not bound yet
        if self.healthy():
            self.ready_s = time.monotonic() - self.started_at
            return True
        return False

    def wait_ready(self, timeout_s: float) -> None:
        start_all([self], timeout_s, started=True)

    def stop(self, timeout_s: float = 20.0) -> None:
        stop_all([self], timeout_s)

    def _holder(self) -> str:
        """The port it found taken and who holds it, in words (the process may have died
        of another of its ports, e.g. a NixlConnector side channel: its log says which)."""
        if self.launch is None or not self.launch.port:
            return "a port was taken"
        where = f"{self.launch.host}:{self.launch.port}"
        return f"a port was taken (HTTP port {where}: {port_holder(self.launch.port)})"

    def _port_was_taken(self) -> bool:
        tail = self.log_tail(200)
        return any(marker in tail for marker in PORT_IN_USE_MARKERS)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        text = data[-200_000:].decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def error_lines(self, limit: int = 3) -> list[str]:
        """The last distinct lines of the log that name an exception (``...Error: ...``)."""
        found: dict[str, str] = {}  # message (log prefix dropped) -> line
        for line in reversed(self.log_tail(2000).splitlines()):
            text = line.strip()
            message = text.split("] ", 1)[-1]
            if _EXCEPTION_LINE.search(text) and message not in found:
                found[message] = text
                if len(found) == limit:
                    break
        return list(found.values())[::-1]

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.launch.url if self.launch else "not started"
        state = "alive" if self.alive() else "stopped"
        return f"Service({self.name}, {where}, {state})"


# -- groups ------------------------------------------------------------------------------

_live: set[Service] = set()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launching process dies, however it dies
    (a killed test run must not leave servers behind; atexit covers normal exits only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start_all(
    services: Sequence[Service],
    timeout_s: float,
    *,
    started: bool = False,
    poll_s: float = 0.5,
    on_ready: Callable[[Service], None] | None = None,
) -> None:
    """Start ``services`` together and wait until every one answers its health check.

    Raises :class:`ServiceError` for the first one that dies, or for those still not
    healthy after ``timeout_s`` (naming what was waited for); the caller stops them.
    """
    if not started:
        for svc in services:
            svc.start()
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    while pending:
        for svc in list(pending):
            if svc.poll_ready():
                pending.remove(svc)
                if on_ready is not None:
                    on_ready(svc)
        if not pending:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(f"{s.name} ({s.url}{s.health_path})" for s in pending)
            raise ServiceError(
                pending[0], f"not healthy after {timeout_s:.0f} s; still waiting for {names}"
            )
        time.sleep(poll_s)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: ask the kernel whether the group has anyone at all
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_all(services: Iterable[Service], timeout_s: float = 20.0) -> None:
    """SIGTERM every service's process group, wait up to ``timeout_s``, SIGKILL the rest."""
    services = list(services)
    groups: dict[int, Service] = {}
    for svc in services:
        if svc.proc is not None:
            groups[svc.proc.pid] = svc  # start_new_session: pgid == pid
            _signal_group(svc.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    remaining = dict(groups)
    while remaining and time.monotonic() < deadline:
        for pgid, svc in list(remaining.items()):
            assert svc.proc is not None
            svc.proc.poll()  # reap the leader so it does not linger as a zombie
            if not _group_members(pgid):
                del remaining[pgid]
        if remaining:
            time.sleep(0.1)
    for pgid, svc in remaining.items():
        _signal_group(pgid, signal.SIGKILL)
        assert svc.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            svc.proc.wait(timeout=5)
    for svc in groups.values():
        svc._close_log()
        _live.discard(svc)
    for svc in services:
        svc._close_log()


def stop_everything() -> None:
    """Stop every service this process started and has not stopped (atexit hook)."""
    if _live:
        stop_all(list(_live), timeout_s=10.0)


atexit.register(stop_everything)
