"""Whether posting adjacent runs as one descriptor each pays: the cost of one engine.read()
by index (MergeRuns.OFF) against by runs (MergeRuns.ON), for transfers of ``rows`` rows
in ``runs`` runs. The measurement behind the default ``MergeRuns.OFF``
(kvbridge.connector.transfer.nixl_config).

Two NixlTransferEngines in this process; 64-byte descriptors so that the copy itself is
small next to the post. Each figure is the median of ``--iterations`` read() calls (the
default UCX transport copies inside the post) plus the handle's release, after a warm-up;
the two engines take turns, so both see the same load on a shared machine.
Both engines also check the bytes moved once per case.

Run:  .venv/bin/python scripts/experiments/bench_merge_rule.py [--iterations 41]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import numpy as np
import torch

from kvbridge.connector.transfer.nixl_engine import MergeRuns, NixlEngineConfig, NixlTransferEngine
from kvbridge.connector.transfer.transport import DescList, XferState

DESC_BYTES = 64
TIMEOUT_S = 10.0
NUM_ROWS = 1 << 16
CASES = [  # (rows, runs)
    (128, 1),
    (1024, 1),
    (4096, 1),
    (4096, 64),
    (16384, 1),
    (16384, 256),
    (16384, 2048),
    (32768, 1),
    (32768, 512),
    (32768, 4096),
]


def table(t: torch.Tensor) -> np.ndarray:
    out = np.zeros((NUM_ROWS, 3), dtype=np.int64)
    out[:, 0] = t.data_ptr() + np.arange(NUM_ROWS) * DESC_BYTES
    out[:, 1] = DESC_BYTES
    return out


def rows_in_runs(rows: int, runs: int) -> np.ndarray:
    """``rows`` row ids in ``runs`` equal runs, one row skipped between runs."""
    per = rows // runs
    starts = np.arange(runs) * (per + 1)
    return (starts[:, None] + np.arange(per)[None, :]).reshape(-1)


class Side:
    def __init__(self, merge: MergeRuns, src: torch.Tensor, prefill: NixlTransferEngine) -> None:
        self.dst = torch.zeros_like(src)
        self.engine = NixlTransferEngine(
            NixlEngineConfig(agent_name=f"rule-{merge.value}-{uuid.uuid4().hex[:6]}", merge=merge)
        )
        self.engine.register([self.dst])
        peer = self.engine.add_peer(prefill.metadata())
        self.local: DescList = self.engine.prep_local(table(self.dst))
        self.remote: DescList = self.engine.prep_remote(peer, table(src))

    def post_us(self, idx: np.ndarray, prefill: NixlTransferEngine) -> tuple[float, int]:
        t0 = time.perf_counter()
        handle = self.engine.read(self.local, idx, self.remote, idx)
        deadline = t0 + TIMEOUT_S
        # in one process the first READ to a peer also needs the peer driven (wire-up)
        while self.engine.poll(handle) is XferState.PENDING:
            prefill.get_notifs()
            if time.perf_counter() > deadline:
                raise SystemExit(f"{handle!r} not done within {TIMEOUT_S} s")
        took = time.perf_counter() - t0
        handle.release()
        return took * 1e6, handle.num_descs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iterations", type=int, default=41)
    args = ap.parse_args()
    src = torch.randint(0, 256, (NUM_ROWS, DESC_BYTES), dtype=torch.uint8)
    prefill = NixlTransferEngine(NixlEngineConfig(agent_name=f"rule-P-{uuid.uuid4().hex[:6]}"))
    prefill.register([src])
    sides = {m: Side(m, src, prefill) for m in (MergeRuns.OFF, MergeRuns.ON)}
    print(f"{'rows':>6} {'runs':>6} {'by index us':>12} {'by runs us':>11} {'runs/index':>10}")
    try:
        for rows, runs in CASES:
            idx = rows_in_runs(rows, runs)
            samples: dict[MergeRuns, list[float]] = {m: [] for m in sides}
            for side in sides.values():
                side.post_us(idx, prefill)  # warm-up
                side.dst.zero_()
            for _ in range(args.iterations):  # interleaved: both see the same machine load
                for merge, side in sides.items():
                    us, descs = side.post_us(idx, prefill)
                    samples[merge].append(us)
                    expected = runs if merge is MergeRuns.ON else rows
                    assert descs == expected, (merge, descs, expected)
            for merge, side in sides.items():
                assert torch.equal(side.dst[idx], src[idx]), f"{merge}: bytes differ"
            got = {m: statistics.median(v) for m, v in samples.items()}
            off, on = got[MergeRuns.OFF], got[MergeRuns.ON]
            print(f"{rows:>6} {runs:>6} {off:>12.1f} {on:>11.1f} {on / off:>10.2f}", flush=True)
    finally:
        for side in sides.values():
            side.engine.close()
        prefill.close()


if __name__ == "__main__":
    main()
