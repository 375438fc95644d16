"""Transfer benchmark: connector-driven loads vs a raw NIXL READ / WRITE of the same bytes.

Two processes: a child plays the prefill worker (``--serve``: a KVBridgeWorker over caches
it fills itself), this process plays decode (a KVBridgeWorker loading from it). Per cache
format and transfer mode, after one warm-up load (handshake, descriptor lists, UCX
connection)::

    connector:  child keeps a 2048-token request -> LoadSpec -> start_load_kv ->
                get_finished() until the load is reported (timed, median of N); pull:
                decode READs; push: decode sends Push, the child WRITEs into its blocks
    raw NIXL:   one READ (and one WRITE) of one descriptor covering the same number of
                bytes, between the child's cross-layer buffer and ours (no connector code)
    torch:      dst.copy_(src) of the same bytes in this process (the memory's speed)

``--device cuda`` puts both sides' caches in GPU memory (NIXL VRAM registrations).
``--merge on`` posts runs of adjacent blocks as one descriptor each on both sides
(``MergeRuns.ON``; ``off``, the default, posts every block by index and leaves the
coalescing to NIXL); ``compare`` adds per-layer rows with contiguous blocks both ways, so
``descs`` shows the descriptors posted before and after merging and ``rows`` the blocks
x streams asked for.
``--gather-mib N`` adds the shuffled rows of each format (cross-layer, blocks-first,
kv-split) again with ``extra.gather_mib`` on both sides: packed transfers, the rows
gathered by prefill and moved as one range (``descs`` counts its 64 KiB pages, which
NIXL coalesces).
``--host-staging compare`` adds the x-NHD rows again with both sides staged through host
mirrors (``kv_buffer_device: "cpu"``; forced for caches already in host memory), and
``on`` stages every row. ``keep ms`` is the time prefill took to keep the request (its
rewrite on save and its copy to the mirror), before the timed load starts.

It also reports descriptors per request, the time NIXL took to prepare the descriptor
lists (once per peer) and the per-request index computation (``GroupPlan.indices``).
Loaded bytes are checked (sha256 of both sides' token-major KV) for every format.

Run:  kvbridge bench transfer [--layers 32] [--iterations 7] [--device cpu]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import select
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np
import torch

from kvbridge.cli.bench.results import add_json_argument, write_json
from kvbridge.connector.common.config import NIXL_PROGRESS_STEP_US, KVTransferConfig
from kvbridge.connector.common.metadata import ConnectorMetadata, LoadSpec, SendSpec
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.nixl_config import ProgressMode
from kvbridge.connector.transfer.nixl_engine import MergeRuns, NixlEngineConfig, NixlTransferEngine
from kvbridge.connector.transfer.transport import wait_done
from kvbridge.connector.worker.worker import KVBridgeWorker, ModelInfo
from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.description import parse_description
from kvbridge.handshake.messages import PROTOCOL_VERSION, MetadataRequest
from kvbridge.handshake.plan_model import GroupPlan
from kvbridge.handshake.tp import rank_heads
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers, read_group_token_major
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout, KVPacking
from kvbridge.layouts.specs import FullAttentionSpec

TIMEOUT_S = 120.0
BUSY_PROGRESS_US = 200  # extra.busy_progress_us, both sides
# Where the prefill child listens and how it is started, and where this process (decode)
# listens: this machine's loopback, unless kvbridge.cli.bench.multihost puts the child on
# the far side of a link (another network namespace: the command prefix that enters it,
# and each side's address on the link).
PREFILL_HOST = "127.0.0.1"
CHILD_PREFIX: list[str] = []
DECODE_HOST = "127.0.0.1"  # where this process's side channel listens (push: prefill asks it)


@dataclass(frozen=True, kw_only=True)
class Shape:
    layers: int
    heads: int
    head_size: int
    block_size: int
    tokens: int

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return 2 * self.blocks_per_request + 16  # room to scatter a request's blocks

    @property
    def request_bytes(self) -> int:
        return self.tokens * self.layers * 2 * self.heads * self.head_size * 2  # fp16 K+V

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Shape:
        """From the flags :func:`add_common_args` adds (``--head-size`` -> ``head_size``)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def model(self) -> ModelInfo:
        return ModelInfo(
            model_name="bench", dtype="float16", num_kv_heads=self.heads, head_size=self.head_size
        )

    def buffers(self, fmt: CacheFormat, device: str = "cpu") -> KVCacheBuffers:
        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.heads,
            head_size=self.head_size,
            dtype=torch.float16,
        )
        group = KVCacheGroup(
            group_id=0, layer_names=tuple(f"layer.{i}" for i in range(self.layers)), spec=spec
        )
        config = KVCacheConfig(groups=(group,), num_blocks=self.num_blocks)
        return KVCacheBuffers(config, fmt, device=device)


