"""A prefill and a decode worker over real NIXL, one side's outgoing notifications mutated.

:class:`Tap` sits where the sending worker's notifications reach NIXL: its engine's
``send_notif`` and the completion notification a WRITE carries (``write(..., notif)``,
prefill's ``Pushed`` of a one-WRITE round). The receiving worker runs unmodified code.
For each genuine message about a request under fuzz the tap sends ``MUTANTS_PER_MESSAGE``
mutants (``notification_mutations``) ahead of it, and with ``REPLACE_SHARE`` it sends a
mutant of the message *instead* of it::

    sending worker ──send_notif(agent, Prepare p3m0)──> Tap ──> mutant, mutant, ...,
                                                              Prepare p3m0 (or its mutant)
                                                         ──> NIXL ──> receiving worker

:class:`FuzzPair` runs batches of three requests on the pair harness
(``tests/connector/pair_harness.py``, one fake clock for both workers and schedulers):
two under fuzz (each other's foreign id) and, admitted after them, a control that no
mutant names. A batch ends when the control's load was reported; then the clock passes
every deadline and lease (``SETTLE_OFFSETS_S``) while both sides step, and what each
side still holds is recorded. :class:`Figures` counts what the tests assert on.
"""

from __future__ import annotations

import random
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from kvbridge.connector.common.notifications import decode_notification
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.errors import TransferError
from kvbridge.layouts.allocation import CacheFormat, read_group_token_major
from kvbridge.layouts.layout import KVLayout
from tests.connector.pair_harness import (
    FakeClock,
    Request,
    decode_admit,
    make_side,
    prefill_finish,
    token_ids,
)
from tests.reliability.notification_mutations import (
    Context,
    Mutant,
    Mutation,
    apply,
    base_of,
    synthesized,
)

PREFILL_FMT = CacheFormat(layout=KVLayout.NHD, cross_layer=True)  # rewrites for the reader
DECODE_FMT = CacheFormat(layout=KVLayout.HND, kernel_block_size=8)
NUM_BLOCKS = 128
MUTANTS_PER_MESSAGE = 6
REPLACE_SHARE = 0.3
LEASE_S = 30.0
# how far past a batch's start the clock is moved, a few rounds at each: past the
# transfer timeout (30 s), the lease (30 s) and the longest hold a claim may ask (600 s)
SETTLE_OFFSETS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 31.0, 45.0, 62.0, 128.0, 256.0, 512.0, 620.0, 700.0)
ROUNDS_PER_OFFSET = 4
CONTROL_TIMEOUT_S = 5.0  # real seconds for the control load of a batch (its first: ~1 s)
IDLE_PROGRESS_MS = 2.0  # the receiving worker's idle-progress thread


class Schedule:
    """Mutations still to send, by message type; a genuine message takes its own type's
    first (its fields are then real ones), then the others' in turn."""

    def __init__(self, mutations: list[Mutation]) -> None:
        self._by_type: dict[str, deque[Mutation]] = {}
        for m in mutations:
            self._by_type.setdefault(m.type_name, deque()).append(m)

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_type.values())

    def take(self, type_name: str, count: int) -> list[Mutation]:
        out: list[Mutation] = []
        own = self._by_type.get(type_name)
        while own and len(out) < count:
            out.append(own.popleft())
        others = [q for t, q in sorted(self._by_type.items()) if t != type_name]
        while len(out) < count and any(others):
            for q in others:
                if q and len(out) < count:
                    out.append(q.popleft())
        return out


@dataclass
class Sent:
    """A mutant the tap handed to NIXL, and how (``replaced``: instead of a genuine one)."""

    mutant: Mutant
    batch: int
    replaced: bool
    carried: bool = False  # a WRITE's completion notification


@dataclass
class Crash:
    side: str  # "prefill" or "decode"
    where: str
    error: str
    tail: str  # the traceback's last lines
    batch: int
    mutations: list[str]


