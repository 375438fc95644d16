"""The prefill child of ``kvbridge bench transfer``: a KVBridgeWorker over caches it fills
itself, in its own process (``--serve``), driven by JSON commands on stdin and answering
``@@`` JSON events on stdout; :class:`Child` starts and talks to it. Both sides' connector
configs and NIXL engines are made here, as the worker's own factories make them."""

from __future__ import annotations

import json
import queue
import select
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace

from kvbridge.cli.bench.transfer_shape import Shape, fill, kv_digest, parse_format, shape_args
from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.common.metadata import ConnectorMetadata, SendSpec
from kvbridge.connector.transfer.nixl_config import ProgressMode
from kvbridge.connector.transfer.nixl_engine import MergeRuns, NixlEngineConfig, NixlTransferEngine
from kvbridge.connector.worker.worker import KVBridgeWorker
from kvbridge.handshake.tp import rank_heads

TIMEOUT_S = 120.0
# Where the prefill child listens and how it is started, and where this process (decode)
# listens: this machine's loopback, unless kvbridge.cli.bench.multihost puts the child on
# the far side of a link (another network namespace: the command prefix that enters it,
# and each side's address on the link).
PREFILL_HOST = "127.0.0.1"
CHILD_PREFIX: list[str] = []
DECODE_HOST = "127.0.0.1"  # where this process's side channel listens (push: prefill asks it)


def _config(
    role: str,
    engine_id: str,
    mode: str,
    on_save: bool = False,
    staged: bool = False,
    warm: tuple[str, ...] = (),
    kv_port: int = 0,
    kv_ip: str = "127.0.0.1",
    verify: str = "off",
    busy_us: int = 0,
    gather_mib: float = 0,
    progress_us: int = 0,
    idle_ms: float = 0,
) -> KVTransferConfig:
    extra: dict[str, object] = {
        "idle_progress_ms": idle_ms,
        "transfer_mode": mode,
        "rewrite_on_save": on_save,
        "verify": verify,  # decode's: the rows without digests unless a row says so
        "busy_progress_us": busy_us,
        "gather_mib": gather_mib,
        "nixl_progress_us": progress_us,  # the engine factories below read it
    }
    if warm:
        extra["warm_peers"] = list(warm)
    return KVTransferConfig.from_dict(
        {
            "kv_role": role,
            "engine_id": engine_id,
            "kv_port": kv_port,
            "kv_ip": kv_ip,
            "kv_buffer_device": "cpu" if staged else "auto",
            "transfer_timeout_s": TIMEOUT_S,
            "extra": extra,
        }
    )


def engine_config(name: str, merge: MergeRuns, progress_us: int) -> NixlEngineConfig:
    """A bench worker's engine, as the worker's own factory makes it (``nixl_setup``):
    shared (the worker's progress thread calls it too), NIXL's progress thread sleeping
    ``progress_us`` between rounds (``extra.nixl_progress_us``; 0: none)."""
    progress = {"progress": ProgressMode.PROGRESS_THREAD_DELAY, "progress_delay_us": progress_us}
    return NixlEngineConfig(
        agent_name=name, merge=merge, shared=True, **(progress if progress_us else {})
    )


@dataclass(frozen=True, kw_only=True)
class Idle:
    """Whether the prefill child's engine steps while a load runs, and its idle progress.

    ``engine_idle=False`` (the default): the child calls ``get_finished`` about every
    millisecond, as an engine that keeps stepping. ``engine_idle=True``: after handing a
    request over it makes no engine call until decode's load is over, as vLLM's prefill
    with no request left to compute: only the worker's progress thread
    (``extra.idle_progress_ms``, ``extra.busy_progress_us``) answers decode."""

    engine_idle: bool = False
    idle_progress_ms: float = 0.0

    def cli(self) -> list[str]:
        return [f"--idle-progress-ms={self.idle_progress_ms:g}"] + (
            ["--prefill-idle"] if self.engine_idle else []
        )


@dataclass(frozen=True, kw_only=True)
class PrefillRank:
    """Which rank of a tensor-parallel prefill engine a child plays (the default: TP 1).

    Rank ``rank`` holds its share of ``Shape.heads``, fills it with seed ``1 + rank`` and
    listens on ``kv_port + rank`` (``kv_port`` 0: an ephemeral port it reports; the
    params then list every rank's port, ``remote_ports``).
    ``rewrites_in_place=False``: it never rewrites its blocks for a reader (read in place)."""

    rank: int = 0
    tp_size: int = 1
    kv_port: int = 0
    rewrites_in_place: bool = True
    kv_ip: str = "127.0.0.1"  # the address its side channel binds and advertises

    def cli(self) -> list[str]:
        flags = [f"--rank={self.rank}", f"--tp-size={self.tp_size}", f"--kv-port={self.kv_port}"]
        return flags + ([] if self.rewrites_in_place else ["--no-rewrites-in-place"])