def parse_format(code: str) -> CacheFormat:
    """``x-NHD``: x cross-layer, bf per-layer blocks_first, ks per-layer kv_split."""
    alloc, layout = code.split("-")
    return CacheFormat(
        layout=KVLayout(layout),
        cross_layer=alloc == "x",
        packing=KVPacking.KV_SPLIT if alloc == "ks" else KVPacking.BLOCKS_FIRST,
    )


def fill(buffers: KVCacheBuffers, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in buffers.tensors:  # generated on the host, then copied where the cache lives
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def kv_digest(
    buffers: KVCacheBuffers, block_ids: list[int], heads: tuple[int, int] | None = None
) -> str:
    """sha256 of the token-major KV of ``block_ids``; ``heads=(first, count)``: of those
    (rank-local) heads only."""
    tm = read_group_token_major(buffers, 0, np.asarray(block_ids))
    if heads is not None:  # (layers, parts, tokens, heads, head_size)
        tm = tm[:, :, :, heads[0] : heads[0] + heads[1]]
    host = tm.contiguous().view(torch.uint8).cpu()  # explicit: the bytes leave the device
    return hashlib.sha256(host.numpy().tobytes()).hexdigest()


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
) -> KVTransferConfig:
    extra: dict[str, object] = {
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


# -- the prefill child -----------------------------------------------------------------------


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
        while True:
            for rid in worker.get_finished().finished_sending:
                posted = worker.metrics.descriptors_posted
                rows = engines[0].num_rows_posted
                say(event="sent", request_id=rid, descriptors_posted=posted, rows_posted=rows)
            # 1 ms of waiting on stdin keeps this loop from spinning a core
            if not select.select([sys.stdin], [], [], 0.001)[0]:
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
    ) -> None:
        """``engine_id``: shared by the ranks of one TP engine (default: a new one)."""
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


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The shape flags :meth:`Shape.from_args` reads (:func:`shape_args` writes them) and
    ``--iterations`` (timed runs per row, median)."""
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iterations", type=int, default=7)


def shape_args(shape: Shape) -> list[str]:
    return [
        f"--layers={shape.layers}",
        f"--heads={shape.heads}",
        f"--head-size={shape.head_size}",
        f"--block-size={shape.block_size}",
        f"--tokens={shape.tokens}",
    ]


# -- measurement helpers ------------------------------------------------------------------------


class TimedEngine:
    """A NixlTransferEngine whose preparation and post calls are timed (seconds)."""

    TIMED = ("prep_local", "prep_remote", "read", "write")

    def __init__(self, inner: NixlTransferEngine) -> None:
        self._inner = inner
        self.seconds: dict[str, float] = defaultdict(float)

    @property
    def guard(self) -> Callable[[], bool] | None:
        return self._inner.guard

    @guard.setter
    def guard(self, held: Callable[[], bool] | None) -> None:
        """The worker's agent gate checks the calls NIXL sees: the inner engine's."""
        self._inner.guard = held

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name not in self.TIMED:
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        return timed


def time_indices() -> Callable[[], float]:
    """Wrap ``GroupPlan.indices`` (per-request descriptor picking); returns a reader."""
    total = [0.0]
    original = GroupPlan.indices

    def indices(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0

    GroupPlan.indices = indices  # type: ignore[method-assign]
    return lambda: total[0]


def median_s(fn: Callable[[], float], iterations: int) -> float:
    return statistics.median(fn() for _ in range(iterations))


@dataclass
class Row:
    name: str
    descs: int | str
    seconds: float
    prep_ms: float | str = ""
    pick_ms: float | str = ""
    read_ms: float | str = ""
    keep_ms: float | str = ""
    first_ms: float | str = ""
    rows: int | str = ""  # rows (blocks x streams) asked for, before merging
    probe_ms: float | str = "-"  # decode's first READ probe of the child (extra.read_probe)
    # decode's load phases, mean ms per timed load (inflight.LoadTimeline), and the rest of
    # the mean load time (start_load_kv to the phases' start; the report after them)
    phases_ms: dict[str, float] = field(default_factory=dict)


PHASES = ("peer", "prepare", "data", "finish")


def load_spec(
    child: Child,
    shape: Shape,
    request_id: str,
    remote_ids: list[int],
    local_ids: list[int],
    *,
    remote_tp_size: int = 1,
    remote_ports: list[int] | None = None,
) -> LoadSpec:
    """Decode's LoadSpec for the whole prompt prefill keeps as ``request_id``; ``child``:
    prefill's rank 0; ``remote_ports``: every rank's side-channel port (default: rank r
    listens on rank 0's port + r)."""
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=child.engine_id,
        remote_host=PREFILL_HOST,
        remote_port=child.port,
        remote_ports=list(remote_ports or []),
        remote_tp_size=remote_tp_size,
        remote_block_ids=[remote_ids],
        remote_first_block=[0],
        remote_block_size=shape.block_size,
        num_tokens=shape.tokens,
        remote_request_id=request_id,
    )
    return LoadSpec(
        request_id=f"l-{request_id}",
        params=params,
        local_block_ids=(tuple(local_ids),),
        start_token=0,
        end_token=shape.tokens,
    )


