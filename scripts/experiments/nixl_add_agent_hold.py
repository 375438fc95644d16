"""How long NIXL's ``add_remote_agent`` (``nixlAgent::loadRemoteMD``) can hold its caller.

kvbridge adds remote agents from the engine's step thread; in CI the call held it for
17-98 s. This script reproduces the suspected conditions with real processes and prints,
per scenario, how long side A's calls took:

    add          add_remote_agent(B)   (UCX creates its endpoint to B here)
    notif        send_notif(B)
    connect      make_connection(B)
    read         a 4 KiB READ from B: post, then poll until DONE/ERR (own deadline)

and, during each call, (1) the worst gap of a pure-Python counter thread (a gap close to
the call's time: some thread kept the GIL), (2) the slowest call of a second thread that
keeps calling ``get_new_notifs``/``check_xfer_state`` on a transfer to a healthy third peer
C (slow: the held call blocks the agent's other callers). When a call is still running
after ``--dump-after`` seconds, the native stack of side A is saved (``py-spy dump
--native``) next to the results.

Scenarios (``--scenario``):

    concurrent  B healthy; A and B add each other at the same moment (loopback)
    frozen      B SIGSTOPped after publishing its metadata, before A adds it
    idle        B alive, progress thread off, never calls NIXL; ``--fan-in`` A processes
                add it at once
    blackhole   A (and C) in one network namespace, B in another; B's namespace drops
                every incoming packet (iptables DROP): connect() gets no answer at all
    gil         blackhole set-up; while one thread of A is held in add_remote_agent(B),
                the main thread calls each other NIXL call once: does it wait for the
                agent's lock, and does it keep the GIL meanwhile?

Each runs with ``UCX_TCP_CONN_NB`` = n (UCX's default) and y, ``--tls`` tcp or default
(UCX picks). Needs root for the namespaces and ``py-spy`` for stacks. Run::

    .venv/bin/python scripts/experiments/nixl_add_agent_hold.py \\
        --scenario concurrent frozen idle blackhole --conn-nb n y --tls tcp default

Every process is started by this script and killed at the end (and the namespaces
deleted), also when a call never returns (``--hard-timeout``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NS_A, NS_B = "kvbhold_a", "kvbhold_b"
IP_A, IP_B = "10.77.0.1", "10.77.0.2"
BUF_BYTES = 4 << 20
SMALL = 4096


# --------------------------------------------------------------------------- helpers


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {path}")
        time.sleep(0.01)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f"{path.suffix}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def new_agent(name: str, strict: bool) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if strict else None
    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=sync)
    return nixl_agent(name, cfg)


def register(agent: Any, size: int) -> tuple[Any, int]:
    import numpy as np

    buf = np.ones(size, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    return buf, buf.ctypes.data


def publish(agent: Any, workdir: Path, name: str, addr: int) -> None:
    write_atomic(workdir / f"{name}.desc", json.dumps({"addr": addr}).encode())
    write_atomic(workdir / f"{name}.md", agent.get_agent_metadata())


def read_peer(workdir: Path, name: str, timeout: float = 60.0) -> tuple[bytes, int]:
    wait_for(workdir / f"{name}.md", timeout)
    desc = json.loads((workdir / f"{name}.desc").read_text())
    return (workdir / f"{name}.md").read_bytes(), int(desc["addr"])


def wait_barrier(workdir: Path, timeout: float = 120.0) -> None:
    wait_for(workdir / "barrier", timeout)
    at = float((workdir / "barrier").read_text())
    time.sleep(max(0.0, at - time.time()))


def serve(agent: Any, workdir: Path, seconds: float) -> None:
    """A healthy peer: polls its agent every millisecond (kvbridge's idle progress)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (workdir / "stop").exists():
        agent.get_new_notifs()
        time.sleep(0.001)


# --------------------------------------------------------------------------- peers B, C


def run_peer(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    agent = new_agent(args.name, strict=False)
    _buf, addr = register(agent, BUF_BYTES)
    publish(agent, workdir, args.name, addr)
    if args.mode == "idle":  # never calls NIXL again: only UCX's own async thread runs
        deadline = time.monotonic() + args.lifetime
        while time.monotonic() < deadline and not (workdir / "stop").exists():
            time.sleep(0.05)
        return
    if args.mode == "add":  # adds A at the barrier, as A adds it
        md, _ = read_peer(workdir, args.peer)
        write_atomic(workdir / f"{args.name}.ready", b"1")
        wait_barrier(workdir)
        t0 = time.perf_counter()
        agent.add_remote_agent(md)
        took = time.perf_counter() - t0
        write_atomic(workdir / f"{args.name}.result.json", json.dumps({"add_s": took}).encode())
    serve(agent, workdir, args.lifetime)


# --------------------------------------------------------------------------- side A


class Watch:
    """The counter thread (GIL) and the probe thread (other NIXL calls on the agent)."""

    def __init__(self, agent: Any | None, c_name: str, c_addr: int, local_addr: int) -> None:
        self.stop = threading.Event()
        self.gaps: list[tuple[float, float]] = []
        self.probe_calls: list[tuple[str, float, float]] = []
        self.in_flight: tuple[str, float] | None = None
        self.agent, self.c_name, self.c_addr, self.local = agent, c_name, c_addr, local_addr
        self.threads = [threading.Thread(target=self._count, daemon=True)]
        if agent is not None:
            self.threads.append(threading.Thread(target=self._probe, daemon=True))
        for t in self.threads:
            t.start()

    def _count(self) -> None:
        last = time.perf_counter()
        n = 0
        while not self.stop.is_set():
            n += 1  # pure Python: runs only while this thread holds the GIL
            now = time.perf_counter()
            if now - last > 0.002:
                self.gaps.append((last, now))
            last = now

    def _timed(self, what: str, call: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        self.in_flight = (what, t0)  # a call that has not returned counts up to "now"
        try:
            return call()
        finally:
            self.in_flight = None
            self.probe_calls.append((what, t0, time.perf_counter()))

    def _probe(self) -> None:
        agent = self.agent
        assert agent is not None
        local = agent.get_xfer_descs([(self.local, BUF_BYTES, 0)], "DRAM")
        remote = agent.get_xfer_descs([(self.c_addr, BUF_BYTES, 0)], "DRAM")
        while not self.stop.is_set():
            h = agent.initialize_xfer("READ", local, remote, self.c_name)
            state = self._timed("transfer", lambda h=h: agent.transfer(h))
            while state == "PROC" and not self.stop.is_set():
                state = self._timed("check_xfer_state", lambda h=h: agent.check_xfer_state(h))
                self._timed("get_new_notifs", agent.get_new_notifs)
                time.sleep(0.001)
            self._timed("release_xfer_handle", lambda h=h: agent.release_xfer_handle(h))
            self._timed("get_new_notifs", agent.get_new_notifs)
            time.sleep(0.001)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        gap = max((min(b, t1) - max(a, t0) for a, b in self.gaps if b > t0 and a < t1), default=0)
        calls = list(self.probe_calls)
        if self.in_flight is not None:
            calls.append((self.in_flight[0], self.in_flight[1], time.perf_counter()))
        slow = [(min(b, t1) - max(a, t0), w) for w, a, b in calls if b > t0 and a < t1]
        worst = max(slow, default=(0.0, ""))
        return {
            "gil_gap_s": round(max(gap, 0.0), 4),
            "probe_worst_s": round(worst[0], 4),
            "probe_worst_call": worst[1],
            "probe_calls": len(slow),
        }


def run_side_a(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    out = workdir / f"{args.name}.json"
    agent = new_agent(args.name, strict=True)
    _buf, local = register(agent, BUF_BYTES)
    write_atomic(workdir / f"{args.name}.md", agent.get_agent_metadata())
    write_atomic(workdir / f"{args.name}.desc", json.dumps({"addr": local}).encode())
    c_md, c_addr = read_peer(workdir, "C")
    c_name = agent.add_remote_agent(c_md).decode()
    b_md, b_addr = read_peer(workdir, "B")
    watch = Watch(None if args.no_probe else agent, c_name, c_addr, local)
    time.sleep(0.3)  # the probe has a transfer to C in flight
    steps: list[dict[str, Any]] = []

    def step(what: str, call: Callable[[], Any]) -> Any:
        write_atomic(workdir / f"{args.name}.current", f"{what} {time.time()}".encode())
        t0 = time.perf_counter()
        result, error = None, ""
        try:
            result = call()
        except Exception as exc:  # NIXL's exceptions share no base class
            error = f"{type(exc).__name__}: {exc}"[:160]
        t1 = time.perf_counter()
        steps.append({"step": what, "s": round(t1 - t0, 4), "error": error, **watch.window(t0, t1)})
        write_atomic(out, json.dumps({"steps": steps}).encode())
        return result

    write_atomic(workdir / f"{args.name}.ready", b"1")
    wait_barrier(workdir)
    if args.gil:
        run_gil_rounds(agent, b_md, c_md, c_name, c_addr, local, watch, step)
    else:
        b_name = step("add", lambda: agent.add_remote_agent(b_md))
        b_name = b_name.decode() if b_name else "B"
        step("notif", lambda: agent.send_notif(b_name, b"hello"))
        step("connect", lambda: agent.make_connection(b_name))
        step("read", lambda: small_read(agent, b_name, b_addr, local, args.read_timeout))
        step("remove", lambda: agent.remove_remote_agent(b_name))
    watch.stop.set()
    write_atomic(workdir / f"{args.name}.current", b"done")
    os._exit(0)  # skip NIXL's teardown (it may wait on the unreachable peer)


def small_read(agent: Any, b_name: str, b_addr: int, local: int, timeout: float) -> str:
    loc = agent.get_xfer_descs([(local, SMALL, 0)], "DRAM")
    rem = agent.get_xfer_descs([(b_addr, SMALL, 0)], "DRAM")
    h = agent.initialize_xfer("READ", loc, rem, b_name)
    state = agent.transfer(h)
    deadline = time.monotonic() + timeout
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = agent.check_xfer_state(h)
    if state == "PROC":
        raise TimeoutError(f"READ still PROC after {timeout} s (handle left unreleased)")
    agent.release_xfer_handle(h)
    return state


def run_gil_rounds(
    agent: Any,
    b_md: bytes,
    c_md: bytes,
    c_name: str,
    c_addr: int,
    local: int,
    watch: Watch,
    step: Callable[[str, Callable[[], Any]], Any],
) -> None:
    """Per call: hold the agent in add_remote_agent(B) from a thread, then make the call."""
    loc = agent.get_xfer_descs([(local, SMALL, 0)], "DRAM")
    rem = agent.get_xfer_descs([(c_addr, SMALL, 0)], "DRAM")
    handles = [agent.initialize_xfer("READ", loc, rem, c_name) for _ in range(2)]
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("get_new_notifs", agent.get_new_notifs),
        ("check_xfer_state", lambda: agent.check_xfer_state(handles[0])),
        ("transfer", lambda: agent.transfer(handles[1])),
        ("send_notif", lambda: agent.send_notif(c_name, b"x")),
        ("make_connection", lambda: agent.make_connection(c_name)),
        ("release_xfer_handle", lambda: agent.release_xfer_handle(handles[0])),
        ("remove_remote_agent", lambda: agent.remove_remote_agent(c_name)),
        ("add_remote_agent(C)", lambda: agent.add_remote_agent(c_md)),
    ]
    for what, call in calls:

        def add_b() -> Any:
            return agent.add_remote_agent(b_md)

        holder = threading.Thread(target=step, args=(f"held add(B) [{what}]", add_b), daemon=True)
        holder.start()
        time.sleep(0.5)
        step(what, call)
        holder.join(timeout=200)
        with contextlib.suppress(Exception):
            agent.remove_remote_agent("B")


# --------------------------------------------------------------------------- orchestrator


def sh(cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, shell=True, check=check, capture_output=True, timeout=30)


def netns_up() -> None:
    netns_down()
    for cmd in (
        f"ip netns add {NS_A}",
        f"ip netns add {NS_B}",
        "ip link add kvbh_va type veth peer name kvbh_vb",
        f"ip link set kvbh_va netns {NS_A}",
        f"ip link set kvbh_vb netns {NS_B}",
        f"ip -n {NS_A} addr add {IP_A}/24 dev kvbh_va",
        f"ip -n {NS_B} addr add {IP_B}/24 dev kvbh_vb",
        f"ip -n {NS_A} link set kvbh_va up",
        f"ip -n {NS_B} link set kvbh_vb up",
        f"ip -n {NS_A} link set lo up",
        f"ip -n {NS_B} link set lo up",
    ):
        sh(cmd)


def blackhole_b() -> None:
    sh(f"ip netns exec {NS_B} iptables -A INPUT -i kvbh_vb -j DROP")


def netns_down() -> None:
    sh(f"ip netns del {NS_A}", check=False)
    sh(f"ip netns del {NS_B}", check=False)


def in_ns(ns: str | None, dev: str | None, env: dict[str, str]) -> tuple[list[str], dict]:
    e = dict(env)
    if dev:
        e["UCX_NET_DEVICES"] = dev
    return (["ip", "netns", "exec", ns] if ns else []), e


def stack_dump(pid: int, dest: Path) -> None:
    """Python stacks (py-spy) and native ones (gdb: py-spy does not unwind these libraries)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    gdb = ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"]
    with dest.open("wb") as f:
        for cmd in ([spy, "dump", "--native", "--pid", str(pid)], gdb):
            try:
                res = subprocess.run(cmd, capture_output=True, timeout=60)
                f.write(res.stdout + res.stderr)
            except (OSError, subprocess.TimeoutExpired) as exc:
                f.write(f"{cmd[0]} failed: {exc}\n".encode())


def run_scenario(
    scenario: str, conn_nb: str, tls: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    workdir = Path(tempfile.mkdtemp(prefix=f"hold_{scenario}_{conn_nb}_{tls}_"))
    env = dict(os.environ, UCX_TCP_CONN_NB=conn_nb, PYTHONUNBUFFERED="1")
    env.pop("UCX_TLS", None)
    if tls != "default":
        env["UCX_TLS"] = tls
    for kv in args.env:
        key, _, value = kv.partition("=")
        env[key] = value
    me = [sys.executable, os.path.abspath(__file__)]
    procs: dict[str, subprocess.Popen] = {}
    networked = scenario in ("blackhole", "gil")
    ns_a, ns_b = (NS_A, NS_B) if networked else (None, None)
    dev_a, dev_b = ("kvbh_va", "kvbh_vb") if networked else (None, None)

    def spawn(key: str, ns: str | None, dev: str | None, argv: list[str]) -> None:
        prefix, e = in_ns(ns, dev, env)
        log = open(workdir / f"{key}.log", "wb")
        procs[key] = subprocess.Popen([*prefix, *me, *argv], env=e, stdout=log, stderr=log)

    rows: list[dict[str, Any]] = []
    try:
        if networked:
            netns_up()
            blackhole_b()
        life = str(args.hard_timeout + 60)
        common = ["--workdir", str(workdir), "--lifetime", life]
        spawn("C", ns_a, dev_a, ["peer", "--name", "C", "--mode", "serve", *common])
        b_mode = {"concurrent": "add", "idle": "idle"}.get(scenario, "serve")
        spawn("B", ns_b, dev_b, ["peer", "--name", "B", "--mode", b_mode, "--peer", "A0", *common])
        fan = args.fan_in if scenario == "idle" else 1
        for i in range(fan):
            extra = ["--gil"] if scenario == "gil" else []
            extra += ["--no-probe"] if (i > 0 or args.no_probe or scenario == "gil") else []
            spawn(
                f"A{i}",
                ns_a,
                dev_a,
                ["side-a", "--name", f"A{i}", "--workdir", str(workdir), *extra,
                 "--read-timeout", str(args.read_timeout)],
            )  # fmt: skip
        ready = [f"A{i}.ready" for i in range(fan)] + (["B.ready"] if b_mode == "add" else [])
        for name in ready:
            wait_for(workdir / name, 90)
        if scenario == "frozen":
            procs["B"].send_signal(signal.SIGSTOP)
            time.sleep(0.2)
        write_atomic(workdir / "barrier", str(time.time() + 0.5).encode())
        deadline = time.monotonic() + args.hard_timeout
        dumped: set[str] = set()
        stacked: set[str] = set()  # gdb stops the process: gaps in these steps are not GIL
        a_keys = [f"A{i}" for i in range(fan)]
        while time.monotonic() < deadline and any(procs[k].poll() is None for k in a_keys):
            cur = workdir / "A0.current"
            if cur.exists() and procs["A0"].poll() is None:
                parts = cur.read_text().rsplit(" ", 1)
                if len(parts) == 2 and parts[0] not in dumped:
                    if time.time() - float(parts[1]) > args.dump_after:
                        dumped.add(parts[0])
                        tag = "".join(c if c.isalnum() else "_" for c in parts[0])
                        stack_dump(procs["A0"].pid, workdir / f"stack_{tag}.txt")
                        stacked.add(parts[0])
            time.sleep(0.2)
        for k in a_keys:
            res = workdir / f"{k}.json"
            steps = json.loads(res.read_text())["steps"] if res.exists() else []
            if procs[k].poll() is None:
                cur = (workdir / f"{k}.current").read_text().rsplit(" ", 1)[0]
                steps.append({"step": cur, "s": f">{args.hard_timeout}", "error": "never returned"})
            for s in steps:
                s["stack"] = "taken" if (k == "A0" and s["step"] in stacked) else ""
                rows.append({"scenario": scenario, "conn_nb": conn_nb, "tls": tls, "side": k, **s})
        b_res = workdir / "B.result.json"
        if b_res.exists():
            b_add = json.loads(b_res.read_text())["add_s"]
            rows.append({"scenario": scenario, "conn_nb": conn_nb, "tls": tls, "side": "B",
                         "step": "add", "s": round(b_add, 4)})  # fmt: skip
    finally:
        (workdir / "stop").touch()
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.kill()
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        if networked:
            netns_down()
        print(f"# {scenario} conn_nb={conn_nb} tls={tls}: files in {workdir}", flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["scenario", "conn_nb", "tls", "side", "step", "s", "gil_gap_s", "probe_worst_s",
            "probe_worst_call", "stack", "error"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="role")
    run = sub.add_parser("run", help="the orchestrator (default)")
    run.add_argument("--scenario", nargs="+", default=["concurrent", "frozen", "idle", "blackhole"])
    run.add_argument("--conn-nb", nargs="+", default=["n", "y"])
    run.add_argument("--tls", nargs="+", default=["tcp", "default"])
    run.add_argument("--env", nargs="*", default=[], help="extra KEY=VALUE for every process")
    run.add_argument("--fan-in", type=int, default=8, help="A processes in the idle scenario")
    run.add_argument("--hard-timeout", type=float, default=150.0)
    run.add_argument("--dump-after", type=float, default=4.0)
    run.add_argument("--read-timeout", type=float, default=20.0)
    run.add_argument("--no-probe", action="store_true")
    run.add_argument("--json", help="also write the rows here")
    peer = sub.add_parser("peer")
    peer.add_argument("--name", required=True)
    peer.add_argument("--mode", choices=["serve", "idle", "add"], default="serve")
    peer.add_argument("--peer", default="A0")
    peer.add_argument("--workdir", required=True)
    peer.add_argument("--lifetime", type=float, default=300.0)
    side = sub.add_parser("side-a")
    side.add_argument("--name", required=True)
    side.add_argument("--workdir", required=True)
    side.add_argument("--gil", action="store_true")
    side.add_argument("--no-probe", action="store_true")
    side.add_argument("--read-timeout", type=float, default=20.0)
    argv = sys.argv[1:]
    if not argv or argv[0] not in ("run", "peer", "side-a", "-h", "--help"):
        argv = ["run", *argv]
    args = ap.parse_args(argv)
    if args.role == "peer":
        run_peer(args)
        return
    if args.role == "side-a":
        run_side_a(args)
        return
    rows: list[dict[str, Any]] = []
    for scenario in args.scenario:
        for tls in args.tls:
            for conn_nb in args.conn_nb:
                rows += run_scenario(scenario, conn_nb, tls, args)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