@dataclass
class Figures:
    mutated_by_type: Counter = field(default_factory=Counter)
    replaced: int = 0
    undecodable: int = 0
    not_sent: int = 0  # mutants NIXL refused at our end (none expected)
    decoder_raised: list[str] = field(default_factory=list)  # decode_notification's defects
    crashes: list[Crash] = field(default_factory=list)
    wrong_tokens: list[str] = field(default_factory=list)
    controls_failed: list[str] = field(default_factory=list)
    # batches the receiving worker's idle-progress thread was left alone with, and those in
    # which it did not read what was sent to it
    idle_batches: int = 0
    idle_misses: list[str] = field(default_factory=list)
    loaded: int = 0
    failed: int = 0
    stuck: list[str] = field(default_factory=list)  # no outcome after every lease passed
    held_after: dict[str, int] = field(default_factory=dict)  # blocks still used, by side
    held_batches: list[str] = field(default_factory=list)
    receiver_counters: dict[str, float] = field(default_factory=dict)

    @property
    def num_mutated(self) -> int:
        return sum(self.mutated_by_type.values())

    def summary(self) -> str:
        by_type = ", ".join(f"{t} {n}" for t, n in sorted(self.mutated_by_type.items()))
        return (
            f"mutated={self.num_mutated} ({by_type}) replaced={self.replaced} "
            f"undecodable={self.undecodable} decoder_raised={len(self.decoder_raised)} "
            f"crashes={len(self.crashes)} wrong_tokens={len(self.wrong_tokens)} "
            f"controls_failed={len(self.controls_failed)} idle_misses={len(self.idle_misses)} "
            f"of {self.idle_batches} loaded={self.loaded} "
            f"failed={self.failed} stuck={len(self.stuck)} held_after={self.held_after}"
        )


class Tap:
    """Mutates what one engine sends (installed on its instance; see the module doc)."""

    def __init__(
        self,
        engine: Any,
        schedule: Schedule,
        figures: Figures,
        seed: int,
        *,
        per_message: int = MUTANTS_PER_MESSAGE,
        replace_share: float = REPLACE_SHARE,
    ) -> None:
        self._per_message, self._replace_share = per_message, replace_share
        self._send = engine.send_notif
        self._write = engine.write
        self._schedule = schedule
        self._figures = figures
        self._rng = random.Random(seed)
        self.targets: dict[str, str] = {}  # request under fuzz -> its foreign id
        self.batch = 0
        self.sent: list[Sent] = []
        self.num_sent = 0  # notifications sent through send_notif, genuine or not
        self._last: dict[str, dict] = {}  # the last genuine message of each type
        engine.send_notif = self.send_notif
        engine.write = self.write

    def send_notif(self, peer: str, msg: bytes) -> None:
        genuine = decode_notification(msg)  # ours: it decodes
        mutants, replace = self._mutants(genuine)
        for mutant in mutants:
            self._deliver(peer, mutant, replaced=False)
        if replace is not None:
            self._deliver(peer, replace, replaced=True)
            return
        self._send(peer, msg)  # the genuine one; its errors are the sender's own
        self.num_sent += 1

    def write(self, local, local_idx, remote, remote_idx, notif: bytes = b"") -> Any:
        if notif:
            mutants, replace = self._mutants(decode_notification(notif))
            for mutant in mutants:
                self._deliver(remote.peer, mutant, replaced=False)
            if replace is not None:
                notif = replace.data
                self._count(Sent(replace, self.batch, replaced=True, carried=True))
        return self._write(local, local_idx, remote, remote_idx, notif)

    def _mutants(self, genuine: Any) -> tuple[list[Mutant], Mutant | None]:
        type_name = type(genuine).__name__
        base = base_of(genuine)
        self._last[type_name] = base
        rid = getattr(genuine, "request_id", None)
        if rid not in self.targets or not len(self._schedule):
            return [], None
        ctx = Context(request_id=rid, foreign_id=self.targets[rid])
        mutations = self._schedule.take(type_name, self._per_message)
        mutants = [apply(m, self._base(m, base, rid), ctx, self._rng) for m in mutations]
        replace = None
        if mutants and mutations[0].type_name == type_name:
            if self._rng.random() < self._replace_share:
                replace = mutants.pop(0)
        return mutants, replace

    def _base(self, m: Mutation, genuine: dict, rid: str) -> dict:
        if m.type_name == genuine["type"]:
            return genuine
        last = self._last.get(m.type_name)
        if last is None:
            return synthesized(m.type_name, rid)
        out = dict(last)
        if "request_id" in out:
            out["request_id"] = rid
        if "request_ids" in out:
            out["request_ids"] = [rid]
        return out

    def _deliver(self, peer: str, mutant: Mutant, *, replaced: bool) -> None:
        try:
            self._send(peer, mutant.data)
        except TransferError:
            self._figures.not_sent += 1
            return
        self.num_sent += 1
        self._count(Sent(mutant, self.batch, replaced=replaced))

    def _count(self, sent: Sent) -> None:
        self.sent.append(sent)
        f = self._figures
        f.mutated_by_type[sent.mutant.mutation.type_name] += 1
        f.replaced += sent.replaced
        f.undecodable += not sent.mutant.decodable
        if sent.mutant.decoder_raised:
            f.decoder_raised.append(f"{sent.mutant.decoder_raised}: {sent.mutant.mutation.key}")

    def sent_in(self, batch: int) -> int:
        return sum(s.batch == batch for s in self.sent)

    def batch_keys(self, batch: int) -> list[str]:
        return [
            ("replaced " if s.replaced else "") + s.mutant.mutation.key
            for s in self.sent
            if s.batch == batch
        ]


