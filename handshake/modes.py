"""Pull or push: which side moves the bytes.

::

    pull  decode READs prefill's blocks after prefill kept them (prefill is passive)
    push  decode tells prefill where its blocks are; prefill WRITEs into them and says so

Both sides configure the mode (``extra.transfer_mode``) and advertise it in the handshake;
negotiation refuses a pair that disagrees, naming both values. On a GPU the two differ
enormously (H100, CUDA IPC: WRITE 1,336 GB/s, READ 0.45 GB/s).
"""

from __future__ import annotations

import enum

from kvbridge.layouts.errors import LayoutError


class TransferMode(enum.Enum):
    PULL = "pull"
    PUSH = "push"

    @classmethod
    def parse(cls, value: object) -> TransferMode:
        try:
            return cls(value)
        except ValueError:
            choices = [m.value for m in cls]
            raise LayoutError(f"transfer mode {value!r} is not one of {choices}") from None
