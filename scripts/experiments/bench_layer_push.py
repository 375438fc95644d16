"""Push per request or layer by layer (issue 12): does overlapping the WRITEs with the
forward pass pay?

Two processes on this host. This one plays prefill: it runs a forward pass layer by layer
over a paged cache registered with NIXL and WRITEs the request's KV into decode's blocks.
A child (``--serve``) plays decode: it registers its own cache, polls NIXL notifications
and stamps the moment a request's last one arrives. Per prompt length, after one warm-up
round, the modes run interleaved for N rounds (medians)::

    forward    the forward pass alone                                                 F
    transfer   one WRITE of the request's blocks, every layer, no forward             T
    per-layer  the same bytes as L WRITEs (one per layer) posted back to back, no forward
    (a)        forward, then one WRITE of all blocks; wait
    (b) inline after each layer saved its KV, that layer's WRITE is posted by the forward
               thread itself (where vLLM's save_kv_layer runs); wait for all at the end
    (b) thread the same WRITEs posted by a transfer thread; the forward thread only hands
               it the layer number (under CMA, transfer() copies before it returns)

    t0 --|- layer 0 -|- layer 1 -| ... |- layer L-1 -|- logits -|
    (a)                                                         |== WRITE all ==|-> in place
    (b)              |=W0=|      |=W1=|  ...         |=W(L-1)=|--------------------> in place

Every WRITE carries a notification; decode counts them (1 for a whole request, L layer by
layer) and stamps the last with ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every
process on a host), then acknowledges over NIXL: each row's time runs from t0 (prefill's
clock) to that stamp, and prefill checks the stamp lies between t0 and the acknowledgement.
The bytes that landed are checked (sha256 of both sides' token-major KV) per mode.

``--compute model``: the example engine's model (examples/model.py), scaled up through its
ModelConfig; the hook runs right after a layer's paged attention stored its KV. On these 2
cores such a forward is ~100-1000x longer than the WRITE of its KV, far from a GPU's
ratio; ``--compute standin`` therefore replaces the layer's compute by a matmul loop sized
so that the forward lasts T / ``--ratio`` (T measured first), then writes the layer's KV
with the same paged write. Column ``best``: (b)/(a) if the copies used none of the
compute's resources (a GPU's copy engine or NIC), max(F + T/L, F/L + T) / (F + T).
The machine is shared: each sample starts once its busy share is below ``--quiet`` (or
after ``--quiet-wait-s``), and ratios are taken per round, then the median.

Run:  .venv/bin/python scripts/experiments/bench_layer_push.py --compute model \\
          --tokens 512,1024,2048
      .venv/bin/python scripts/experiments/bench_layer_push.py --compute standin --ratio 0.1 \\
          --tokens 512,1024,2048,4096,8192   [--cross-layer] [--torch-threads 1]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import enum
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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from kvbridge.cli.bench.transfer_child import TIMEOUT_S, Child
from kvbridge.cli.bench.transfer_shape import kv_digest
from kvbridge.connector.transfer.nixl_engine import NixlEngineConfig, NixlTransferEngine
from kvbridge.connector.transfer.transport import DescList, XferHandle, wait_done
from kvbridge.examples.model import FULL, ModelCaches, ModelConfig, TinyModel
from kvbridge.examples.model import SeqInput as ModelInput
from kvbridge.examples.paged_attention import AttentionCache, write_kv
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.descriptors import descriptor_table, piece_indices, piece_offsets
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.region import KVRegion, MemoryKind

POLL_S = 0.0002  # decode's notification poll: the resolution of "in place"
Hook = Callable[[int], None]


# -- pure helpers (tests/scripts/test_bench_layer_push.py) ---------------------------------


def page_rows(regions: list[KVRegion], num_layers: int) -> np.ndarray:
    """Descriptors with row ``b * num_layers + l`` = layer l's page of block b, for per-layer
    regions (one per layer) and for one cross-layer region alike, so that
    ``piece_indices(ids, num_layers, [l])`` picks one layer and ``piece_indices(ids,
    num_layers)`` every layer of blocks ``ids``."""
    if len(regions) == 1 and num_layers > 1:  # cross-layer: a block's pages side by side
        (region,) = regions
        page = region.block_bytes // num_layers
        return descriptor_table(region, piece_offsets(region, num_layers), length=page)
    assert len(regions) == num_layers, (len(regions), num_layers)
    return np.stack([descriptor_table(r) for r in regions], axis=1).reshape(-1, 3)


def ideal_layered_s(forward_s: float, transfer_s: float, num_layers: int) -> float:
    """(b) when the copies need none of the compute's resources: layer i's WRITE starts
    when layer i is computed and WRITE i-1 is done, so with f = F/L, t = T/L the last ends
    at max_i (i+1) f + (L-i) t = max(F + t, f + T)."""
    f, t = forward_s / num_layers, transfer_s / num_layers
    return max(forward_s + t, f + transfer_s)


def hidden_fraction(request_s: float, transfer_s: float, layered_s: float) -> float:
    """Share of the transfer that (b) hid under the forward, against (a) = F + T of the
    same round: 0 = no gain (serial), 1 = the transfer cost nothing, < 0 = (b) lost."""
    return (request_s - layered_s) / transfer_s


# -- what both processes build -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Setup:
    """The scaled example model and the paged cache both sides allocate (float32 KV)."""

    layers: int = 32
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    head_size: int = 64
    intermediate: int = 768
    block_size: int = 16
    max_tokens: int = 2048
    cross_layer: bool = False

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            name=f"bench-{self.layers}x{self.hidden}",
            layer_kinds=(FULL,) * self.layers,
            hidden_size=self.hidden,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_size=self.head_size,
            intermediate_size=self.intermediate,
        )

    def num_request_blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.num_request_blocks(self.max_tokens) + 16  # room to shuffle the ids

    def kv_bytes(self, tokens: int) -> int:
        return (
            self.num_request_blocks(tokens)
            * self.block_size
            * self.layers
            * (2 * self.kv_heads * self.head_size * 4)
        )

    def buffers(self) -> KVCacheBuffers:
        groups = self.model_config().kv_cache_groups(self.block_size)
        config = KVCacheConfig.uniform(groups, self.num_blocks)
        return KVCacheBuffers(config, CacheFormat(cross_layer=self.cross_layer))

    def cli(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={v}" for k, v in asdict(self).items()]


def layer_caches(buffers: KVCacheBuffers) -> ModelCaches:
    """The model's per-layer cache views over ``buffers`` (what NIXL registered)."""
    bs = buffers.config.groups[0].spec.block_size
    views = (buffers.attention_views(name) for name in buffers.config.layer_names)
    return ModelCaches(
        layers=tuple(
            AttentionCache(k=k, v=v, layout=KVLayout.NHD, kernel_block_size=bs, block_size=bs)
            for k, v in views
        )
    )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- the decode child ----------------------------------------------------------------------


