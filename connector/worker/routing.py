"""Which prefill ranks a decode rank talks to for one request (tensor parallelism).

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
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.handshake import tp

PeerKey = tuple[str, int]  # (engine id, rank)


@dataclass(frozen=True)
class Route:
    reads: tuple[PeerKey, ...]  # prefill ranks this decode rank reads, in head order
    notify: tuple[tuple[PeerKey, int], ...]  # (prefill rank, decode ranks that report to it)
    endpoints: dict[PeerKey, tuple[str, int]]  # (host, side-channel port) of every key


class Router:
    """Routes for one decode rank (``rank`` of ``tp_size``) of a model with
    ``total_kv_heads`` KV heads."""

    def __init__(self, rank: int, tp_size: int, total_kv_heads: int) -> None:
        tp.rank_heads(rank, tp_size, total_kv_heads)  # validates
        self.rank = rank
        self.tp_size = tp_size
        self.total_kv_heads = total_kv_heads

    def route(self, params: KVTransferParams) -> Route:
        remote_tp = params.remote_tp_size
        reads = tuple(
            s.remote_rank
            for s in tp.sources(self.rank, self.tp_size, remote_tp, self.total_kv_heads)
        )
        told = tp.notified_by(self.rank, self.tp_size, remote_tp, self.total_kv_heads)
        engine = params.remote_engine_id
        return Route(
            reads=tuple((engine, r) for r in reads),
            notify=tuple(
                (
                    (engine, r),
                    tp.expected_done(r, self.tp_size, remote_tp, self.total_kv_heads),
                )
                for r in told
            ),
            endpoints={
                (engine, r): (params.remote_host, params.rank_port(r)) for r in {*reads, *told}
            },
        )
