"""Who holds a TCP port: for bind errors that name the culprit, not just the port.

Linux only, from procfs, no privileges needed for this user's processes::

    /proc/net/tcp, tcp6    local address (hex ip:port), state (0A = LISTEN), socket inode
    /proc/<pid>/fd/*       links "socket:[<inode>]" -> the process holding that socket

Another user's process shows its socket but not its descriptors: the answer then says so.
Anything unreadable gives a vaguer answer, never an exception (this runs while reporting
another error).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_LISTEN = "0A"
_PROC = Path("/proc")


def _socket_inodes(port: int, proc: Path) -> tuple[list[int], list[int]]:
    """Inodes of the TCP sockets bound to ``port``: (listening, in any other state)."""
    listening, other = [], []
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or int(fields[1].rsplit(":", 1)[1], 16) != port:
                continue
            inode = int(fields[9])
            if inode:  # 0: TIME_WAIT and other sockets no process owns any more
                (listening if fields[3] == _LISTEN else other).append(inode)
    return listening, other


def _links(fd_dir: Path) -> set[str]:
    """What a process's descriptors point at; empty for another user's process."""
    try:
        fds = list(fd_dir.iterdir())
    except OSError:  # gone meanwhile, or another user's
        return set()
    links = set()
    for fd in fds:
        try:
            links.add(os.readlink(fd))
        except OSError:  # closed meanwhile (its threads keep running)
            continue
    return links


def _holders(inodes: set[int], proc: Path) -> list[int]:
    """The pids of the processes holding one of ``inodes``."""
    wanted = {f"socket:[{i}]" for i in inodes}
    return sorted(
        int(entry.name)
        for entry in proc.iterdir()
        if entry.name.isdigit() and _links(entry / "fd") & wanted
    )


def _owners(inodes: set[int], proc: Path) -> list[str]:
    """``pid N (command line)`` of every process holding one of ``inodes``."""
    found = []
    for pid in _holders(inodes, proc):
        try:
            argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
            words = " ".join(a.decode(errors="replace") for a in argv if a).split()
            cmd = " ".join(words)[:200]
        except OSError:
            cmd = "?"
        found.append(f"pid {pid} ({cmd})")
    return found


def listening_pids(port: int, *, proc: Path = _PROC) -> list[int]:
    """The pids of this user's processes listening on TCP ``port`` (empty: none visible)."""
    listening, _ = _socket_inodes(port, proc)
    return _holders(set(listening), proc) if listening else []


def port_holder(port: int, *, proc: Path = _PROC) -> str:
    """Who holds TCP ``port`` on this machine, in words."""
    if not port:
        return "no fixed port was asked for"
    try:
        listening, other = _socket_inodes(port, proc)
        inodes = set(listening or other)
        if not inodes:
            return f"no socket on port {port} is visible now (released meanwhile?)"
        owners = _owners(inodes, proc)
    except OSError as exc:
        return f"its holder could not be looked up ({exc})"
    what = "listening" if listening else "bound"
    if owners:
        return f"held by {', '.join(owners)} ({what})"
    return f"a socket is {what} there, owned by a process this user cannot inspect"


def bind_error_text(what: str, host: str, port: int, exc: BaseException) -> str:
    """``cannot bind <what> to host:port: <exc>; held by pid N (...)``."""
    text = f"cannot bind {what} to {host}:{port}: {exc}"
    in_use = getattr(exc, "errno", None) == errno.EADDRINUSE or "in use" in str(exc)
    if in_use:
        text += f"; {port_holder(port)}"
    return text