def serve(setup: Setup) -> None:
    """Decode: one JSON command per line on stdin (each answered before the next comes, so
    select() never misses a line buffered by readline), ``@@`` JSON events on stdout."""

    def say(**event: object) -> None:
        sys.stdout.write("@@ " + json.dumps(event) + "\n")
        sys.stdout.flush()

    torch.set_num_threads(1)
    buffers = setup.buffers()
    regions = [asdict(r) | {"memory_kind": r.memory_kind.value} for r in buffers.regions()]
    counts: Counter[str] = Counter()
    expected: dict[str, int] = {}
    prefill = ""
    with NixlTransferEngine(NixlEngineConfig(agent_name=f"lp-D-{uuid.uuid4().hex[:8]}")) as eng:
        eng.register(buffers.tensors)
        say(event="ready", metadata=b64(eng.metadata()), regions=regions)
        while True:
            if select.select([sys.stdin], [], [], POLL_S)[0]:
                line = sys.stdin.readline()
                cmd = json.loads(line) if line else {"cmd": "quit"}
                if cmd["cmd"] == "peer":
                    prefill = eng.add_peer(base64.b64decode(cmd["metadata"]))
                    say(event="peered")
                elif cmd["cmd"] == "expect":
                    expected[cmd["rid"]] = cmd["count"]
                    say(event="armed")
                elif cmd["cmd"] == "zero":
                    ids = torch.as_tensor(cmd["block_ids"])
                    for name in buffers.config.layer_names:
                        buffers.layer_bytes(name)[ids] = 0
                    say(event="zeroed")
                elif cmd["cmd"] == "digest":
                    say(event="digest", sha256=kv_digest(buffers, cmd["block_ids"]))
                else:
                    return
            notifs = eng.get_notifs()
            if not notifs:
                continue
            now = time.monotonic()  # the batch holding the request's last notification
            for msg in notifs.get(prefill, []):
                counts[msg.decode().rsplit(":", 1)[0]] += 1
            for rid in [r for r, n in expected.items() if counts[r] >= n]:
                eng.send_notif(prefill, f"ack:{rid}".encode())
                say(event="arrived", rid=rid, t=now, notifs=counts.pop(rid))
                del expected[rid]


