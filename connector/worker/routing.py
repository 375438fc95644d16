"""Which prefill ranks a decode rank talks to for one request (tensor and pipeline parallelism).

A prefill engine at TP ``P`` has ranks ``0..P-1`` listening on ``kv_port + rank``, or (kv_port
0) on ephemeral ports that the request's ``kv_transfer_params`` list in ``remote_ports``; the
params name one rank (``remote_rank`` at ``remote_port``) and ``remote_tp_size``
(:meth:`~kvbridge.connector.common.params.KVTransferParams.rank_port` finds any rank).
A decode rank reads the prefill ranks that hold its KV heads
(:func:`kvbridge.handshake.tp.sources`) and sends its end-of-request ``Done`` to those plus
any replica no decode rank reads (so that it frees at once), telling each how many decode
ranks will report to it::

    prefill TP 2, decode TP 1:  decode r0 reads p0 (heads 0..1) and p1 (heads 2..3)
    prefill TP 1, decode TP 2:  decode r0 and r1 each read their half of p0; p0 waits
                                for 2 Dones

Pipeline stages multiply this: a decode stage talks to every prefill stage whose layers
(``remote_pp_layers`` in the params) overlap its own, each as above, and a prefill rank
waits for the Dones of every decode stage that overlaps it. Prefill stage ``s``, TP rank
``t`` is rank ``s * remote_tp_size + t``::

    prefill PP 2 (layers 0-1 | 2-3), decode PP 1:  decode reads stage 0 and stage 1
    prefill PP 1, decode PP 2 (0-1 | 2-3):         both stages read p0; p0 waits for 2 Dones
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.handshake import tp

PeerKey = tuple[str, int]  # (engine id, rank)
Span = tuple[int, int]  # model layers [first, end) of one pipeline stage
_ALL: Span = (0, 1 << 30)  # the one stage of an engine without pipeline parallelism


@dataclass(frozen=True)
class Route:
    reads: tuple[PeerKey, ...]  # prefill ranks this decode rank reads, in head order
    notify: tuple[tuple[PeerKey, int], ...]  # (prefill rank, decode ranks that report to it)
    endpoints: dict[PeerKey, tuple[str, int]]  # (host, side-channel port) of every key


def _overlap(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class Router:
    """Routes for one decode rank (``rank`` of ``tp_size``, in pipeline stage ``pp_rank``
    of an engine whose stages hold the layers ``pp_layers``; empty: no pipeline
    parallelism) of a model with ``total_kv_heads`` KV heads."""

    def __init__(
        self,
        rank: int,
        tp_size: int,
        total_kv_heads: int,
        *,
        pp_rank: int = 0,
        pp_layers: Sequence[Span] = (),
    ) -> None:
        tp.rank_heads(rank, tp_size, total_kv_heads)  # validates
        self.rank = rank
        self.tp_size = tp_size
        self.total_kv_heads = total_kv_heads
        self.stages: tuple[Span, ...] = tuple((s[0], s[1]) for s in pp_layers) or (_ALL,)
        if not 0 <= pp_rank < len(self.stages):
            raise ValueError(f"pp_rank={pp_rank} outside the {len(self.stages)} stage(s)")
        self.pp_rank = pp_rank
        self.engine_rank = pp_rank * tp_size + rank  # how prefill tells this rank apart

    def route(self, params: KVTransferParams) -> Route:
        remote_tp = params.remote_tp_size
        remote_stages: list[Span] = [(s[0], s[1]) for s in params.remote_pp_layers] or [_ALL]
        mine = self.stages[self.pp_rank]
        heads = tp.sources(self.rank, self.tp_size, remote_tp, self.total_kv_heads)
        told = tp.notified_by(self.rank, self.tp_size, remote_tp, self.total_kv_heads)
        reads: list[int] = []
        notify: list[tuple[int, int]] = []
        for stage, span in enumerate(remote_stages):
            if not _overlap(mine, span):
                continue
            first = stage * remote_tp
            reporters = sum(_overlap(s, span) for s in self.stages)
            reads += [first + s.remote_rank for s in heads]
            notify += [
                (
                    first + r,
                    reporters * tp.expected_done(r, self.tp_size, remote_tp, self.total_kv_heads),
                )
                for r in told
            ]
        engine = params.remote_engine_id
        return Route(
            reads=tuple((engine, r) for r in reads),
            notify=tuple(((engine, r), n) for r, n in notify),
            endpoints={
                (engine, r): (params.remote_host, params.rank_port(r))
                for r in {*reads, *(r for r, _ in notify)}
            },
        )
