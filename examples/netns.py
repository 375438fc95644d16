"""Two "hosts" on one machine: network namespaces joined by a veth pair.

::

    ns kvbmh-<pid>-<n>-p                    ns kvbmh-<pid>-<n>-d
    prefill   10.231.<n>.1  <== veth ==>  10.231.<n>.2   decode, router

The addresses exist only inside the two namespaces. Both ends of the link carry a ``tbf``
qdisc: ``rate`` limits it, :meth:`Link.cut` turns it into a partition that drops every
packet silently (a tbf whose bucket holds less than one packet; this kernel has no netem
and no drop action) while interfaces, addresses and routes stay up, as when a switch
between two hosts fails, and :meth:`Link.heal` restores the rate. :meth:`Link.inside`
runs the calling thread in a namespace (``setns``: network namespaces are per thread), so
a test reaches the servers with ordinary sockets. :meth:`Link.close` removes both
namespaces (and the link with them); namespaces left by a killed run of this module (its
pid gone) are removed by the next one.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

CLONE_NEWNET = 0x40000000
PREFIX = "kvbmh"
_serial = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)


def unavailable() -> str:
    """Why namespaces cannot be used here ('' when they can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"{PREFIX}-{os.getpid()}-probe"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()}"
    try:  # what a Link needs inside it: a veth pair and a tbf qdisc
        for argv in (
            ["ip", "link", "add", "name", "a", "type", "veth", "peer", "name", "b"],
            ["tc", "qdisc", "add", "dev", "a", "root", "tbf", "rate", "1gbit", "burst", "64kb",
             "limit", "200000"],
        ):  # fmt: skip
            step = subprocess.run(
                ["ip", "netns", "exec", name, *argv], capture_output=True, text=True
            )
            if step.returncode != 0:
                return f"{' '.join(argv[:3])} failed in a namespace: {step.stderr.strip()}"
        return ""
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def remove_stale() -> None:
    """Remove namespaces this module made in runs whose process is gone."""
    for line in _ip("netns", "list").splitlines():
        m = re.match(rf"({PREFIX}-(\d+)-\S+)", line)
        if m and not os.path.exists(f"/proc/{m[2]}"):
            subprocess.run(["ip", "netns", "del", m[1]], capture_output=True)


class Link:
    """Prefill's host ``"p"`` and decode's host ``"d"``, and the link between them."""

    def __init__(self, rate: str = "", ucx_env: dict[str, str] | None = None) -> None:
        n = next(_serial)
        base = f"{PREFIX}-{os.getpid()}-{n}"
        self.ns = {"p": f"{base}-p", "d": f"{base}-d"}
        self.dev = {
            "p": f"kvbmh{os.getpid() % 100000}{n}p",
            "d": f"kvbmh{os.getpid() % 100000}{n}d",
        }
        subnet = f"10.231.{n % 250}"
        self.ip = {"p": f"{subnet}.1", "d": f"{subnet}.2"}
        self.rate = ""
        self.ucx_env = {"UCX_TLS": "tcp", **(ucx_env or {})}
        self._made: list[str] = []
        try:
            self._create(rate)
        except BaseException:
            self.close()
            raise

    def _create(self, rate: str) -> None:
        remove_stale()
        for side in "pd":
            _ip("netns", "add", self.ns[side])
            self._made.append(self.ns[side])
        p, d = self.dev["p"], self.dev["d"]
        _ip("link", "add", p, "netns", self.ns["p"], "type", "veth",
            "peer", "name", d, "netns", self.ns["d"])  # fmt: skip
        for side in "pd":
            self.run(side, "ip", "addr", "add", f"{self.ip[side]}/24", "dev", self.dev[side])
            self.run(side, "ip", "link", "set", "lo", "up")
            self.run(side, "ip", "link", "set", self.dev[side], "up")
        self.set_rate(rate or "10gbit")

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in ("ns", "dev", "ip", "rate", "ucx_env")})

    @classmethod
    def attach(cls, text: str) -> Link:
        """The link another process made (from its :meth:`to_json`); closing it here
        removes nothing: the process that made it owns it."""
        link = cls.__new__(cls)
        link.__dict__.update(json.loads(text), _made=[])
        return link

    def run(self, side: str, *argv: str) -> str:
        """Run ``argv`` in ``side``'s namespace; its stdout (raises on failure)."""
        return _ip("netns", "exec", self.ns[side], *argv)

    def argv(self, side: str, *argv: str) -> list[str]:
        """``argv`` as a command line run in ``side``'s namespace, UCX on its end of the
        link (TCP: the bytes cross it; plus ``ucx_env``)."""
        env = ["env", f"UCX_NET_DEVICES={self.dev[side]}"]
        env += [f"{k}={v}" for k, v in self.ucx_env.items()]
        return ["ip", "netns", "exec", self.ns[side], *env, *argv]

    def _tbf(self, rate: str, burst: int, limit: int) -> None:
        for side in "pd":
            self.run(side, "tc", "qdisc", "replace", "dev", self.dev[side], "root", "tbf",
                     "rate", rate, "burst", str(burst), "limit", str(limit))  # fmt: skip

    def set_rate(self, rate: str) -> None:
        """A ``tbf`` limit on both ends (burst: 4 ms of the rate, at least 16 KB)."""
        bits = _bits(rate)
        burst = max(16000, int(bits / 8 * 0.004))
        self._tbf(rate, burst, max(burst * 4, 200_000))
        self.rate = rate

    def cut(self) -> None:
        """Drop every packet both ways from now on; nothing else changes."""
        self._tbf("8bit", 64, 64)  # a bucket smaller than any packet: all are dropped

    def heal(self) -> None:
        self.set_rate(self.rate)

    def tx_bytes(self, side: str) -> int:
        """Bytes ``side``'s end of the link handed to the wire so far (tc's count)."""
        return self.tx_stats(side)[0]

    def tx_stats(self, side: str) -> tuple[int, int]:
        """(bytes sent, packets dropped) by ``side``'s end of the link so far (tc's count:
        a rate change or a heal starts them again)."""
        out = self.run(side, "tc", "-s", "qdisc", "show", "dev", self.dev[side])
        m = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+)", out)
        assert m, out
        return int(m[1]), int(m[2])

    @contextmanager
    def inside(self, side: str) -> Iterator[None]:
        """The calling thread in ``side``'s namespace (its sockets are made there)."""
        with (
            open(f"/run/netns/{self.ns[side]}") as target,
            open("/proc/thread-self/ns/net") as home,
        ):
            _setns(target.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    def close(self) -> None:
        for name in self._made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. 500mbit, 1gbit")
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