class DecodeChild(Child):
    """bench_transfer's child plumbing (events, waits, kill), started on this script."""

    def __init__(self, setup: Setup) -> None:  # Child.__init__ starts bench_transfer's server
        args = [sys.executable, __file__, "--serve", *setup.cli()]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ready = self.wait("ready")
        except BaseException:
            self.close()
            raise

    def ask(self, reply: str, **cmd: object) -> dict:
        self.command(**cmd)
        return self.wait(reply)


# -- prefill: the WRITEs -------------------------------------------------------------------


class Writer:
    """Prefill's NIXL side: page lists (and whole-block lists, cross-layer) prepared once
    both ways; a WRITE of one layer or of the whole request picks rows by index."""

    def __init__(self, engine: NixlTransferEngine, setup: Setup, local: KVCacheBuffers) -> None:
        self.engine = engine
        self.layers = setup.layers
        self.cross_layer = setup.cross_layer
        self.peer = ""
        self._local = local.regions()
        self._pages: tuple[DescList, DescList] | None = None  # (here, decode)
        self._blocks: tuple[DescList, DescList] | None = None
        self._layer_idx: list[tuple[np.ndarray, np.ndarray]] = []
        self._request_idx: tuple[np.ndarray, np.ndarray] | None = None

    def connect(self, metadata: bytes, remote: list[KVRegion]) -> None:
        eng, n = self.engine, self.layers
        self.peer = eng.add_peer(metadata)
        self._pages = (
            eng.prep_local(page_rows(self._local, n)),
            eng.prep_remote(self.peer, page_rows(remote, n)),
        )
        if self.cross_layer:  # a request moves as whole blocks (all layers' pages)
            self._blocks = (
                eng.prep_local(descriptor_table(self._local[0])),
                eng.prep_remote(self.peer, descriptor_table(remote[0])),
            )

    def use(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """The request's blocks here and at decode (index arrays built once per length)."""
        n = self.layers
        self._layer_idx = [
            (piece_indices(src_ids, n, [layer]), piece_indices(dst_ids, n, [layer]))
            for layer in range(n)
        ]
        if self._blocks is not None:
            self._request_idx = (src_ids.astype(np.int32), dst_ids.astype(np.int32))
        else:
            self._request_idx = (piece_indices(src_ids, n), piece_indices(dst_ids, n))

    def post_layer(self, rid: str, layer: int) -> XferHandle:
        assert self._pages is not None
        li, ri = self._layer_idx[layer]
        return self.engine.write(self._pages[0], li, self._pages[1], ri, f"{rid}:{layer}".encode())

    def post_request(self, rid: str) -> XferHandle:
        lists = self._blocks or self._pages
        assert lists is not None and self._request_idx is not None
        li, ri = self._request_idx
        return self.engine.write(lists[0], li, lists[1], ri, f"{rid}:all".encode())

    def finish(self, handles: list[XferHandle], rid: str, deadline: float) -> float:
        """Wait until every handle is DONE and decode's ack came back; the ack's time."""
        for h in handles:
            wait_done(self.engine, h, timeout_s=deadline - time.monotonic(), poll_interval_s=5e-5)
        want = f"ack:{rid}".encode()
        while time.monotonic() < deadline:
            if want in self.engine.get_notifs().get(self.peer, []):
                return time.monotonic()
            time.sleep(5e-5)
        raise SystemExit(f"no ack for {rid} within {TIMEOUT_S} s")


class LayerPoster:
    """Posts layer WRITEs from its own thread (the engine is ``shared``: NIXL locks its API)."""

    def __init__(self, writer: Writer) -> None:
        self._writer = writer
        self._jobs: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        self._handles: list[XferHandle] = []
        self._drained = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="layer-poster", daemon=True)
        self._thread.start()

    def submit(self, rid: str, layer: int) -> None:
        self._jobs.put((rid, layer))

    def drain(self, timeout_s: float) -> list[XferHandle]:
        """Handles of everything submitted so far, once all are posted."""
        self._drained.clear()
        self._jobs.put(("", -1))
        if not self._drained.wait(timeout_s):
            raise SystemExit(f"layer poster: not drained within {timeout_s} s")
        if self._error is not None:
            raise SystemExit(f"layer poster failed: {self._error!r}")
        handles, self._handles = self._handles, []
        return handles

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            rid, layer = job
            if layer < 0:
                self._drained.set()
            elif self._error is None:
                try:
                    self._handles.append(self._writer.post_layer(rid, layer))
                except Exception as exc:  # handed to the forward thread by drain()
                    self._error = exc

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)


