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
    NIXL       READ (decode) or WRITE (prefill) of the blocks
    decode     a staging round arrived: the engine splits its pages into blocks
               -> fence("staged split")                       before the slots go back
                                                                 (the next round's READs
                                                                 land in them)
               NIXL says every READ is done (or prefill answered Pushed)
               rewrite / merge / host mirror to the cache (kvbridge kernels),
               the engine's splits of staged pages
               -> fence("load complete")                      before the load is
                                                                 reported to the engine
                  (only when one of those ran: a load NIXL moved as it lands is
                  complete when NIXL says so, and is reported without a fence. So on
                  one host, where UCX's cuda_ipc and cuda_copy signal completion from a
                  CUDA event; GPUDirect RDMA between hosts would also need the NIC's
                  writes flushed to the GPU, which no fence here ever did)
    engine     next forward pass reads the blocks (any stream)

kvbridge's kernels run on whatever stream is current on the calling thread (the engine's
thread, or the idle-progress thread), so a fence waits for every stream of the device
(``torch.cuda.synchronize``); on CPU there is nothing to wait for. A fence is the one
place this happens: :class:`DeviceOrder` is handed to the sender and the receiver, and a
recording fake of it shows the order on CPU (``tests/connector/test_device_order.py``).
"""

from __future__ import annotations

import torch


class DeviceOrder:
    """Fences kvbridge's kernels on one device before NIXL or the engine may use their
    output."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.num_fences = 0

    def fence(self, why: str) -> None:
        """Return once every kernel queued on the device so far has finished (``why``
        names the step it closes, for a recording fake and for debugging)."""
        self.num_fences += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
