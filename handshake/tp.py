"""Which KV heads a decode rank reads from which prefill rank, across tensor-parallel sizes.

The prefill engine (the sender, "remote") and the decode engine (the reader, "local") may run
at different tensor-parallel (TP) sizes. Both shard the same ``total_kv_heads`` KV heads; at
TP size ``tp`` rank ``r`` holds:

* ``tp <= total_kv_heads``: ``total_kv_heads // tp`` heads starting at global head
  ``r * (total_kv_heads // tp)`` (``tp`` must divide ``total_kv_heads``);
* ``tp > total_kv_heads`` (GQA replication, as vLLM does): one head, global head
  ``r // (tp // total_kv_heads)`` (``tp`` must be a multiple of ``total_kv_heads``). The
  ``tp // total_kv_heads`` ranks holding the same head are its *replicas*.

MLA's latent cache is the same on every rank: it is ``total_kv_heads == 1``, every rank a
replica of head 0.

A local rank reads each of its heads from exactly one remote rank (:func:`sources`); among the
``k`` replicas of a head it picks replica ``local_rank % k``, so readers spread over replicas.
A remote rank nobody reads still waits for an end-of-request message before freeing its
blocks: local rank ``remote_rank % local_tp`` sends it (:func:`releaser`). :func:`notified_by`
and :func:`expected_done` give both ends of that bookkeeping.

Everything here is pure arithmetic on small integers; bad sizes raise
:class:`~kvbridge.layouts.errors.LayoutError` naming the numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvbridge.layouts.errors import LayoutError


@dataclass(frozen=True)
class RankHeads:
    """The KV heads one rank holds: global heads ``[first, first + count)``."""

    first: int
    count: int


@dataclass(frozen=True)
class HeadSlice:
    """Local heads ``[local_head, local_head + num_heads)`` come from ``remote_rank``.

    They are read from heads ``[remote_head, remote_head + num_heads)`` of that remote rank's
    cache. Both head indices are rank-local (0 is the first head the rank holds), not global.
    """

    remote_rank: int
    local_head: int
    remote_head: int
    num_heads: int


def _check_sizes(tp: int, total_kv_heads: int, name: str = "tp") -> None:
    """Raise :class:`LayoutError` unless ``tp`` can shard ``total_kv_heads`` KV heads."""
    if total_kv_heads < 1:
        raise LayoutError(f"total_kv_heads must be >= 1, got {total_kv_heads}")
    if tp < 1:
        raise LayoutError(f"{name} (tensor-parallel size) must be >= 1, got {tp}")
    if tp <= total_kv_heads:
        if total_kv_heads % tp:
            raise LayoutError(
                f"{name}={tp} does not divide total_kv_heads={total_kv_heads}: each rank "
                f"must hold the same number of KV heads (use a divisor of {total_kv_heads})"
            )
    elif tp % total_kv_heads:
        raise LayoutError(
            f"{name}={tp} is more than total_kv_heads={total_kv_heads} but not a multiple "
            f"of it: KV heads cannot be replicated evenly over the ranks"
        )


def _check_rank(rank: int, tp: int, name: str = "rank") -> None:
    if not 0 <= rank < tp:
        raise LayoutError(f"{name}={rank} is out of range for tensor-parallel size {tp}")


def _replicas(tp: int, total_kv_heads: int) -> int:
    """How many ranks hold each KV head at TP size ``tp`` (1 without replication)."""
    return max(1, tp // total_kv_heads)


def rank_heads(rank: int, tp: int, total_kv_heads: int) -> RankHeads:
    """The global KV heads rank ``rank`` of a TP-``tp`` engine holds.

    Raises :class:`LayoutError` when a size is not positive, ``tp`` and ``total_kv_heads``
    do not divide one another, or ``rank`` is not in ``[0, tp)``.
    """
    _check_sizes(tp, total_kv_heads)
    _check_rank(rank, tp)
    if tp <= total_kv_heads:
        count = total_kv_heads // tp
        return RankHeads(first=rank * count, count=count)
    return RankHeads(first=rank // _replicas(tp, total_kv_heads), count=1)


@functools.lru_cache(maxsize=256)  # pure, on a few small ints: asked for every load
def sources(
    local_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int
) -> tuple[HeadSlice, ...]:
    """The remote ranks local rank ``local_rank`` reads its KV heads from.

    One slice per remote rank read, sorted by ``local_head``; together they cover every head
    of the local rank exactly once. Among the ``k`` replicas of a head the reader picks
    replica ``local_rank % k``.
    """
    _check_sizes(local_tp, total_kv_heads, "local_tp")
    _check_sizes(remote_tp, total_kv_heads, "remote_tp")
    _check_rank(local_rank, local_tp, "local_rank")
    mine = rank_heads(local_rank, local_tp, total_kv_heads)
    k = _replicas(remote_tp, total_kv_heads)
    per_remote = max(1, total_kv_heads // remote_tp)  # heads each remote rank holds
    slices: list[HeadSlice] = []
    for local_head in range(mine.count):
        head = mine.first + local_head
        if k > 1:
            remote_rank, remote_head = head * k + local_rank % k, 0
        else:
            remote_rank, remote_head = divmod(head, per_remote)
        last = slices[-1] if slices else None
        if last is not None and last.remote_rank == remote_rank:
            slices[-1] = HeadSlice(
                remote_rank, last.local_head, last.remote_head, last.num_heads + 1
            )
        else:
            slices.append(HeadSlice(remote_rank, local_head, remote_head, 1))
    return tuple(slices)


@functools.lru_cache(maxsize=256)  # pure, on a few small ints: asked for every load
def readers(
    remote_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int
) -> tuple[int, ...]:
    """The local ranks (sorted) whose :func:`sources` include ``remote_rank``."""
    _check_sizes(local_tp, total_kv_heads, "local_tp")
    _check_sizes(remote_tp, total_kv_heads, "remote_tp")
    _check_rank(remote_rank, remote_tp, "remote_rank")
    return tuple(
        local_rank
        for local_rank in range(local_tp)
        if any(
            s.remote_rank == remote_rank
            for s in sources(local_rank, local_tp, remote_tp, total_kv_heads)
        )
    )


def releaser(remote_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int) -> int | None:
    """The local rank that tells an unread ``remote_rank`` it may free its blocks.

    That is ``remote_rank % local_tp`` when no local rank reads ``remote_rank`` (an unread
    replica), and None when it has readers (they notify it themselves).
    """
    if readers(remote_rank, local_tp, remote_tp, total_kv_heads):
        return None
    return remote_rank % local_tp


@functools.lru_cache(maxsize=256)  # pure, on a few small ints: asked for every load
def notified_by(
    local_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int
) -> tuple[int, ...]:
    """Every remote rank (sorted) ``local_rank`` sends its end-of-request message to.

    Those it reads from plus those it is the :func:`releaser` of.
    """
    read = {s.remote_rank for s in sources(local_rank, local_tp, remote_tp, total_kv_heads)}
    released = {
        remote_rank
        for remote_rank in range(remote_tp)
        if releaser(remote_rank, local_tp, remote_tp, total_kv_heads) == local_rank
    }
    return tuple(sorted(read | released))


def expected_done(remote_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int) -> int:
    """How many local ranks send ``remote_rank`` an end-of-request message.

    Its number of :func:`readers`, or 1 (its :func:`releaser`) when nobody reads it.
    """
    return len(readers(remote_rank, local_tp, remote_tp, total_kv_heads)) or 1