# -- prefill: the forward pass -------------------------------------------------------------


class HookedModel(TinyModel):
    """TinyModel calling ``on_layer_saved(i)`` right after layer i's mixer: its paged
    attention has stored the layer's KV (where vLLM calls ``save_kv_layer``)."""

    on_layer_saved: Hook | None = None

    def _run(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        mixer: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        def hooked(i: int, h: torch.Tensor) -> torch.Tensor:
            out = mixer(i, h)
            if self.on_layer_saved is not None:
                self.on_layer_saved(i)
            return out

        return super()._run(token_ids, hooked)


class ModelForward:
    def __init__(self, setup: Setup, caches: ModelCaches) -> None:
        self.model = HookedModel(setup.model_config())
        self.caches = caches
        gen = np.random.default_rng(0)
        self.tokens = gen.integers(0, self.model.config.vocab_size, setup.max_tokens)
        self.seq: ModelInput | None = None

    def prepare(self, tokens: int, block_ids: np.ndarray) -> None:
        self.seq = ModelInput(
            token_ids=self.tokens[:tokens], start_pos=0, block_tables=(block_ids,)
        )

    def __call__(self, hook: Hook | None) -> None:
        assert self.seq is not None
        self.model.on_layer_saved = hook
        self.model.forward([self.seq], self.caches)


class StandInForward:
    """Per layer ``reps`` fixed 256x256 matmuls (compute of a chosen cost), then the layer's
    K/V stored with the example engine's paged write."""

    def __init__(self, setup: Setup, caches: ModelCaches) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = (torch.randn(256, 256, generator=gen) for _ in range(2))
        self.out = torch.empty(256, 256)
        shape = (setup.max_tokens, setup.kv_heads, setup.head_size)
        self.k, self.v = (torch.randn(shape, generator=gen) for _ in range(2))
        self.caches = caches
        self.reps = 0
        self.table = np.zeros(0, dtype=np.int64)
        self.positions = torch.zeros(0, dtype=torch.int64)

    def unit_s(self) -> float:
        """Median time of one matmul (re-measured per length: the machine is shared)."""
        samples = []
        for _ in range(30):
            t0 = time.perf_counter()
            torch.mm(self.a, self.b, out=self.out)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def prepare(self, tokens: int, block_ids: np.ndarray) -> None:
        self.table, self.positions = block_ids, torch.arange(tokens)

    def __call__(self, hook: Hook | None) -> None:
        n = len(self.positions)
        for layer, cache in enumerate(self.caches.layers):
            for _ in range(self.reps):
                torch.mm(self.a, self.b, out=self.out)
            assert isinstance(cache, AttentionCache)
            write_kv(cache, self.table, self.positions, self.k[:n], self.v[:n])
            if hook is not None:
                hook(layer)


# -- one measurement -----------------------------------------------------------------------


class Mode(enum.Enum):
    FORWARD = "forward"
    TRANSFER = "transfer"
    PER_LAYER = "per-layer"
    REQUEST = "(a) request"
    INLINE = "(b) inline"
    THREAD = "(b) thread"


@dataclass
class Sample:
    total_s: float  # t0 -> decode's stamp (forward: t0 -> forward end)
    forward_s: float = 0.0  # t0 -> forward end
    ack_s: float = 0.0  # t0 -> decode's ack back here
    transfers: int = 0
    descs: int = 0
    busy: float = 0.0  # the machine's busy share just before (Quiet)


@dataclass
class Bench:
    setup: Setup
    forward: ModelForward | StandInForward
    writer: Writer
    poster: LayerPoster
    child: DecodeChild
    buffers: KVCacheBuffers
    src_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dst_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def use(self, tokens: int, src: np.ndarray, dst: np.ndarray) -> None:
        n = self.setup.num_request_blocks(tokens)
        self.src_ids, self.dst_ids = src[:n], dst[:n]
        self.forward.prepare(tokens, self.src_ids)
        self.writer.use(self.src_ids, self.dst_ids)

    def run(self, mode: Mode, check: bool = False) -> Sample:
        if mode is Mode.FORWARD:
            t0 = time.monotonic()
            self.forward(None)
            return Sample(time.monotonic() - t0)
        rid = f"r-{uuid.uuid4().hex[:8]}"
        w, layers = self.writer, self.setup.layers
        self.child.ask("zeroed", cmd="zero", block_ids=self.dst_ids.tolist())
        count = layers if mode in (Mode.PER_LAYER, Mode.INLINE, Mode.THREAD) else 1
        self.child.ask("armed", cmd="expect", rid=rid, count=count)
        posted0 = w.engine.num_descriptors_posted
        handles: list[XferHandle] = []
        t0 = time.monotonic()
        if mode is Mode.TRANSFER:
            handles.append(w.post_request(rid))
        elif mode is Mode.PER_LAYER:
            handles += [w.post_layer(rid, layer) for layer in range(layers)]
        elif mode is Mode.REQUEST:
            self.forward(None)
            handles.append(w.post_request(rid))
        elif mode is Mode.INLINE:
            self.forward(lambda layer: handles.append(w.post_layer(rid, layer)))
        else:
            self.forward(lambda layer: self.poster.submit(rid, layer))
            handles += self.poster.drain(TIMEOUT_S)
        forward_end = time.monotonic()
        try:
            acked = w.finish(handles, rid, t0 + TIMEOUT_S + 30)
        finally:
            for h in handles:
                h.release()
        arrived = self.child.wait("arrived")
        if arrived["rid"] != rid or not t0 <= arrived["t"] <= acked:
            raise SystemExit(f"{mode.value}: arrival {arrived} outside [{t0}, {acked}] for {rid}")
        if check:
            got = self.child.ask("digest", cmd="digest", block_ids=self.dst_ids.tolist())
            if got["sha256"] != kv_digest(self.buffers, self.src_ids.tolist()):
                raise SystemExit(f"{mode.value}: decode's blocks differ from prefill's")
        descs = w.engine.num_descriptors_posted - posted0
        fwd = forward_end - t0 if mode in (Mode.REQUEST, Mode.INLINE, Mode.THREAD) else 0.0
        return Sample(arrived["t"] - t0, fwd, acked - t0, len(handles), descs)


def cpu_busy(interval_s: float = 0.25) -> float:
    """Share of this machine's CPU time that was busy over ``interval_s`` (/proc/stat).
    Measured while this process sleeps: other users' load, plus decode's ~7 % of a core."""

    def snapshot() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, all

    idle0, all0 = snapshot()
    time.sleep(interval_s)
    idle1, all1 = snapshot()
    return 1.0 - (idle1 - idle0) / max(1, all1 - all0)


@dataclass(frozen=True)
class Quiet:
    """Run a sample only once the machine is this quiet, or once ``max_wait_s`` passed."""

    max_busy: float
    max_wait_s: float

    def wait(self) -> float:
        deadline = time.monotonic() + self.max_wait_s
        while (busy := cpu_busy()) > self.max_busy and time.monotonic() < deadline:
            pass
        return busy


def measure(
    bench: Bench, modes: list[Mode], iterations: int, quiet: Quiet
) -> dict[Mode, list[Sample]]:
    """One warm-up round, then ``iterations`` rounds, modes interleaved so that the load
    other users put on the machine spreads over all of them (and ratios can be taken per
    round); each sample waits for a quiet machine first; the last round checks bytes."""
    for mode in modes:
        bench.run(mode)
    samples: dict[Mode, list[Sample]] = {m: [] for m in modes}
    for i in range(iterations):
        for mode in modes:
            busy = quiet.wait()
            sample = bench.run(mode, check=i == iterations - 1)
            sample.busy = busy
            samples[mode].append(sample)
    return samples


def calibrate_standin(bench: Bench, ratio: float, iterations: int, quiet: Quiet) -> None:
    """Size the stand-in so that F ~ T / ratio on this machine, now: from one matmul's
    time, then corrected once by the quickest of three forwards."""
    forward = bench.forward
    assert isinstance(forward, StandInForward)
    bench.run(Mode.TRANSFER)
    quiet.wait()
    target = statistics.median(bench.run(Mode.TRANSFER).total_s for _ in range(iterations))
    target /= ratio
    quiet.wait()
    forward.reps = max(1, round(target / bench.setup.layers / forward.unit_s()))
    quiet.wait()
    took = min(bench.run(Mode.FORWARD).total_s for _ in range(3))
    forward.reps = max(1, round(forward.reps * target / took))


# -- tables --------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values)


def paired(s: dict[Mode, list[Sample]], fn: Callable[..., float], *modes: Mode) -> float:
    """Median over rounds of ``fn`` of the modes' times in the same round."""
    return med([fn(*(x.total_s for x in row)) for row in zip(*(s[m] for m in modes), strict=True)])


def print_tables(setup: Setup, results: dict[int, dict[Mode, list[Sample]]]) -> None:
    F, T, A, BI, BT = Mode.FORWARD, Mode.TRANSFER, Mode.REQUEST, Mode.INLINE, Mode.THREAD
    head = (
        f"{'tokens':>6} {'KV MiB':>7} {'F ms':>8} {'T ms':>7} {'T/F':>6} {'(a) ms':>8} "
        f"{'(b)in ms':>8} {'(b)th ms':>8} {'in/(a)':>6} {'th/(a)':>6} {'hid in':>7} "
        f"{'hid th':>7} {'best':>6}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for tokens, s in results.items():
        f, t, a, bi, bt = (med([x.total_s for x in s[m]]) for m in (F, T, A, BI, BT))
        ideal = ideal_layered_s(f, t, setup.layers)
        print(
            f"{tokens:>6} {setup.kv_bytes(tokens) / 2**20:7.0f} {f * 1e3:8.1f} {t * 1e3:7.2f} "
            f"{t / f:6.1%} {a * 1e3:8.1f} {bi * 1e3:8.1f} {bt * 1e3:8.1f} "
            f"{paired(s, lambda b, a: b / a, BI, A):6.3f} "
            f"{paired(s, lambda b, a: b / a, BT, A):6.3f} "
            f"{paired(s, hidden_fraction, A, T, BI):7.0%} "
            f"{paired(s, hidden_fraction, A, T, BT):7.0%} {ideal / (f + t):6.3f}"
        )
    head = (
        f"{'tokens':>6} {'mode':<12} {'median ms':>9} {'min ms':>8} {'max ms':>8} "
        f"{'spread':>6} {'fwd ms':>8} {'tail ms':>7} {'ack ms':>8} {'busy':>5} {'xfers':>5} "
        f"{'descs':>7}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for tokens, s in results.items():
        for mode, samples in s.items():
            total = [x.total_s * 1e3 for x in samples]
            m, lo, hi = med(total), min(total), max(total)
            fwd, tail, ack = f"{'-':>8}", f"{'-':>7}", f"{'-':>8}"
            if samples[0].forward_s:
                fwd = f"{med([x.forward_s * 1e3 for x in samples]):8.1f}"
                tail = f"{med([(x.total_s - x.forward_s) * 1e3 for x in samples]):7.2f}"
            if mode is not F:
                ack = f"{med([x.ack_s * 1e3 for x in samples]):8.2f}"
            print(
                f"{tokens:>6} {mode.value:<12} {m:9.2f} {lo:8.2f} {hi:8.2f} {(hi - lo) / m:6.1%} "
                f"{fwd} {tail} {ack} {med([x.busy for x in samples]):5.0%} "
                f"{samples[0].transfers:>5} {samples[0].descs:>7}"
            )
    print(
        "\nT/F: transfer alone / forward alone. in/(a), th/(a): (b) inline, (b) thread over (a),\n"
        "median of the per-round ratios. hid: share of T that (b) hid under the forward,\n"
        "((a) - (b)) / T per round, median (noisy when T << F). best: the best (b)/(a) can\n"
        "be, copies on an engine of their own: max(F + T/L, F/L + T) / (F + T).\n"
        "fwd ms: t0 -> forward and the posts made from its thread done (CMA copies while it\n"
        "posts); tail ms: from there to decode's stamp; ack ms: t0 -> decode's ack seen here.\n"
        "spread: (max - min) / median. busy: the machine's busy share (others' load) just\n"
        "before each sample, median."
    )


# -- main ----------------------------------------------------------------------------------


def parse_args() -> tuple[argparse.Namespace, Setup]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--compute", choices=["model", "standin"], default="model")
    ap.add_argument("--tokens", default="512,1024,2048", help="prompt lengths (comma list)")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=0.1, help="standin: target T / F")
    ap.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.35,
        help="start a sample once the machine's busy share is below this (others' load)",
    )
    ap.add_argument("--quiet-wait-s", type=float, default=30.0, help="... or after this long")
    defaults = Setup()
    for name, value in asdict(defaults).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            ap.add_argument(flag, type=lambda s: s in ("1", "True", "true"), nargs="?", const=True)
        else:
            ap.add_argument(flag, type=int)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    given = {k: getattr(args, k) for k in asdict(defaults) if getattr(args, k) is not None}
    given.setdefault("max_tokens", max(args.tokens))
    return args, Setup(**given)


def main() -> None:
    args, setup = parse_args()
    if args.serve:
        serve(setup)
        return
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    buffers = setup.buffers()
    caches = layer_caches(buffers)
    forward = (
        ModelForward(setup, caches) if args.compute == "model" else StandInForward(setup, caches)
    )
    print(
        f"{args.compute}: {setup}\n{args.iterations} rounds (median) after 1 warm-up; "
        f"{os.cpu_count()} CPUs, torch {torch.get_num_threads()} threads, load "
        f"{os.getloadavg()[0]:.1f}; UCX_TLS={os.environ.get('UCX_TLS', '(default)')}",
        flush=True,
    )
    config = NixlEngineConfig(agent_name=f"lp-P-{uuid.uuid4().hex[:8]}", shared=True)
    with contextlib.ExitStack() as teardown:  # unwinds in reverse, past failures
        child = DecodeChild(setup)
        teardown.callback(child.close)
        engine = teardown.enter_context(NixlTransferEngine(config))
        engine.register(buffers.tensors)
        writer = Writer(engine, setup, buffers)
        remote = [
            KVRegion(**(r | {"memory_kind": MemoryKind(r["memory_kind"])}))
            for r in child.ready["regions"]
        ]
        writer.connect(base64.b64decode(child.ready["metadata"]), remote)
        child.ask("peered", cmd="peer", metadata=b64(engine.metadata()))
        poster = LayerPoster(writer)
        teardown.callback(poster.close)
        bench = Bench(setup, forward, writer, poster, child, buffers)
        rng = np.random.default_rng(0)
        src, dst = (rng.permutation(setup.num_blocks) for _ in range(2))
        results: dict[int, dict[Mode, list[Sample]]] = {}
        quiet = Quiet(args.quiet, args.quiet_wait_s)
        for tokens in args.tokens:
            bench.use(tokens, src, dst)
            if isinstance(forward, StandInForward):
                calibrate_standin(bench, args.ratio, args.iterations, quiet)
            results[tokens] = measure(bench, list(Mode), args.iterations, quiet)
            print(f"  done: {tokens} tokens (load {os.getloadavg()[0]:.1f})", flush=True)
        print_tables(setup, results)


if __name__ == "__main__":
    main()
