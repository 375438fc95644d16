"""Whether vLLM's CPU build decodes a Mamba2 hybrid deterministically with speculation.

Why kvbridge refuses Mamba speculative scratch blocks (``docs/vllm.md``, configurations
table): no P/D output can show a moved state right or wrong when one server, with no
connector at all, answers the same greedy request differently run to run. This starts one
plain vLLM server of ``tiny-granite-hybrid`` (block 64, no prefix caching) with n-gram
speculation and one without, sends each the same prompt ``--runs`` times, and prints the
token ids of every run and whether they agree::

    python scripts/experiments/vllm_mamba_spec_determinism.py [--runs 4]

Seen on vLLM 0.32's CPU build (2 cores, 3 runs): the plain server answered 449, 9, 402,
202, ... every time; the speculating one 449, 144, 193, ..., then 449, 202, 249, ..., then
449, 52, 471, ...: it departs from the plain answer at the second token and from itself
run to run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from kvbridge.examples.vllm.client import complete, make_prompts
from kvbridge.examples.vllm.models import ensure_model
from kvbridge.examples.vllm.procs import start_all, stop_all
from kvbridge.examples.vllm.servers import ServerSpec, vllm_service

MODEL = "tiny-granite-hybrid"
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    start, phrase = make_prompts(2, 24, seed=9301)
    prompt = start + phrase[1:] * 4  # a repeated phrase: n-gram lookup drafts from it
    common = ("--no-enable-prefix-caching",)
    specs = [
        ServerSpec(
            "plain", ensure_model(MODEL), block_size=64, enforce_eager=True, extra_args=common
        ),
        ServerSpec(
            "ngram",
            ensure_model(MODEL),
            block_size=64,
            enforce_eager=True,
            extra_args=(*common, "--speculative-config", json.dumps(NGRAM)),
        ),
    ]
    logs = Path(tempfile.mkdtemp(prefix="mamba-spec-"))
    services = [vllm_service(s, logs, slot=i) for i, s in enumerate(specs)]
    try:
        start_all(services, timeout_s=900)
        for spec, service in zip(specs, services, strict=True):
            runs = [
                complete(
                    service.url, MODEL, prompt, max_tokens=args.max_tokens, timeout_s=120
                ).token_ids
                for _ in range(args.runs)
            ]
            same = all(r == runs[0] for r in runs)
            print(f"{spec.name}: {'the same every run' if same else 'DIFFERS run to run'}")
            for r in runs:
                print("   ", r)
    finally:
        stop_all(services)
        print(f"server logs: {logs}")


if __name__ == "__main__":
    main()
