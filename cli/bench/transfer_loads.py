"""Timing connector-driven loads for ``kvbridge bench transfer``: decode's KVBridgeWorker
loading what the prefill child keeps, its NIXL calls and descriptor picking timed, each
row's bytes checked, and where a load's time goes (decode's load phases)."""

from __future__ import annotations

import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvbridge.cli.bench import transfer_child
from kvbridge.cli.bench.transfer_child import TIMEOUT_S, Child, Idle, _config, engine_config
from kvbridge.cli.bench.transfer_shape import Shape, kv_digest, parse_format
from kvbridge.connector.common.metadata import ConnectorMetadata, LoadSpec
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.nixl_engine import MergeRuns, NixlTransferEngine
from kvbridge.connector.worker.worker import KVBridgeWorker
from kvbridge.handshake.plan_model import GroupPlan
from kvbridge.layouts.allocation import KVCacheBuffers


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
        remote_host=transfer_child.PREFILL_HOST,
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
    idle: Idle | None = None,
) -> tuple[Row, Child, KVBridgeWorker, KVCacheBuffers]:
    """``progress_us``: NIXL's progress thread on ``progress_side`` (both, prefill or
    decode; the other side runs none). ``idle``: whether the child's engine steps during
    a load, and ``extra.idle_progress_ms`` (both sides; default: it steps, none)."""
    idle = idle or Idle()
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
        idle=idle,
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
            warm=(f"{transfer_child.PREFILL_HOST}:{child.port}",) if warm else (),
            kv_ip=transfer_child.DECODE_HOST,
            verify=verify,
            busy_us=busy_us,
            gather_mib=gather_mib,
            progress_us=progress_us,
            idle_ms=idle.idle_progress_ms,
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
        if idle.engine_idle:  # its engine steps again, to report the send's end
            child.command(cmd="finish", request_id=rid)
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
