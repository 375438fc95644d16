"""Ordering kvbridge's own kernels and NIXL's transfers against the engine's streams.

Who touches a block, in what order::

    engine     forward pass writes a request's KV (its stream)
               reads the step's output (vLLM: sampled tokens to the host, a stream sync)
               request_finished -> params leave prefill       <- the engine contract: the
                                                                 forward that wrote the
                                                                 blocks has finished
    prefill    rewrite after save / host-mirror copy (kvbridge kernels, this thread's
               current stream)  -> fence("sender rewrite")    before a claim is answered
                                                                 or a WRITE is posted
               packed rows gathered into its arena
                                -> fence("packed rows")       the same
    NIXL       READ (decode) or WRITE (prefill) of the blocks
    decode     a staging round arrived: the engine splits its pages into blocks
               -> fence("staged split")                       before the slots go back
                                                                 (the next round's READs
                                                                 land in them)
               NIXL says every READ is done (or prefill answered Pushed)
               packed rows scattered from the landing into blocks
               -> mark("packed scatter")                      the landing goes back once
                                                                 it completed (polled)
               rewrite / merge / host mirror to the cache (kvbridge kernels),
               the engine's splits of staged pages
               -> mark("load complete")                       the load is reported
                                                                 to the engine once it
                                                                 completed (polled)
                  (only when one of those ran: a load NIXL moved as it lands is
                  complete when NIXL says so, and is reported without a fence. So on
                  one host, where UCX's cuda_ipc and cuda_copy signal completion from a
                  CUDA event; GPUDirect RDMA between hosts would also need the NIC's
                  writes flushed to the GPU, which no fence here ever did)
    engine     next forward pass reads the blocks (any stream)

kvbridge's kernels run on the stream current on the calling thread (the engine's thread,
or the idle-progress thread), and every fence is taken on that thread in the same call,
right after them. So a fence is a CUDA event recorded on that stream (:meth:`mark`), not
a device-wide ``torch.cuda.synchronize``: it waits for kvbridge's kernels and for what
that stream queued before them, and for no other stream. Under vLLM the forward runs on
the same stream, so prefill's fences (before a claim is answered or a WRITE is posted:
UCX's CUDA IPC copies do not see kvbridge's streams) and the staged split's still wait
for a forward queued ahead of them. Decode does not wait at all for "load complete": the
load is reported by the first engine call that finds its mark complete, which, when its
kernels queued behind a forward, is the next step's. The engine's own operations handed
to kvbridge (``Repacker``, ``CopyBlocksOp``) must queue on the caller's current stream
too; vLLM's do. On CPU there is nothing to wait for: a mark is complete when taken. A
recording fake of :class:`DeviceOrder` shows the order on CPU
(``tests/connector/test_device_order.py``).
"""

from __future__ import annotations

import torch


class Mark:
    """Where the calling thread's stream stood when kvbridge's kernels were queued."""

    __slots__ = ("_event", "why")

    def __init__(self, why: str, event: torch.cuda.Event | None = None) -> None:
        self.why = why
        self._event = event

    def done(self) -> bool:
        """Every kernel queued on the stream before the mark has finished (never waits)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Return once :meth:`done` (the host waits for that one stream, not the device)."""
        if self._event is not None:
            self._event.synchronize()


class DeviceOrder:
    """Orders kvbridge's kernels on one device before NIXL or the engine may use their
    output."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.num_fences = 0

    def mark(self, why: str) -> Mark:
        """A mark after every kernel the calling thread queued so far on its current stream
        of this device (``why`` names the step it closes, for a recording fake and for
        debugging)."""
        self.num_fences += 1
        if self.device.type != "cuda":
            return Mark(why)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Mark(why, event)

    def fence(self, why: str) -> None:
        """Return once every kernel the calling thread queued on its current stream has
        finished: :meth:`mark`, then wait on it."""
        self.mark(why).wait()
