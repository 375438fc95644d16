"""kvbridge's example servers on the two hosts of a :class:`~kvbridge.examples.netns.Link`.

:class:`HostCluster` is :class:`kvbridge.examples.launch.Cluster` with prefill in the ``p``
namespace (HTTP and side channel on its link address: ``--host`` and ``kv_ip``) and decode
and the front door in ``d``; UCX in each is told to use TCP on its end of the link. Every
HTTP call a test makes to a server runs inside that server's namespace.
:meth:`HostCluster.restart_in_place` restarts a worker on the same address, ports and
``engine_id`` (what an operator's restart looks like to its peers), leaving the front
door as it is.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field, fields

from kvbridge.connector.common.metrics import parse_metrics
from kvbridge.examples.check import complete
from kvbridge.examples.launch import Cluster, Proc, worker_args
from kvbridge.examples.netns import Link
from tests.verified_loads import verifying

SIDE = {"prefill": "p", "decode": "d", "router": "d"}


def front_door_argv(link: Link, prefill_url: str, decode_url: str) -> list[str]:
    """vllm-router beside decode, on decode's loopback; it reaches prefill (and
    health-checks it) at prefill's link address."""
    return link.argv(
        "d",
        sys.executable, "-m", "kvbridge.examples.router", "--host", "127.0.0.1", "--port", "0",
        "--prefill", prefill_url, "--decode", decode_url, "--health-check-interval", "1",
    )  # fmt: skip


@dataclass
class HostProc(Proc):
    """A server process whose HTTP calls from the test run in its namespace."""

    link: Link | None = None
    side: str = "d"

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        with self._inside():
            super().wait_healthy(timeout_s)

    def metrics(self) -> dict[str, float]:
        with self._inside():
            return super().metrics()

    def wait_all_free(self, timeout_s: float) -> None:
        with self._inside():
            super().wait_all_free(timeout_s)

    def _inside(self):
        assert self.link is not None
        return self.link.inside(self.side)


@dataclass
class HostCluster(Cluster):
    link: Link | None = None
    extra_args: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.link is not None
        self.prefill_kv = {"kv_ip": self.link.ip["p"], **self.prefill_kv}
        # decode verifies every load unless the test chose (tests/verified_loads.py)
        self.decode_kv = verifying({"kv_ip": self.link.ip["d"], **self.decode_kv})
        super().__post_init__()
        for name, p in list(self.procs.items()):
            values = {f.name: getattr(p, f.name) for f in fields(Proc)}
            self.procs[name] = HostProc(**values, link=self.link, side=SIDE[name])

    def _worker_argv(self, kv: dict, block_size: int, extra: list[str]) -> list[str]:
        assert self.link is not None
        role = "prefill" if kv["kv_role"] == "kv_producer" else "decode"
        side = SIDE[role]
        server = [sys.executable, "-m", "kvbridge.examples.server"]
        server += ["--host", self.link.ip[side], "--port", "0"]
        args = worker_args(role, kv, block_size, model=self.model, device=self.device)
        return self.link.argv(side, *server, *args, *extra)

    def _router_argv(self) -> list[str]:
        assert self.link is not None
        return front_door_argv(self.link, self.procs["prefill"].url, self.procs["decode"].url)

    def restart_in_place(self, name: str) -> None:
        """SIGKILL worker ``name`` and start it again on the ports it had, with the same
        ``engine_id`` (a new process: a new NIXL agent, new registrations)."""
        p = self.procs[name]
        port, kv_port = p.ready["port"], p.ready["kv_port"]
        argv = list(p.argv)
        argv[argv.index("--port") + 1] = str(port)
        i = argv.index("--kv-transfer-config") + 1
        argv[i] = json.dumps({**json.loads(argv[i]), "kv_port": kv_port})
        p.kill()
        p.argv = argv
        p.start()
        p.wait_healthy()
        assert (p.ready["port"], p.ready["kv_port"]) == (port, kv_port), p.ready
        self.wait_routed(name)

    def wait_routed(self, name: str, timeout_s: float = 30.0) -> None:
        """Until the router counts worker ``name`` healthy again (its
        ``vllm_router_worker_health`` gauge: it marks a worker down after failed health
        checks and up after two that pass, at the one-second interval it was given)."""
        assert self.link is not None
        router = self.procs["router"]
        url = f"http://127.0.0.1:{router.ready['metrics_port']}/metrics"
        key = f'vllm_router_worker_health{{worker="{self.procs[name].url}"}}'
        deadline = time.monotonic() + timeout_s
        with self.link.inside("d"):
            while True:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    health = parse_metrics(resp.read().decode()).get(key)
                if health == 1:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the router did not count {name} healthy in {timeout_s} s")
                time.sleep(0.2)  # polling the router's gauge; bounded by the deadline

    def complete(self, name: str, body: dict, timeout_s: float = 60.0) -> dict:
        assert self.link is not None
        with self.link.inside(SIDE[name]):
            return complete(self.procs[name].url, body, timeout_s)