@dataclass
class Load:
    p: Request
    d: Request
    want: torch.Tensor  # prefill's tokens before anything moved (token-major)
    num_tokens: int  # tokens decode loads
    control: bool
    outcome: str = ""  # "loaded" or "failed"
    finished: bool = False  # decode's request_finished was called
    freed: bool = False  # decode's blocks went back to its pool


class FuzzPair:
    """``direction``: whose notifications are mutated, "decode" (decode -> prefill) or
    "prefill" (prefill -> decode); ``mode``: extra.transfer_mode of both."""

    def __init__(
        self,
        direction: str,
        mode: str,
        mutations: list[Mutation],
        seed: int,
        **tap: Any,
    ) -> None:
        """``tap``: :class:`Tap`'s keyword arguments (mutants per message, replace share)."""
        self.direction, self.mode, self.seed = direction, mode, seed
        self.clock = FakeClock()
        self.figures = Figures()
        idle = {"idle_progress_ms": IDLE_PROGRESS_MS}
        extra_p = {"transfer_mode": mode, **(idle if direction == "decode" else {})}
        extra_d = {"transfer_mode": mode, "verify": "all"}
        extra_d |= idle if direction == "prefill" else {}
        self.prefill = make_side(
            "kv_producer", "prefill", 64, PREFILL_FMT, "F", self.clock,
            num_blocks=NUM_BLOCKS, lease_s=LEASE_S, extra=extra_p,
        )  # fmt: skip
        try:
            self.decode = make_side(
                "kv_consumer", "decode", 16, DECODE_FMT, "F", self.clock,
                num_blocks=NUM_BLOCKS, extra=extra_d,
            )  # fmt: skip
        except BaseException:
            self.prefill.worker.shutdown()
            raise
        sender = self.decode if direction == "decode" else self.prefill
        self.receiver = self.prefill if direction == "decode" else self.decode
        self.sides = {"prefill": self.prefill, "decode": self.decode}
        self.tap = Tap(sender.worker._engine, Schedule(mutations), self.figures, seed, **tap)
        self._rng = np.random.default_rng(seed)
        self._torch = torch.Generator().manual_seed(seed)
        self._seen: set[tuple[str, str, str]] = set()

    @property
    def receiver_name(self) -> str:
        return "prefill" if self.direction == "decode" else "decode"

    def close(self) -> None:
        self.decode.worker.shutdown()
        self.prefill.worker.shutdown()

    # -- a batch ------------------------------------------------------------------------

    def run(self) -> Figures:
        """Batches until every mutation was sent; then the end state is recorded."""
        batch = 0
        while len(self.tap._schedule):
            batch += 1
            before = self.figures.num_mutated
            self.batch(batch)
            if self.figures.num_mutated == before and batch > 3:
                raise AssertionError(f"batch {batch} sent no mutant: the tap sees no message")
        self._record_end()
        return self.figures

    def batch(self, index: int) -> None:
        self.tap.batch = index
        for side in self.sides.values():  # fresh bytes: a load that moved nothing shows
            for t in side.buffers.tensors:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=self._torch))
        names = [f"b{index}m0", f"b{index}m1", f"b{index}c"]
        loads = [self._admit(name, control=name.endswith("c")) for name in names]
        m0, m1 = loads[0].p.request_id, loads[1].p.request_id
        self.tap.targets = {m0: m1, m1: m0}
        if index % 2:
            self._idle_alone(index)
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        control = loads[-1]
        while not control.outcome and time.monotonic() < deadline:
            self._round(loads, index)
        if not control.outcome:
            waited = f"no outcome in {CONTROL_TIMEOUT_S:g} s"
            self.figures.controls_failed.append(f"batch {index}: {waited}")
        self.tap.targets = {}
        start = self.clock.now
        for offset in SETTLE_OFFSETS_S:
            self.clock.now = start + offset
            for _ in range(ROUNDS_PER_OFFSET):
                self._round(loads, index)
            if self._settled(loads):
                break
        stuck = [ld.d.request_id for ld in loads if not ld.outcome]
        self.figures.stuck += [f"batch {index}: {rid}" for rid in stuck]
        if not self._settled(loads):
            self.figures.held_batches.append(f"batch {index}: {self._holding(loads)}")
        self.clock.now = start + SETTLE_OFFSETS_S[-1] + 1.0  # later batches start after

    def _idle_alone(self, index: int) -> None:
        """After one step of each side (the schedulers hand their orders over), only the
        sending side steps: the receiving worker's idle-progress thread alone reads (and
        answers) what comes, until it read every notification sent to it."""
        f, tap = self.figures, self.tap
        f.idle_batches += 1
        sender = self.decode if self.receiver is self.prefill else self.prefill
        for name, side in self.sides.items():
            try:
                side.step()
            except Exception as exc:
                self._crash(name, "engine step", exc, index)
        metrics = self.receiver.worker.metrics
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                sender.step()
            except Exception as exc:
                self._crash(self.direction, "engine step", exc, index)
            if tap.sent_in(index) and metrics.notifications_received >= tap.num_sent:
                return
            time.sleep(0)
        f.idle_misses.append(
            f"batch {index}: read {metrics.notifications_received} of {tap.num_sent} "
            f"notifications in {CONTROL_TIMEOUT_S:g} s"
        )

    def _admit(self, name: str, *, control: bool) -> Load:
        n = int(self._rng.integers(65, 300))
        p = Request(f"p-{name}", token_ids(n, seed=int(self._rng.integers(1 << 30))))
        p.kv_transfer_params = KVTransferParams(do_remote_decode=True)
        params = prefill_finish(self.prefill, p)
        want = read_group_token_major(self.prefill.buffers, 0, np.array(p.block_ids[0]))
        d = Request(f"d-{name}", p.prompt_token_ids, params)
        num_tokens = decode_admit(self.decode, d)
        return Load(p=p, d=d, want=want, num_tokens=num_tokens, control=control)

    def _round(self, loads: list[Load], batch: int) -> None:
        for name, side in self.sides.items():
            try:
                side.step()
            except Exception as exc:
                self._crash(name, "engine step", exc, batch)
        for ld in loads:
            self._check(ld)
        time.sleep(0)  # between steps an engine lets go of the GIL (pair_harness.run_until)

    def _check(self, ld: Load) -> None:
        decode, rid = self.decode, ld.d.request_id
        if not ld.outcome:
            events = decode.events
            if any(rid in ev.loaded_request_ids for ev in events):
                ld.outcome = "loaded"
                self.figures.loaded += 1
                self._compare(ld)
            elif any(f.request_id == rid for ev in events for f in (*ev.failed, *ev.recompute)):
                ld.outcome = "failed"
                self.figures.failed += 1
                if ld.control:
                    self.figures.controls_failed.append(f"{rid}: failed")
        if ld.outcome and not ld.finished:
            ld.finished = True
            delay, _ = decode.sched.request_finished(ld.d, ld.d.block_ids)
            if not delay:
                decode.pool.free([b for ids in ld.d.block_ids for b in ids])
                ld.freed = True
        if ld.finished and not ld.freed and rid in decode.freed:
            ld.freed = True

    def _compare(self, ld: Load) -> None:
        n = ld.num_tokens
        got = read_group_token_major(
            self.decode.buffers, 0, np.array(ld.d.block_ids[0][: -(-n // 16)])
        )
        if not torch.equal(got[:, :, :n], ld.want[:, :, :n]):
            diff = (got[:, :, :n] != ld.want[:, :, :n]).flatten(3).any(dim=(0, 1, 3))
            tokens = diff.nonzero().view(-1).tolist()
            self.figures.wrong_tokens.append(
                f"{ld.d.request_id}: {len(tokens)} of {n} tokens differ (first {tokens[:5]}); "
                f"mutations of its batch: {self.tap.batch_keys(self.tap.batch)}"
            )

    def _settled(self, loads: list[Load]) -> bool:
        return not self._holding(loads)

    def _holding(self, loads: list[Load]) -> list[str]:
        out = [f"decode {ld.d.request_id} not freed" for ld in loads if not ld.freed]
        out += [
            f"prefill {ld.p.request_id} not freed"
            for ld in loads
            if ld.p.request_id not in self.prefill.freed
        ]
        for name, side in self.sides.items():
            w = side.worker
            if w.num_live_handles:
                out.append(f"{name}: {w.num_live_handles} live NIXL handles")
            if w.num_leased_staging_bytes:
                out.append(f"{name}: {w.num_leased_staging_bytes} leased staging bytes")
            receiver = w._receiver
            if receiver is not None and receiver.num_held:
                out.append(f"{name}: {receiver.num_held} quarantined loads")
        return out

    def _crash(self, side: str, where: str, exc: BaseException, batch: int) -> None:
        tail = "".join(traceback.format_exception(exc)[-4:]).strip()
        key = (side, type(exc).__name__, tail.splitlines()[-3] if tail else "")
        if key in self._seen:
            return
        self._seen.add(key)
        self.figures.crashes.append(
            Crash(side, where, f"{type(exc).__name__}: {exc}"[:300], tail, batch,
                  self.tap.batch_keys(batch))
        )  # fmt: skip

    def _record_end(self) -> None:
        f = self.figures
        f.held_after = {name: s.pool.num_used for name, s in self.sides.items()}
        w = self.receiver.worker
        f.receiver_counters = {
            "notifications_received": w.metrics.notifications_received,
            "bad_notifications": w.metrics.bad_notifications,
            "peer_message_errors": getattr(w.metrics, "peer_message_errors", 0),
            "background_thread_failures": w.metrics.background_thread_failures,
        }

    def receiver_health(self) -> list[str]:
        """What is wrong with the receiving worker's health (empty: healthy)."""
        w = self.receiver.worker
        out = []
        if w.unhealthy_reason is not None:
            out.append(f"unhealthy: {w.unhealthy_reason}")
        idle = w._idle
        if idle is None or not idle._thread.is_alive():
            out.append("its idle-progress thread is not running")
        return out


def counters_seen(figures: Figures) -> float:
    """Messages the receiving worker counted as unusable (either counter)."""
    c = figures.receiver_counters
    return c["bad_notifications"] + c["peer_message_errors"]


def dump(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()