def load(decode: KVBridgeWorker, spec: LoadSpec) -> None:
    """Start ``spec`` and drive ``decode`` until it reports the load (at most TIMEOUT_S)."""
    decode.bind_connector_metadata(ConnectorMetadata(reqs_to_load=(spec,)))
    decode.start_load_kv()
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        out = decode.get_finished()
        if out.failed_loads:
            raise SystemExit(f"load failed: {out.failed_loads[0].reason}")
        if spec.request_id in out.finished_recving:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"load {spec.request_id} not done within {TIMEOUT_S} s")


def measure_connector(
    shape: Shape,
    pfmt: str,
    dfmt: str,
    *,
    shuffled: bool,
    mode: str,
    device: str,
    iterations: int,
    indices_s,
    on_save: bool = False,
    staged: bool = False,
    warm: bool = False,
    merge: MergeRuns = MergeRuns.OFF,
    merge_named: bool = False,
    verify: str = "off",
    busy_us: int = 0,
    gather_mib: float = 0,
    progress_us: int = 0,
    progress_side: str = "both",
) -> tuple[Row, Child, KVBridgeWorker, KVCacheBuffers]:
    """``progress_us``: NIXL's progress thread on ``progress_side`` (both, prefill or
    decode; the other side runs none)."""
    prefill_us = progress_us if progress_side in ("both", "prefill") else 0
    progress_us = progress_us if progress_side in ("both", "decode") else 0
    child = Child(
        shape,
        pfmt,
        mode,
        device,
        on_save,
        staged,
        merge,
        busy_us=busy_us,
        gather_mib=gather_mib,
        progress_us=prefill_us,
    )
    engines: list[TimedEngine] = []

    def factory(name: str) -> TimedEngine:
        engines.append(TimedEngine(NixlTransferEngine(engine_config(name, merge, progress_us))))
        return engines[-1]

    decode = KVBridgeWorker(
        _config(
            "kv_consumer",
            f"bench-D-{uuid.uuid4().hex[:6]}",
            mode,
            staged=staged,
            warm=(f"{PREFILL_HOST}:{child.port}",) if warm else (),
            kv_ip=DECODE_HOST,
            verify=verify,
            busy_us=busy_us,
            gather_mib=gather_mib,
            progress_us=progress_us,
        ),
        shape.model(),
        engine_factory=factory,  # type: ignore[arg-type]
        host_staging=staged or None,
    )
    buffers = shape.buffers(parse_format(dfmt), device)
    decode.register_kv_caches(buffers)
    n = shape.blocks_per_request
    rng = np.random.default_rng(0)
    if shuffled:
        rids = rng.permutation(shape.num_blocks)[:n].tolist()
        lids = rng.permutation(shape.num_blocks)[:n].tolist()
    else:
        rids = lids = list(range(n))

    child_posted = [0, 0]  # descriptors, rows
    keep_ms: list[float] = []

    def one_load() -> float:
        rid = f"r-{uuid.uuid4().hex[:8]}"
        child.command(cmd="send", request_id=rid, block_ids=rids)
        keep_ms.append(child.wait("kept")["keep_ms"])
        spec = load_spec(child, shape, rid, rids, lids)
        t0 = time.perf_counter()
        load(decode, spec)
        took = time.perf_counter() - t0
        # Done reached prefill (its blocks are restored) - untimed
        sent = child.wait("sent")
        child_posted[:] = [sent["descriptors_posted"], sent["rows_posted"]]
        return took

    if warm:  # extra.warm_peers: the handshake and connection happen before any request
        deadline = time.monotonic() + TIMEOUT_S
        while decode.metrics.handshakes < 1:
            decode.get_finished()
            if time.monotonic() > deadline:
                raise SystemExit(f"warm handshake with the child not done within {TIMEOUT_S} s")
    first_s = one_load()  # warm-up: handshake, descriptor lists, UCX connection
    engine = engines[0]
    prep_ms = (engine.seconds["prep_local"] + engine.seconds["prep_remote"]) * 1e3
    posted0 = decode.metrics.descriptors_posted + child_posted[0]
    rows0 = engine.num_rows_posted + child_posted[1]
    picked0, read0 = indices_s(), engine.seconds["read"]
    phases0 = {k: getattr(decode.metrics, f"load_{k}_seconds") for k in PHASES}
    times = [one_load() for _ in range(iterations)]
    seconds = statistics.median(times)
    phases_ms = {
        k: (getattr(decode.metrics, f"load_{k}_seconds") - phases0[k]) / iterations * 1e3
        for k in PHASES
    }
    phases_ms["rest"] = statistics.mean(times) * 1e3 - sum(phases_ms.values())
    # pull: decode posts the READs; push: the child posts the WRITEs (its own engine)
    descs = (decode.metrics.descriptors_posted + child_posted[0] - posted0) // iterations
    rows = (engine.num_rows_posted + child_posted[1] - rows0) // iterations
    pick_ms = (indices_s() - picked0) / iterations * 1e3 if mode == "pull" else "-"
    read_ms = (engine.seconds["read"] - read0) / iterations * 1e3 if mode == "pull" else "-"
    child.command(cmd="digest", block_ids=rids)
    if child.wait("digest")["sha256"] != kv_digest(buffers, lids):
        raise SystemExit(f"{pfmt} -> {dfmt}: loaded bytes differ from prefill's")
    order = "shuffled" if shuffled else "contiguous"
    name = f"connector {mode} {pfmt} -> {dfmt}, {order}" + (", on save" if on_save else "")
    name += ", host-staged" if staged else ""
    name += ", warm peer" if warm else ""
    name += f", merge {merge.value}" if merge_named else ""
    name += f", verify {verify}" if verify != "off" else ""
    if gather_mib:
        packed = decode.metrics.packed_loads
        name += ", packed" if packed >= iterations + 1 else f", packed {packed} of {iterations + 1}"
    if verify == "all" and decode.metrics.loads_verified < iterations + 1:
        raise SystemExit(f"{name}: {decode.metrics.loads_verified} loads verified")
    keep = statistics.median(keep_ms[1:])  # after the warm-up
    row = Row(name, descs, seconds, prep_ms, pick_ms, read_ms, keep, first_s * 1e3, rows)
    row.phases_ms = phases_ms
    if decode.metrics.read_probes:
        row.probe_ms = decode.metrics.read_probe_first_seconds * 1e3
    return row, child, decode, buffers


