"""What a spin-wait on ``os.sched_yield`` gets of a core it shares with a busy thread.

vLLM's engine core and workers wait for each other between steps by spinning on
``os.sched_yield`` (``vllm.distributed.utils.sched_yield``). Under Linux's EEVDF scheduler
(the default since 6.6) a thread that yields hands its core to any busy thread there almost
entirely, so an engine whose core is shared notices its next step late, and so does every
connector call of that step. kvbridge's vLLM adapter switches that wait to
``time.sleep(0)`` (``kvbridge.connector.vllm.spin_wait``). This script pins two processes
to one core for ``--seconds``: a busy loop, and a waiter that spins with one primitive and
does a little Python work per turn, as vLLM's wait does; it prints, per primitive, the
CPU each got and the waiter's share against a fair half::

    .venv/bin/python scripts/experiments/measure_sched_yield.py [--seconds 3] [--cpu 0]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import time


def _busy(cpu: int, seconds: float, out: mp.Queue) -> None:
    os.sched_setaffinity(0, {cpu})
    t0, end = time.process_time(), time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    out.put(("busy", time.process_time() - t0, 0))


def _waiter(cpu: int, seconds: float, kind: str, out: mp.Queue) -> None:
    os.sched_setaffinity(0, {cpu})
    wait = os.sched_yield if kind == "sched_yield" else (lambda: time.sleep(0))
    t0, end, turns = time.process_time(), time.monotonic() + seconds, 0
    while time.monotonic() < end:
        wait()
        turns += 1
    out.put((kind, time.process_time() - t0, turns))


def measure(kind: str, cpu: int, seconds: float) -> dict[str, tuple[float, int]]:
    out: mp.Queue = mp.Queue()
    procs = [
        mp.Process(target=_busy, args=(cpu, seconds, out)),
        mp.Process(target=_waiter, args=(cpu, seconds, kind, out)),
    ]
    for p in procs:
        p.start()
    got = {name: (cpu_s, turns) for name, cpu_s, turns in (out.get() for _ in procs)}
    for p in procs:
        p.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--cpu", type=int, default=0)
    args = ap.parse_args()
    print(f"Linux {platform.release()}, both processes on CPU {args.cpu}, {args.seconds:g} s")
    print(
        f"{'waiter spins on':<16} {'busy CPU s':>10} {'waiter CPU s':>12} {'waiter turns':>12} "
        f"{'waiter / fair half':>18}"
    )
    for kind in ("sched_yield", "sleep0"):
        got = measure(kind, args.cpu, args.seconds)
        busy_s, (wait_s, turns) = got["busy"][0], got[kind]
        share = wait_s / ((busy_s + wait_s) / 2) if busy_s + wait_s else 0.0
        label = "os.sched_yield" if kind == "sched_yield" else "time.sleep(0)"
        print(f"{label:<16} {busy_s:>10.2f} {wait_s:>12.2f} {turns:>12,} {share:>18.2f}")


if __name__ == "__main__":
    main()
