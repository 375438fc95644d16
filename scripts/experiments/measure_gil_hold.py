"""How long a kvbridge thread can be kept from running by the engine's forward: the GIL.

kvbridge's worker runs inside the engine's process: its idle-progress thread (and the
engine's own calls into it) need Python's GIL. A thread waiting for the GIL gets it within
the switch interval (5 ms) from a thread running Python code, and at once from one inside
a native call that releases it; but a native call that keeps the GIL keeps every other
thread out until it returns. This script runs, in the main thread, the same kind of work
a vLLM forward does, while a side thread wakes every 1 ms and records its worst gap:

    eager     torch matmul (ATen releases the GIL in its ops)
    compiled  an Inductor-compiled C++ kernel (what vLLM's default torch.compile mode runs
              on CPU): the generated kernel is called with the GIL held

and prints, per kind, the op's time, the side thread's worst gap and their ratio (a gap
close to the op's time: the GIL was held throughout). Used for docs/handover.md::

    .venv/bin/python scripts/experiments/measure_gil_hold.py [--size 6000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import torch


def worst_gap(work: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(seconds per call of ``work``, the side thread's worst wake-up gap in seconds)."""
    stop = threading.Event()
    worst = [0.0]

    def tick() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)  # the measurement itself: how late a 1 ms wake-up comes
            worst[0] = max(worst[0], time.perf_counter() - t)

    side = threading.Thread(target=tick, daemon=True)
    side.start()
    t0 = time.perf_counter()
    for _ in range(repeat):
        work()
    per_call = (time.perf_counter() - t0) / repeat
    stop.set()
    side.join(timeout=10.0)
    return per_call, worst[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=6000, help="square tensor side")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.size, args.size)
    a = torch.randn(args.size // 2, args.size // 2)
    kernel = torch.compile(lambda t: ((t * 2).sin() * t.cos()).sum(dim=1))
    kernel(x)  # compile once, outside the measurement
    rows = {
        "eager matmul (releases the GIL)": lambda: a @ a,
        "Inductor C++ kernel (torch.compile)": lambda: kernel(x),
    }
    print(f"{'main thread runs':40} {'op ms':>8} {'side thread worst gap ms':>25} {'gap / op':>9}")
    for name, work in rows.items():
        op_s, gap_s = worst_gap(work, args.repeat)
        print(f"{name:40} {op_s * 1e3:8.1f} {gap_s * 1e3:25.1f} {gap_s / op_s:9.2f}")


if __name__ == "__main__":
    main()