def measure_raw(
    child: Child, decode: KVCacheBuffers, shape: Shape, iterations: int, nbytes: int | None = None
) -> tuple[Row, Row, Row]:
    """One READ of one descriptor (the child's cross-layer buffer -> ours), then one WRITE
    (ours -> the child's), same bytes. The WRITE overwrites the child's cache: run last.
    ``nbytes``: how many bytes (default: the whole request, ``shape.request_bytes``); the
    child must be rank 0 of its engine."""
    raw = NixlTransferEngine(NixlEngineConfig(agent_name=f"bench-raw-{uuid.uuid4().hex[:6]}"))
    try:
        dst = decode.tensors[0]
        raw.register([dst])
        request = MetadataRequest(
            protocol_version=PROTOCOL_VERSION,
            requester_engine_id="bench-raw",
            requester_rank=0,
            requester_agent_name=raw.agent_name,
            requester_nixl_metadata=raw.metadata(),
        )
        client = HandshakeClient(ClientConfig(timeout_s=5.0), request=request)
        try:
            desc = client.get(child.engine_id, 0, PREFILL_HOST, child.port)
        finally:
            client.close()
        region = parse_description(desc).regions[0].region
        if nbytes is None:
            nbytes = shape.request_bytes
            assert region.block_bytes * shape.blocks_per_request == nbytes, "cross-layer region"
        assert nbytes <= min(region.span_bytes, dst.numel() * dst.element_size()), nbytes
        peer = raw.add_peer(desc.nixl_metadata)
        # the prefill's memory as it described it: a VRAM region prepared as DRAM has no
        # backend to move it (NIXL_ERR_NOT_FOUND on a GPU)
        remote = raw.prep_remote(
            peer,
            np.array([[region.base_addr, nbytes, region.device_id]]),
            memory_kind=region.memory_kind,
        )
        device_id = dst.device.index or 0
        local = raw.prep_local(np.array([[dst.data_ptr(), nbytes, device_id]]))
        one = np.zeros(1, dtype=np.int64)

        def once(post) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                handle = post(local, one, remote, one)
                wait_done(raw, handle, timeout_s=TIMEOUT_S, poll_interval_s=0.0)
                took = time.perf_counter() - t0
                raw.release(handle)
                return took

            return run

        read_once, write_once = once(raw.read), once(raw.write)
        read_once()  # connection wire-up
        nixl_row = Row("raw NIXL READ, 1 descriptor", 1, median_s(read_once, iterations))
        write_once()
        write_row = Row("raw NIXL WRITE, 1 descriptor", 1, median_s(write_once, iterations))
    finally:
        raw.close()
    src = torch.empty(nbytes, dtype=torch.uint8, device=dst.device).fill_(7)
    out = torch.empty_like(src)

    def copy_once() -> float:
        sync()
        t0 = time.perf_counter()
        out.copy_(src)
        sync()  # GPU copies are asynchronous: time them to the end
        return time.perf_counter() - t0

    def sync() -> None:
        if src.is_cuda:
            torch.cuda.synchronize(src.device)

    copy_once()
    where = str(src.device) if src.is_cuda else f"{torch.get_num_threads()} threads"
    torch_row = Row(f"torch copy_ in one process ({where})", "-", median_s(copy_once, 5))
    return nixl_row, write_row, torch_row


