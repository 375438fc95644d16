"""Tiny deterministic checkpoints vLLM can serve offline: config, tokenizer, weights.

::

    python -m kvbridge.examples.vllm.models --name tiny-llama --out .models/tiny-llama

Everything is generated locally (nothing is downloaded): a ``tokenizers`` byte-level BPE
trained on fixed in-code text, saved through ``PreTrainedTokenizerFast``, and weights drawn
from a fixed torch seed, saved as float32 safetensors. Two runs give byte-identical files.
:func:`ensure_model` caches a model under ``<repo>/.models/<name>`` and rebuilds it only
when the directory is missing or was built by a different recipe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO_ROOT / ".models"
DTYPE = "float32"  # what the weights are saved as and what the servers are started with
VOCAB_SIZE = 512
MAX_POSITIONS = 8192
SEED = 1234
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
RECIPE_VERSION = "1"  # bump when anything below changes what is written
STAMP = "kvbridge_model.json"

# Weights: the transformers initialiser (normal, std = initializer_range) with a larger std
# than the usual 0.02, so that a 4-layer random model has peaked, input-dependent logits
# (greedy outputs vary instead of repeating one token).
INIT_STD = 0.25

_WORDS = (
    "the a cache block token layer head prefill decode worker server proxy request reply "
    "memory transfer read write page table sliding window attention model engine batch "
    "queue time fast slow small large first last next previous left right open close "
    "river mountain cloud stone light shadow garden window paper letter number circle "
    "seven eleven twenty hundred north south east west morning evening winter summer"
).split()


def _corpus() -> list[str]:
    """Fixed training text: pseudo-random sentences from a fixed word list and seed."""
    rng = random.Random(SEED)
    lines = []
    for _ in range(600):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice(".,;:!?"))
    lines.append("0123456789 ()[]{}<>+-*/=_#@&%$ ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return lines


def build_tokenizer(out: Path) -> None:
    """Byte-level BPE with ``VOCAB_SIZE`` entries (specials first), saved for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, want {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(str(out))
    # transformers' BOS insertion for fast tokenizers comes from the post-processor.
    _add_bos_post_processor(out)


def _add_bos_post_processor(out: Path) -> None:
    from tokenizers import Tokenizer, processors

    path = out / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.save(str(path))


def _common(config: Any) -> None:
    config.architectures = config.architectures or None
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_ID, EOS_ID, PAD_ID
    config.initializer_range = INIT_STD


# tiny-llama's sizes, shared by the models built on the same body (tiny-mimo)
_TINY_BODY: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": MAX_POSITIONS,
    "tie_word_embeddings": False,
}


def llama_config() -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(**_TINY_BODY)
    config.architectures = ["LlamaForCausalLM"]
    _common(config)
    return config


def gemma3_config() -> Any:
    from transformers import Gemma3TextConfig

    layers = 6
    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        max_position_embeddings=MAX_POSITIONS,
        sliding_window=64,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        tie_word_embeddings=False,  # tied + sqrt(hidden) input scaling repeats the input
    )
    config.architectures = ["Gemma3ForCausalLM"]
    _common(config)
    return config


def granite_hybrid_config() -> Any:
    """Mamba2 layers between attention layers (IBM Granite 4.0's architecture): vLLM gives
    the Mamba layers a KV-cache group of their own, one state per block (conv + SSM)."""
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_local_experts=0,  # dense: the shared MLP only
        num_experts_per_tok=0,
        mamba_n_heads=4,
        mamba_d_head=64,  # n_heads * d_head = expand * hidden_size
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=MAX_POSITIONS,
        position_embedding_type="rope",
        tie_word_embeddings=False,
    )
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    _common(config)
    return config


def eagle_config() -> Any:
    """An EAGLE draft for tiny-llama (vLLM's ``EagleLlamaForCausalLM``): one decoder layer
    fed ``fc([embedding, target hidden state])``; it shares tiny-llama's embedding and head."""
    config = llama_config()
    config.num_hidden_layers = 1
    config.architectures = ["EagleLlamaForCausalLM"]
    return config


