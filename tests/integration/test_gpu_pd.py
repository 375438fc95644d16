"""A prefill and a decode example server with their weights and KV cache on a CUDA device
(``--device cuda``), NIXL between the two processes, vllm-router in front: output tokens and
per-step logits must equal the single-process reference run on the same device.

The rows pair different block sizes, layouts and cross-layer packing. The GPU tier runs
them all; one row also runs here on the CPU, through the same body, so the body itself is
proven on every machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbridge.examples.check import compare, http_get, make_prompts
from kvbridge.examples.device import parse_device
from kvbridge.examples.launch import Cluster
from kvbridge.examples.reference import load_model, reference_generate
from kvbridge.examples.tokenizer import ByteTokenizer
from tests.verified_loads import verifying

pytestmark = pytest.mark.integration

ATOL = 1e-4  # as scripts/run_integration.sh
NUM_PROMPTS = 4  # the second half extends the first: decode also serves prefix hits
MAX_TOKENS = 8


@dataclass(frozen=True, kw_only=True)
class Row:
    model: str
    prefill_block_size: int
    decode_block_size: int
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    transfer_mode: str = "pull"


ROWS = {
    "hybrid-64-NHD-cross-to-16-HND": Row(
        model="tiny-hybrid",
        prefill_block_size=64,
        prefill_args=("--kv-layout", "NHD", "--cross-layers"),
        decode_block_size=16,
        decode_args=("--kv-layout", "HND"),
    ),
    "hybrid-16-HND-to-48-NHD": Row(
        model="tiny-hybrid",
        prefill_block_size=16,
        prefill_args=("--kv-layout", "HND"),
        decode_block_size=48,
        decode_args=("--kv-layout", "NHD"),
    ),
    "push-state-32-NHD-to-16k8-HND-cross": Row(
        model="tiny-hybrid-state",
        prefill_block_size=32,
        prefill_args=("--kv-layout", "NHD"),
        decode_block_size=16,
        decode_args=("--kv-layout", "HND", "--kernel-block-size", "8", "--cross-layers"),
        transfer_mode="push",
    ),
}
CPU_ROW = "hybrid-64-NHD-cross-to-16-HND"


def run_pair(row: Row, device: str, logs: Path, *, slow_reads: bool = False) -> None:
    """Launch the pair on ``device``, send the prompts through the router (plain and
    streamed) and compare each answer with the reference on ``device``. ``slow_reads``:
    decode's READ probe must find its prefill's GPU memory read slowly (and say so)."""
    extra = {"extra": {"transfer_mode": row.transfer_mode}}
    cluster = Cluster(
        logs,
        prefill_kv=extra,
        decode_kv=verifying({"handshake_timeout_s": 10.0, **extra}),
        prefill_args=list(row.prefill_args),
        decode_args=list(row.decode_args),
        model=row.model,
        device=device,
        prefill_block_size=row.prefill_block_size,
        decode_block_size=row.decode_block_size,
    )
    try:
        cluster.start()
        for name in ("prefill", "decode"):
            health = json.loads(http_get(cluster[name].url + "/health")[1])
            assert health["device"] == str(parse_device(device)), health
        model, tok = load_model(row.model, device), ByteTokenizer()
        for i, prompt in enumerate(make_prompts(NUM_PROMPTS)):
            body = {
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "return_logits": True,
                "ignore_eos": True,
                "stream": i % 2 == 1,
            }
            out = cluster.complete("router", body)
            ids = tok.encode(prompt)
            want = reference_generate(model, ids, MAX_TOKENS, eos_id=None)
            got_logits = np.asarray(out["logits"], np.float32)
            verdict = compare(out["token_ids"], got_logits, want.token_ids, want.logits, ATOL)
            assert verdict.ok, f"prompt {i} ({len(ids)} tokens): {verdict.reason}"
            usage = out["usage"]
            # decode computes only the last prompt token; the rest came over the wire
            # or from its own prefix cache
            assert usage["loaded_tokens"] + usage["cached_tokens"] == len(ids) - 1, usage
            assert usage["loaded_tokens"] > 0, usage
        cluster["decode"].wait_all_free(timeout_s=10.0)
        cluster["prefill"].wait_all_free(timeout_s=10.0)
        # extra.read_probe "auto": a pulling decode READs its prefill at the handshake when
        # its cache is in GPU memory, and on one GPU host that READ runs over CUDA IPC
        m = cluster["decode"].metrics()
        probed = row.transfer_mode == "pull" and device != "cpu"
        assert m["kvbridge_read_probes_total"] == (1 if probed else 0), m
        assert m["kvbridge_read_probes_slow_total"] == (1 if slow_reads else 0), m
        assert ("UCX is likely emulating" in cluster["decode"].tail(1 << 24)) is slow_reads
    except BaseException:
        for name in ("prefill", "decode"):
            print(f"--- {name} log\n{cluster[name].tail()}")
        raise
    finally:
        cluster.close()


@pytest.mark.gpu
@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_gpu_pair_matches_the_reference_on_the_gpu(row, tmp_path):
    run_pair(row, "cuda", tmp_path)


@pytest.mark.gpu
def test_a_read_emulated_in_software_is_named_and_the_tokens_stay_exact(tmp_path, monkeypatch):
    """gpu tier: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n (both servers inherit it; it wins over
    kvbridge's own y) makes UCX emulate READs of GPU memory over TCP (0.55 GB/s on an H100,
    docs/gpu-memory.md): decode's probe counts and names it at the handshake."""
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    run_pair(ROWS[CPU_ROW], "cuda", tmp_path, slow_reads=True)


def test_the_same_pair_on_the_cpu(tmp_path):
    run_pair(ROWS[CPU_ROW], "cpu", tmp_path)
