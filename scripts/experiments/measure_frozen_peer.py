"""What bounds a frozen (SIGSTOPped) NIXL peer over ``UCX_TLS=tcp``? Measures, not a test.

For each configuration (a set of UCX environment variables, given to both processes) a
fresh pair of processes: this one plays decode (a ``NixlTransferEngine`` with no progress
thread, as kvbridge's workers run), the child (``kvbridge.examples.nixl_peer``) plays
prefill: it registers ``--blocks`` x ``--block-kib`` of known bytes and drives NIXL from its
own loop. After a warm READ and a warm notification (the connection is up), the child is
SIGSTOPped; then::

    (a) one READ of every block is posted and polled until it raises, ends, or
        ``--window`` seconds pass (does NIXL/UCX ever fail a READ from a frozen peer?);
        the ``write`` configuration posts a WRITE into the frozen peer instead (push)
    (b) meanwhile a small notification goes out every ``--notif-every`` seconds
        (does ``send_notif`` to a frozen peer fail, and when?)
    (c) after the window a flood of 64 KiB notifications, up to ``--flood-mib``: does a
        send fail or block once the kernel's socket buffers are full? (and how much this
        process's peak RSS grew meanwhile: where the unsent ones wait)
    then SIGCONT: how long the transfer still takes once the peer runs again (and whether
    a READ's bytes are right).

The ``killed`` configuration SIGKILLs the child instead of stopping it: the control that
shows a failure is detected at all. Each configuration runs in its own subprocess of this
script (UCX reads its environment when a context is created; a fresh process keeps the
configurations apart) under a hard timeout, so a call that blocks shows as ``hung``.

Run:  .venv/bin/python scripts/experiments/measure_frozen_peer.py [--window 60] \\
          [--only default,ucp-ka]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# name -> (UCX variables on top of UCX_TLS=tcp, fault: kill | stop (READ) | stop-write)
CONFIGS: dict[str, tuple[dict[str, str], str]] = {
    "killed": ({}, "kill"),
    "default": ({}, "stop"),
    # push mode's direction: this side WRITEs into the frozen peer
    "write": ({}, "stop-write"),
    # UCP keepalive: every endpoint checked each second (uct_ep_check; for tcp a
    # keepalive message on the connection)
    "ucp-ka": ({"UCX_KEEPALIVE_INTERVAL": "1s", "UCX_KEEPALIVE_NUM_EPS": "inf"}, "stop"),
    # kernel TCP keepalive on UCX's sockets, as short as it goes
    "tcp-ka": (
        {"UCX_TCP_KEEPIDLE": "1s", "UCX_TCP_KEEPINTVL": "1s", "UCX_TCP_KEEPCNT": "2"},
        "stop",
    ),
    "both-ka": (
        {
            "UCX_KEEPALIVE_INTERVAL": "1s",
            "UCX_KEEPALIVE_NUM_EPS": "inf",
            "UCX_TCP_KEEPIDLE": "1s",
            "UCX_TCP_KEEPINTVL": "1s",
            "UCX_TCP_KEEPCNT": "2",
        },
        "stop",
    ),
}


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def run_one(args: argparse.Namespace) -> dict:
    """One configuration, in this process (its UCX variables already in the environment)."""
    import numpy as np
    import torch

    from kvbridge.connector.transfer.errors import TransferError
    from kvbridge.connector.transfer.nixl_engine import NixlEngineConfig, NixlTransferEngine
    from kvbridge.connector.transfer.transport import XferState, wait_done
    from kvbridge.examples.nixl_peer import Peer, block_bytes_of

    _, fault = CONFIGS[args.single]
    block_bytes, num_blocks = args.block_kib << 10, args.blocks
    out: dict = {"config": args.single, "bytes": block_bytes * num_blocks}
    log = Path(f"/tmp/measure_frozen_peer-{args.single}-{os.getpid()}.log")
    name = f"decode-{uuid.uuid4().hex[:8]}"
    with NixlTransferEngine(NixlEngineConfig(agent_name=name)) as engine:
        cache = torch.zeros(num_blocks, block_bytes, dtype=torch.uint8)
        engine.register([cache])
        descs = np.zeros((num_blocks, 3), dtype=np.int64)
        descs[:, 0] = cache.data_ptr() + np.arange(num_blocks) * block_bytes
        descs[:, 1] = block_bytes
        local = engine.prep_local(descs)
        peer = Peer(f"prefill-{uuid.uuid4().hex[:8]}", 7, log, num_blocks, block_bytes)
        try:
            agent = engine.add_peer(peer.metadata)
            remote = engine.prep_remote(agent, peer.descs)
            idx = np.arange(num_blocks)
            warm = engine.read(local, idx[:1], remote, idx[:1])
            wait_done(engine, warm, timeout_s=10.0)
            engine.release(warm)
            engine.send_notif(agent, b"warm")
            assert peer.next_msg()["notif"] == "warm"

            if fault == "kill":
                peer.proc.send_signal(signal.SIGKILL)
                peer.proc.wait(timeout=10)
            else:
                peer.proc.send_signal(signal.SIGSTOP)
                deadline = time.monotonic() + 5
                while not _stopped(peer.proc.pid):
                    assert time.monotonic() < deadline, "child did not stop within 5 s"
                    time.sleep(0.001)
            cache.zero_()

            # (a) + (b): one transfer polled, a notification now and then
            t0 = time.monotonic()
            xfer_failed = notif_failed = None
            xfer_state = "pending"
            handle = None
            try:
                post = engine.write if fault == "stop-write" else engine.read
                handle = post(local, idx, remote, idx)
            except TransferError as exc:
                xfer_failed = (0.0, f"post: {type(exc).__name__}: {exc}"[:160])
                xfer_state = "failed"
            next_notif, num_notifs = t0, 0
            while time.monotonic() - t0 < args.window:
                now = time.monotonic()
                if handle is not None and xfer_failed is None:
                    try:
                        if engine.poll(handle) is XferState.DONE:
                            xfer_state = "done"  # ended while the peer was frozen
                            break
                    except TransferError as exc:
                        xfer_failed = (now - t0, f"{type(exc).__name__}: {exc}"[:160])
                        xfer_state = "failed"
                if notif_failed is None and now >= next_notif:
                    try:
                        engine.send_notif(agent, b"ping %d" % num_notifs)
                        num_notifs += 1
                    except TransferError as exc:
                        notif_failed = (now - t0, f"{type(exc).__name__}: {exc}"[:160])
                    next_notif = now + args.notif_every
                if xfer_failed is not None and notif_failed is not None:
                    break
                time.sleep(0.005)  # a polling pace, not a synchronisation
            out["xfer"] = xfer_state
            out["xfer_failed_s"] = xfer_failed[0] if xfer_failed else None
            out["xfer_error"] = xfer_failed[1] if xfer_failed else ""
            out["notifs_ok"] = num_notifs
            out["notif_failed_s"] = notif_failed[0] if notif_failed else None
            out["notif_error"] = notif_failed[1] if notif_failed else ""
            out["watched_s"] = time.monotonic() - t0

            # (c) a flood: do sends fail (or block) once the socket buffers are full?
            flood_ok, flood_error, payload = 0, "", b"x" * (64 << 10)
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            f0 = time.monotonic()
            if notif_failed is None:
                for _ in range(args.flood_mib * 16):
                    try:
                        engine.send_notif(agent, payload)
                        flood_ok += 1
                    except TransferError as exc:
                        flood_error = f"{type(exc).__name__}: {exc}"[:160]
                        break
            out["flood_sent_mib"] = flood_ok / 16
            out["flood_s"] = time.monotonic() - f0
            out["flood_error"] = flood_error
            # peak RSS growth: where the unsent notifications wait (KiB -> MiB)
            out["flood_rss_mib"] = (
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
            ) / 1024

            # resume: the transfer goes on (it was never released)
            if fault != "kill":
                r0 = time.monotonic()
                peer.proc.send_signal(signal.SIGCONT)
                if xfer_state == "pending" and handle is not None:
                    try:
                        wait_done(engine, handle, timeout_s=30.0)
                        out["after_resume_s"] = time.monotonic() - r0
                        if fault == "stop":  # a WRITE's bytes are the child's to check
                            want = block_bytes_of(7, num_blocks, block_bytes)
                            out["bytes_right"] = bool(torch.equal(cache, want))
                    except TransferError as exc:
                        out["after_resume_s"] = None
                        out["resume_error"] = f"{type(exc).__name__}: {exc}"[:160]
            if handle is not None:
                engine.release(handle)
        finally:
            peer.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--window", type=float, default=60.0, help="seconds to watch a frozen peer")
    ap.add_argument("--notif-every", type=float, default=1.0, help="seconds between pings")
    ap.add_argument("--flood-mib", type=int, default=64, help="MiB of 64 KiB notifications")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument(
        "--only", default="", help="comma-separated configurations: " + ",".join(CONFIGS)
    )
    ap.add_argument("--single", default="", help=argparse.SUPPRESS)  # one run, in this process
    args = ap.parse_args()
    if args.single:
        print("@@ " + json.dumps(run_one(args)), flush=True)
        return

    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    rows = []
    for name in names:
        env_vars, _ = CONFIGS[name]
        env = {**os.environ, "UCX_TLS": "tcp", **env_vars}
        cmd = [sys.executable, __file__, "--single", name]
        cmd += ["--window", str(args.window), "--notif-every", str(args.notif_every)]
        cmd += ["--flood-mib", str(args.flood_mib), "--blocks", str(args.blocks)]
        cmd += ["--block-kib", str(args.block_kib)]
        limit = args.window + 90
        try:
            done = subprocess.run(
                cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=limit
            )
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("@@ ")]
            if not lines:
                tail = (done.stderr or done.stdout)[-800:]
                rows.append({"config": name, "xfer": f"crashed rc={done.returncode}: {tail}"})
            else:
                rows.append(json.loads(lines[-1][3:]))
        except subprocess.TimeoutExpired:
            rows.append({"config": name, "xfer": f"hung (> {limit:.0f} s)"})
        rows[-1]["env"] = " ".join(f"{k}={v}" for k, v in env_vars.items()) or "-"
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    def fmt(v: object) -> str:
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    cols = [
        "config", "xfer", "xfer_failed_s", "notifs_ok", "notif_failed_s",
        "flood_sent_mib", "flood_s", "flood_rss_mib", "after_resume_s", "bytes_right", "watched_s",
    ]  # fmt: skip
    size = f"{args.blocks} x {args.block_kib} KiB"
    print(f"UCX_TLS=tcp, window {args.window:.0f} s, one transfer of {size}")
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(fmt(row.get(c)) for c in cols))
    for row in rows:
        extra = [row.get(k) for k in ("xfer_error", "notif_error", "flood_error", "resume_error")]
        print(f"{row['config']}: env {row['env']}; " + "; ".join(e for e in extra if e))


if __name__ == "__main__":
    main()