def build_eagle_weights(config: Any, out: Path) -> None:
    """``fc`` and layer 0, drawn from the fixed seed (layer 0 has no input norm in vLLM's
    EAGLE, so none is written); config.json beside them."""
    import torch
    from safetensors.torch import save_file

    h, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    gen = torch.Generator().manual_seed(SEED)
    shapes = {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (q, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
    }
    weights = {k: torch.randn(*v, generator=gen) * INIT_STD for k, v in shapes.items()}
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(h)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    config.save_pretrained(str(out))


def mimo_config() -> Any:
    """tiny-llama's sizes as a Qwen2 body with one multi-token-prediction layer (vLLM's
    ``MiMoForCausalLM``; ``--speculative-config {"method": "mtp"}`` drafts with the MTP
    layer, vLLM's ``MiMoMTP``). Its model type stays ``qwen2`` (transformers has no MiMo):
    vLLM picks MiMo by the architecture."""
    from transformers import Qwen2Config

    config = Qwen2Config(**_TINY_BODY, use_sliding_window=False)
    config.num_nextn_predict_layers = 1
    config.architectures = ["MiMoForCausalLM"]
    _common(config)
    return config


def build_mimo_weights(config: Any, out: Path) -> None:
    """The Qwen2 body from transformers (``build_weights``), then the MTP layer's tensors
    (``model.mtp_layers.0.*``: norms, ``input_proj`` over ``[hidden, embedding]``, one
    Qwen2 decoder block) drawn from the fixed seed; config.json names MiMo again
    (``save_pretrained`` writes the class it saved)."""
    import torch
    from safetensors.torch import load_file, save_file

    architectures = list(config.architectures)  # save_pretrained sets the saved class's
    build_weights(config, out)
    h, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    gen = torch.Generator().manual_seed(SEED + 1)
    shapes = {
        "input_proj.weight": (h, 2 * h),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    norms = (
        "token_layernorm",
        "hidden_layernorm",
        "input_layernorm",
        "post_attention_layernorm",
        "final_layernorm",
    )
    path = out / "model.safetensors"
    weights = load_file(str(path))
    prefix = "model.mtp_layers.0."
    for name, shape in shapes.items():
        weights[prefix + name] = (torch.randn(*shape, generator=gen) * INIT_STD).contiguous()
    for norm in norms:
        weights[f"{prefix}{norm}.weight"] = torch.ones(h)
    save_file(weights, str(path), metadata={"format": "pt"})
    saved = json.loads((out / "config.json").read_text())
    saved["architectures"] = architectures
    (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


# Server arguments a model needs on vLLM's CPU build (added there only).
# tiny-granite-hybrid: with prefix caching (Mamba "align" mode, vLLM's default for it) vLLM
# 0.32's CPU Mamba2 prefill fails once a prompt passes one block (IndexError in
# mamba_mixer2.conv_ssm_forward, no connector involved); without it vLLM keeps one state
# block per request.
SERVER_ARGS: dict[str, tuple[str, ...]] = {
    "tiny-granite-hybrid": ("--no-enable-prefix-caching",),
}

MODELS: dict[str, Callable[[], Any]] = {
    "tiny-llama": llama_config,
    "tiny-gemma3": gemma3_config,
    "tiny-granite-hybrid": granite_hybrid_config,
    "tiny-eagle": eagle_config,  # a draft model (speculative decoding), not served alone
    "tiny-mimo": mimo_config,  # with one MTP layer (speculative decoding, "mtp")
}
# models whose weights a transformers class cannot draw (vLLM-only architectures)
WEIGHTS: dict[str, Callable[[Any, Path], None]] = {
    "tiny-eagle": build_eagle_weights,
    "tiny-mimo": build_mimo_weights,
}


def build_weights(config: Any, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPE))
        model.eval()
    model.save_pretrained(str(out), safe_serialization=True)


def build_model(name: str, out: Path) -> Path:
    """Write model ``name`` into ``out`` (created; existing files are overwritten)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    config = MODELS[name]()
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    WEIGHTS.get(name, build_weights)(config, out)
    (out / STAMP).write_text(json.dumps(_stamp(name), indent=1, sort_keys=True) + "\n")
    return out


def _stamp(name: str) -> dict[str, str]:
    source = Path(__file__).read_bytes()
    return {
        "name": name,
        "recipe": RECIPE_VERSION,
        "dtype": DTYPE,
        "source_sha256": hashlib.sha256(source).hexdigest(),
    }


def ensure_model(name: str, root: Path | str | None = None) -> Path:
    """The directory of model ``name`` under ``root`` (default ``<repo>/.models``).

    Idempotent: a directory whose stamp matches this recipe is reused as it is; otherwise
    the model is built in a temporary sibling directory and moved into place atomically.
    """
    root = Path(root) if root is not None else DEFAULT_ROOT
    target = root / name
    stamp = target / STAMP
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == _stamp(name):
                return target
        except ValueError:
            pass
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        build_model(name, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build a tiny deterministic vLLM model")
    parser.add_argument("--name", required=True, choices=sorted(MODELS))
    parser.add_argument("--out", type=Path, help="output directory (default: cached copy)")
    args = parser.parse_args(argv)
    path = build_model(args.name, args.out) if args.out else ensure_model(args.name)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