DIGEST_SIZES_MIB = (1, 32, 256)
DIGEST_BLOCK_BYTES = 256 << 10  # one cross-layer block of the digest rows (a 2-token block)


def measure_digest(device: str, iterations: int) -> list[dict]:
    """``extra.verify``'s cost on its own: the digest of a request's rows (a cross-layer
    block each, ``layouts.digest.row_sums`` + ``fold``) against ``copy_`` of the same
    bytes on the same device, at 1, 32 and 256 MiB; blocks contiguous (one strided
    reduction) and shuffled (run by run)."""
    out = []
    for mib in DIGEST_SIZES_MIB:
        n = max(1, (mib << 20) // DIGEST_BLOCK_BYTES)
        units = torch.randint(0, 256, (2 * n + 16, DIGEST_BLOCK_BYTES), dtype=torch.uint8)
        units = units.to(device)
        copy_s = median_s(_timed(units, _copy_of(units[:n].reshape(-1))), iterations)
        shuffled = np.random.default_rng(0).permutation(units.shape[0])[:n]
        for order, rows in (("contiguous", np.arange(n)), ("shuffled", shuffled)):
            digest_s = median_s(_timed(units, _digest_of(units, rows)), iterations)
            out.append(
                {
                    "mib": n * DIGEST_BLOCK_BYTES / 2**20,
                    "order": order,
                    "digest_ms": digest_s * 1e3,
                    "copy_ms": copy_s * 1e3,
                    "digest_gbps": n * DIGEST_BLOCK_BYTES / digest_s / 1e9,
                    "x_copy": copy_s / digest_s,
                }
            )
    return out


def _copy_of(src: torch.Tensor) -> Callable[[], object]:
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _digest_of(units: torch.Tensor, rows: np.ndarray) -> Callable[[], object]:
    from kvbridge.layouts.digest import fold, row_sums

    offsets = np.zeros(1, dtype=np.int64)
    return lambda: fold(row_sums(units, offsets, DIGEST_BLOCK_BYTES, rows))


def _timed(on: torch.Tensor, fn: Callable[[], object]) -> Callable[[], float]:
    """``fn``'s time, the device's queue drained before and after (GPU work is async)."""

    def sync() -> None:
        if on.is_cuda:
            torch.cuda.synchronize(on.device)

    def run() -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    return run


def print_digest(records: list[dict], device: str) -> None:
    print(f"\ndigest (extra.verify) vs copy_ of the same bytes, {device}:")
    header = f"{'MiB':>6} {'blocks':<11} {'digest ms':>10} {'copy ms':>9} {'GB/s':>7} {'x copy':>7}"
    print(header)
    print("-" * len(header))
    for r in records:
        print(
            f"{r['mib']:6.0f} {r['order']:<11} {r['digest_ms']:10.2f} {r['copy_ms']:9.2f} "
            f"{r['digest_gbps']:7.2f} {r['x_copy']:7.2f}"
        )
    print("x copy = copy time / digest time (>= 0.5: the digest reads as fast as half a copy)")


def print_phases(rows: list[Row], raw_read_s: float, raw_write_s: float) -> None:
    """Where a timed load's time goes, and its tax: the median load minus the raw transfer
    of the same bytes (READ for pull rows, WRITE for push rows)."""
    print("\nwhere a load's time goes (decode's phases, mean ms per timed load):")
    header = f"{'what':<60} " + " ".join(f"{k:>8}" for k in (*PHASES, "rest", "tax"))
    print(header)
    print("-" * len(header))
    for r in rows:
        if not r.phases_ms:
            continue
        raw_s = raw_write_s if " push " in r.name else raw_read_s
        cells = " ".join(f"{r.phases_ms[k]:8.3f}" for k in (*PHASES, "rest"))
        print(f"{r.name:<60} {cells} {(r.seconds - raw_s) * 1e3:8.3f}")
    print(
        "peer: until the peer was ready; prepare: until the first READ (or the Push) went\n"
        "out (a claim answered first when prefill rewrites); data: until every source's\n"
        "bytes were in place (READs ended and the claim answered, or Pushed); finish:\n"
        "landing, to the load reported; rest: the mean load time outside the phases\n"
        "(start_load_kv to the load being added, the engine call that reports it).\n"
        "tax: median load - raw transfer of the same bytes (the fixed cost of a load)."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where both caches live")
    ap.add_argument("--modes", default="pull,push", help="transfer modes to run (comma list)")
    ap.add_argument("--mode", default="pull", help=argparse.SUPPRESS)
    ap.add_argument(
        "--formats",
        default="",
        help="only the rows whose prefill and decode formats are both in this comma list "
        "(x-NHD, bf-NHD, ks-NHD, x-HND; x-NHD among them: the raw baseline and the "
        "compare rows run on its child; default: every row)",
    )
    ap.add_argument(
        "--host-staging",
        choices=["off", "on", "compare"],
        default="off",
        help="stage both sides through host mirrors: off, on (every row), compare (x-NHD rows "
        "both ways)",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="add the x-NHD rows again with extra.warm_peers (compare their 1st ms)",
    )
    ap.add_argument(
        "--merge",
        choices=["off", "on", "compare"],
        default="off",
        help="post adjacent blocks as one descriptor (MergeRuns.ON) on both sides: off, on "
        "(every row), compare (per-layer contiguous rows both ways)",
    )
    ap.add_argument(
        "--verify",
        choices=["off", "all", "compare"],
        default="off",
        help="extra.verify on decode: off, all (every row), compare (x-NHD rows again with "
        "verify all, and the digest alone vs a copy at 1, 32 and 256 MiB)",
    )
    ap.add_argument(
        "--busy-progress-us",
        type=int,
        default=BUSY_PROGRESS_US,
        help="extra.busy_progress_us on both sides (0: a peer waits for the other side's "
        f"next step; default {BUSY_PROGRESS_US})",
    )
    ap.add_argument(
        "--nixl-progress-us",
        type=int,
        default=0,
        help="extra.nixl_progress_us: NIXL's progress thread, waiting for UCX's events at "
        "most that long, a multiple of 1000 (0: none, progress in the worker's calls only; "
        "vLLM's default is 1000), on --nixl-progress-side",
    )
    ap.add_argument(
        "--nixl-progress-side",
        choices=["both", "prefill", "decode"],
        default="both",
        help="which side runs NIXL's progress thread (--nixl-progress-us); the other none",
    )
    ap.add_argument(
        "--gather-mib",
        type=float,
        default=0,
        help="add the shuffled rows of each format again with extra.gather_mib=MIB on both "
        "sides (packed transfers: the rows move as one range; 0: not)",
    )
    ap.add_argument("--rewrite-on-save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--staged", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", metavar="FORMAT", help=argparse.SUPPRESS)
    ap.add_argument("--engine-id", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--tp-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--kv-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--kv-ip", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--no-rewrites-in-place", action="store_true", help=argparse.SUPPRESS)
    add_json_argument(ap)
    args = ap.parse_args(argv)
    if args.nixl_progress_us < 0 or args.nixl_progress_us % NIXL_PROGRESS_STEP_US:
        ap.error(f"--nixl-progress-us must be 0 or a multiple of {NIXL_PROGRESS_STEP_US}")
    shape = Shape.from_args(args)
    if args.serve:
        serve(
            shape,
            args.serve,
            args.engine_id,
            args.mode,
            args.device,
            args.rewrite_on_save,
            args.staged,
            MergeRuns(args.merge),
            PrefillRank(
                rank=args.rank,
                tp_size=args.tp_size,
                kv_port=args.kv_port,
                rewrites_in_place=not args.no_rewrites_in_place,
                kv_ip=args.kv_ip,
            ),
            args.busy_progress_us,
            args.gather_mib,
            args.nixl_progress_us,
        )
        return
    indices_s = time_indices()
    # before any NIXL agent lives in this process: UCX's threads would take the cores the
    # digest's and the copy's own threads need on a small machine
    digest = measure_digest(args.device, args.iterations) if args.verify == "compare" else []
    mib = shape.request_bytes / 2**20
    print(
        f"shape: {shape.layers} layers x {shape.heads} KV heads x {shape.head_size} fp16, "
        f"block {shape.block_size}, {shape.tokens}-token request = {mib:.0f} MiB; "
        f"{args.iterations} timed runs each (median); pid {os.getpid()}, "
        f"{os.cpu_count()} CPUs; device {args.device}; "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}; "
        f"extra.busy_progress_us={args.busy_progress_us}, "
        f"extra.nixl_progress_us={args.nixl_progress_us} on "
        f"{'both sides' if args.nixl_progress_side == 'both' else args.nixl_progress_side}",
        flush=True,
    )
    rows: list[Row] = []
    # (prefill, decode, shuffled, rewrite on save): the first also serves the raw rows
    formats = [
        ("x-NHD", "x-NHD", True, False),
        ("x-NHD", "x-NHD", False, False),
        ("bf-NHD", "bf-NHD", True, False),
        ("ks-NHD", "ks-NHD", True, False),
        ("x-NHD", "x-HND", True, False),  # sender rewrite when decode asks (Prepare / Push)
        # the same rewrite when the child is handed the request (extra.rewrite_on_save),
        # before the timed load starts: off the handover's critical path
        ("x-NHD", "x-HND", True, True),
    ]
    if args.formats:
        wanted = {f.strip() for f in args.formats.split(",") if f.strip()}
        if "x-NHD" not in wanted:  # the raw rows need the first row's child cross-layer
            raise SystemExit(f"--formats {args.formats}: x-NHD must be among them")
        formats = [f for f in formats if f[0] in wanted and f[1] in wanted]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    staging = args.host_staging == "on"
    merge = MergeRuns.ON if args.merge == "on" else MergeRuns.OFF
    verify = "all" if args.verify == "all" else "off"
    # (mode, *format, host-staged, warm peer, merge, merge named in the row, verify)
    runs = [(mode, *f, staging, False, merge, False, verify) for mode in modes for f in formats]
    if args.merge == "compare":  # the raw baseline's row, then per-layer off/on pairs
        runs = [(modes[0], *formats[0], staging, False, merge, False, verify)] + [
            (mode, pfmt, pfmt, False, False, staging, False, m, True, verify)
            for mode in modes
            for pfmt in ("bf-NHD", "ks-NHD")
            for m in (MergeRuns.OFF, MergeRuns.ON)
        ]
    if args.host_staging == "compare":
        runs += [
            (mode, *f, True, False, merge, False, verify) for mode in modes for f in formats[:2]
        ]
    if args.warm:
        runs += [(mode, *formats[0], staging, True, merge, False, verify) for mode in modes]
    if args.verify == "compare":  # each x-NHD row again, verified
        runs += [
            (mode, *f, staging, False, merge, False, "all") for mode in modes for f in formats[:2]
        ]
    gathers = [0.0] * len(runs)
    if args.gather_mib:  # the shuffled rows of each format again (no rewrite), packed
        packed = [(*r[:5], staging, False, merge, False, verify) for r in runs]
        packed = [r for r in packed if r[1] == r[2] and r[3] and not r[4]]
        runs += packed
        gathers += [args.gather_mib] * len(packed)
    raw_rows: list[Row] = []
    for i, (mode, pfmt, dfmt, shuffled, on_save, staged, warm, m, named, v) in enumerate(runs):
        row, child, decode, buffers = measure_connector(
            shape,
            pfmt,
            dfmt,
            shuffled=shuffled,
            mode=mode,
            device=args.device,
            iterations=args.iterations,
            indices_s=indices_s,
            on_save=on_save,
            staged=staged,
            warm=warm,
            merge=m,
            merge_named=named,
            verify=v,
            busy_us=args.busy_progress_us,
            gather_mib=gathers[i],
            progress_us=args.nixl_progress_us,
            progress_side=args.nixl_progress_side,
        )
        try:
            rows.append(row)
            if i == 0:  # after the connector's digest check: the raw WRITE overwrites
                raw_rows = list(measure_raw(child, buffers, shape, args.iterations))
        finally:
            decode.shutdown()
            child.close()
        print(f"  done: {row.name}", flush=True)
    rows = raw_rows + rows
    raw_read_s, raw_write_s = raw_rows[0].seconds, raw_rows[1].seconds
    print()
    header = (
        f"{'what':<60} {'descs':>6} {'rows':>6} {'ms':>8} {'GB/s':>6} {'x raw':>6} "
        f"{'prep ms':>8} {'pick ms':>8} {'read ms':>8} {'keep ms':>8} {'1st ms':>8} "
        f"{'probe ms':>8}"
    )
    print(header)
    print("-" * len(header))
    records = []
    for r in rows:
        gbps = shape.request_bytes / r.seconds / 1e9
        prep = f"{r.prep_ms:.2f}" if isinstance(r.prep_ms, float) else r.prep_ms
        pick = f"{r.pick_ms:.3f}" if isinstance(r.pick_ms, float) else r.pick_ms
        read = f"{r.read_ms:.2f}" if isinstance(r.read_ms, float) else r.read_ms
        keep = f"{r.keep_ms:.2f}" if isinstance(r.keep_ms, float) else r.keep_ms
        first = f"{r.first_ms:.1f}" if isinstance(r.first_ms, float) else r.first_ms
        probe = f"{r.probe_ms:.2f}" if isinstance(r.probe_ms, float) else r.probe_ms
        push = " push " in r.name or "WRITE" in r.name
        raw_s = raw_write_s if push else raw_read_s
        records.append(
            {
                **asdict(r),
                "mode": "push" if push else "pull",
                "gbps": gbps,
                "x_raw": raw_s / r.seconds,
            }
        )
        print(
            f"{r.name:<60} {r.descs!s:>6} {r.rows!s:>6} {r.seconds * 1e3:8.2f} {gbps:6.2f} "
            f"{raw_s / r.seconds:6.2f} {prep:>8} {pick:>8} {read:>8} {keep:>8} {first:>8} "
            f"{probe:>8}"
        )
    print(
        "\ndescs: descriptors posted per request (a merged run counts once); rows: the rows\n"
        "(blocks x streams) asked for, before merging; NIXL coalesces adjacent rows itself.\n"
        "prep ms: NIXL prep of the local + remote descriptor lists (once per peer); "
        "pick ms: GroupPlan.indices per request; read ms: inside engine.read() per request\n"
        "(make_prepped_xfer + post; the default UCX transport copies during the post);\n"
        "1st ms: the first load from a new prefill (handshake, descriptor lists, UCX\n"
        "connection, READ probe), not in the median; probe ms: the first of decode's two\n"
        "READ probes of the child at the handshake (extra.read_probe, auto: GPU memory), in\n"
        "1st ms unless the peer was warm.\n"
        "'x raw' = raw NIXL time / row time (>= 1: as fast as the raw transfer): pull rows\n"
        "against the raw READ, push rows against the raw WRITE. A push row's time runs from\n"
        "decode's start_load_kv to the load reported: Push, the child's rewrite and WRITE,\n"
        "Pushed (the child polls every ~1 ms between its steps)."
    )
    print_phases(rows, raw_read_s, raw_write_s)
    if digest:
        print_digest(digest, args.device)
    write_json(
        args.json,
        "bench_transfer",
        records,
        shape=asdict(shape),
        device=args.device,
        busy_progress_us=args.busy_progress_us,
        nixl_progress_us=args.nixl_progress_us,
        nixl_progress_side=args.nixl_progress_side,
        **({"digest": digest} if digest else {}),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