def serve(
    shape: Shape,
    fmt_code: str,
    engine_id: str,
    mode: str,
    device: str,
    on_save: bool,
    staged: bool,
    merge: MergeRuns,
    tp: PrefillRank = PrefillRank(),
    busy_us: int = 0,
    gather_mib: float = 0,
    progress_us: int = 0,
    idle: Idle = Idle(),
) -> None:
    """Prefill: JSON commands on stdin, ``@@`` JSON events on stdout."""
    engines: list[NixlTransferEngine] = []

    def factory(name: str) -> NixlTransferEngine:
        engines.append(NixlTransferEngine(engine_config(name, merge, progress_us)))
        return engines[-1]

    def say(**event: object) -> None:
        sys.stdout.write("@@ " + json.dumps(event) + "\n")
        sys.stdout.flush()

    local = replace(shape, heads=rank_heads(tp.rank, tp.tp_size, shape.heads).count)
    buffers = local.buffers(parse_format(fmt_code), device)
    fill(buffers, seed=1 + tp.rank)
    config = _config(
        "kv_producer",
        engine_id,
        mode,
        on_save,
        staged,
        kv_port=tp.kv_port,
        kv_ip=tp.kv_ip,
        busy_us=busy_us,
        gather_mib=gather_mib,
        progress_us=progress_us,
        idle_ms=idle.idle_progress_ms,
    )
    with KVBridgeWorker(
        config,
        shape.model(),  # the whole model's heads; this rank holds its share
        rank=tp.rank,
        tp_size=tp.tp_size,
        rewrites_in_place=tp.rewrites_in_place,
        host_staging=staged or None,
        engine_factory=factory,
    ) as worker:
        worker.register_kv_caches(buffers)
        say(event="ready", port=worker.side_channel_port, agent=worker.agent_name)
        finishing: set[str] = set()  # idle engine: loads decode says are over
        while True:
            if not idle.engine_idle or finishing:
                for rid in worker.get_finished().finished_sending:
                    finishing.discard(rid)
                    posted = worker.metrics.descriptors_posted
                    rows = engines[0].num_rows_posted
                    say(event="sent", request_id=rid, descriptors_posted=posted, rows_posted=rows)
            # 1 ms of waiting on stdin keeps this loop from spinning a core; an idle engine
            # waits for the next command (only the progress thread advances transfers)
            wait_s = None if idle.engine_idle and not finishing else 0.001
            if not select.select([sys.stdin], [], [], wait_s)[0]:
                continue
            line = sys.stdin.readline()
            if not line:
                return
            cmd = json.loads(line)
            if cmd["cmd"] == "send":
                spec = SendSpec(
                    request_id=cmd["request_id"],
                    block_ids=(tuple(cmd["block_ids"]),),
                    first_block=(0,),
                    lease_s=600.0,
                )
                t0 = time.perf_counter()
                worker.bind_connector_metadata(ConnectorMetadata(reqs_to_send=(spec,)))
                worker.start_load_kv()
                keep_ms = (time.perf_counter() - t0) * 1e3
                say(event="kept", request_id=spec.request_id, keep_ms=keep_ms)
            elif cmd["cmd"] == "finish":  # the timed load is over: report its end
                finishing.add(cmd["request_id"])
            elif cmd["cmd"] == "digest":
                heads = cmd.get("heads")  # [first, count] or absent: every head
                digest = kv_digest(buffers, cmd["block_ids"], tuple(heads) if heads else None)
                say(event="digest", sha256=digest)
            else:
                return


class Child:
    def __init__(
        self,
        shape: Shape,
        fmt_code: str,
        mode: str,
        device: str,
        on_save: bool = False,
        staged: bool = False,
        merge: MergeRuns = MergeRuns.OFF,
        *,
        tp: PrefillRank = PrefillRank(),
        engine_id: str | None = None,
        busy_us: int = 0,
        gather_mib: float = 0,
        progress_us: int = 0,
        idle: Idle = Idle(),
    ) -> None:
        """``engine_id``: shared by the ranks of one TP engine (default: a new one)."""
        self.idle = idle
        self.engine_id = engine_id or f"bench-P-{uuid.uuid4().hex[:6]}"
        args = [
            sys.executable,
            "-m",
            "kvbridge.cli.bench.transfer",
            "--serve",
            fmt_code,
            "--engine-id",
            self.engine_id,
            f"--mode={mode}",
            f"--device={device}",
            *(["--rewrite-on-save"] if on_save else []),
            *(["--staged"] if staged else []),
            f"--merge={merge.value}",
            f"--busy-progress-us={busy_us}",
            f"--gather-mib={gather_mib}",
            f"--nixl-progress-us={progress_us}",
            *tp.cli(),
            *idle.cli(),
            f"--kv-ip={PREFILL_HOST}",
            *shape_args(shape),
        ]
        self.proc = subprocess.Popen(
            [*CHILD_PREFIX, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            ready = self.wait("ready")
        except BaseException:  # never leave a child behind (timeout, Ctrl-C)
            self.close()
            raise
        self.port, self.agent = ready["port"], ready["agent"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._events.put(json.loads(line[3:]))
        self._events.put({"event": "eof"})

    def wait(self, name: str) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"child: no {name!r} within {TIMEOUT_S} s") from None
            if event["event"] == name:
                return event
            if event["event"] == "eof":
                raise SystemExit(f"child exited while we waited for {name!r}")

    def command(self, **cmd: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
