"""Where the example model, its KV cache and the reference run live: ``--device``.

Read once at the edge (CLI, a config's constructor) into a :class:`torch.device`; a device
this machine cannot use fails there, by name, before any weights or cache are made::

    cpu       the host (default)
    cuda      the current CUDA device, resolved to its index (``cuda:0``)
    cuda:N    CUDA device N (0 <= N < torch.cuda.device_count())

Everything that leaves the device afterwards (sampled tokens, logits for a response)
goes through an explicit ``.cpu()`` where it is read.
"""

from __future__ import annotations

import argparse
import re

import torch

from kvbridge.layouts.errors import KVBridgeError

DEFAULT_DEVICE = "cpu"
CPU = torch.device("cpu")
_SPELLING = re.compile(r"(cpu|cuda)(?::(\d+))?")


class DeviceError(KVBridgeError, ValueError):
    """A device option is misspelled or names a device this machine does not have."""


def parse_device(value: str | torch.device, *, option: str = "--device") -> torch.device:
    """``value`` as a usable :class:`torch.device`, or :class:`DeviceError` naming
    ``option``, the value and what to change."""
    text = str(value).strip()
    match = _SPELLING.fullmatch(text)
    if match is None or (match[1] == "cpu" and match[2] is not None):
        raise DeviceError(f"{option} {text!r} is not a device: expected cpu, cuda or cuda:N")
    if match[1] == "cpu":
        return CPU
    if not torch.cuda.is_available():
        raise DeviceError(
            f"{option} {text}: CUDA is not available on this machine (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use {option} cpu"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if match[2] is None else int(match[2])
    if index >= count:
        have = f"{count} CUDA device" + ("s" if count != 1 else "")
        raise DeviceError(
            f"{option} {text}: this machine has {have} (cuda:0 .. cuda:{count - 1}); "
            f"pick an index below {count}"
        )
    return torch.device("cuda", index)


def add_device_argument(parser: argparse.ArgumentParser, help_suffix: str = "") -> None:
    """``--device`` as a string; :func:`parse_device` turns it into a device at the edge."""
    parser.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        help=f"cpu, cuda or cuda:N (default {DEFAULT_DEVICE}){help_suffix}",
    )
