"""Single-process ground truth: greedy tokens and per-step logits without paging or transfer.

Every step runs the model's dense forward (``TinyModel.reference_logits``) over the whole
sequence so far; step ``i``'s logits are the last row, and its token is their argmax. The
engine, the servers and the prefill/decode pair must reproduce both, on the same device::

    python -m kvbridge.examples.reference --model tiny-hybrid --prompt "Hello" --max-tokens 8 \\
        --device cuda
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.examples.device import DeviceError, add_device_argument, parse_device
from kvbridge.examples.model import TinyModel
from kvbridge.examples.tokenizer import EOS_ID, ByteTokenizer


@dataclass(frozen=True, kw_only=True)
class ReferenceOutput:
    token_ids: list[int]
    logits: np.ndarray  # [steps, vocab] float32

    @property
    def text(self) -> str:
        return ByteTokenizer().decode(self.token_ids)


def load_model(name: str, device: str | torch.device = "cpu") -> TinyModel:
    """The model ``name`` with its weights on ``device`` (one copy per device)."""
    return _load_model(name, parse_device(device, option="device"))


@functools.cache
def _load_model(name: str, device: torch.device) -> TinyModel:
    return TinyModel.from_name(name, device)


def reference_generate(
    model: TinyModel,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    *,
    eos_id: int | None = EOS_ID,
) -> ReferenceOutput:
    """Greedy continuation, stopping after ``eos_id`` (when given) or ``max_tokens``.

    Runs on ``model.device``; tokens and logits are copied to the host step by step."""
    ids, out, rows = list(prompt_token_ids), [], []
    for _ in range(max_tokens):
        logits = model.reference_logits(ids)[-1]
        token = int(logits.argmax().cpu())
        rows.append(logits.to(torch.float32).cpu().numpy())
        ids.append(token)
        out.append(token)
        if token == eos_id:
            break
    vocab = model.config.vocab_size
    return ReferenceOutput(
        token_ids=out, logits=np.stack(rows) if rows else np.zeros((0, vocab), np.float32)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-hybrid")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--return-logits", action="store_true")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        device = parse_device(args.device)
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompt = ByteTokenizer().encode(args.prompt)
    result = reference_generate(load_model(args.model, device), prompt, args.max_tokens)
    body: dict = {"text": result.text, "token_ids": result.token_ids}
    if args.return_logits:
        body["logits"] = result.logits.tolist()
    json.dump(body, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
