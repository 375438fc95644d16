"""vLLM's objects in kvbridge's words: transfer config, KV-cache groups, params, layouts.

One place maps each vLLM notion onto kvbridge's; the connector modules only call these.
Everything here reads attributes (duck typing) so that it can be tested without building a
vLLM engine; vLLM spec classes are told apart by class name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from kvbridge.connector.common.config import ConfigError, KVTransferConfig
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MLASpec,
    SlidingWindowSpec,
    StateSharding,
    StateSpec,
    dtype_name,
)

# vLLM's --kv-transfer-config keys that kvbridge reads from the top level (vLLM 0.32 has
# no kv_ip: the side-channel host goes in kv_connector_extra_config).
_TOP_LEVEL = ("kv_role", "engine_id", "kv_port", "kv_buffer_device")

# vLLM 0.32 KVCacheLayout names -> (kvbridge layout, cross-layer?). See
# vllm/v1/kv_cache_layout.py: a permutation of the logical [L, B, H, N, C].
_VLLM_LAYOUTS: dict[str, tuple[KVLayout, bool]] = {
    "LBHNC": (KVLayout.HND, False),
    "LBNHC": (KVLayout.NHD, False),
    "BLHNC": (KVLayout.HND, True),
    "BLNHC": (KVLayout.NHD, True),
    # head-outer cross-layer: per block, each head holds every layer (HeadOrder.IN_CHUNK)
    "BHLNC": (KVLayout.HND, True),
    # per layer, heads above blocks: each (layer, head) is a region of its own whose unit
    # is one head's run of a block, L * H descriptors per block (HeadOrder.OUTER)
    "LHBNC": (KVLayout.HND, False),
}

# Keys vLLM itself adds to kv_transfer_params on the way out (its scheduler reports the
# prefill's prefix hit to the frontend); they are vLLM's, not kvbridge's, and are dropped.
# (``_p_side_truncated``: a prefill of a state or sliding-window model shortened the prompt
# by one token; vLLM's NixlConnector and kvbridge both mark it.)
_VLLM_ANNOTATIONS = frozenset({"remote_prefill_cached_tokens", "_p_side_truncated"})

# vLLM calls the connector only while it has work: an idle prefill must still answer the
# READs (UCX's control traffic) of decodes that read its blocks, and their notifications
# (a claim's Prepare, Done). Inside vLLM these replace ExtraConfig's defaults; a value the
# user sets in "extra" wins. extra.busy_progress_us (answers between a busy engine's steps)
# stays opt-in: its cost to a forward that holds the GIL (CPU backends' compiled kernels)
# or to cores pinned for OpenMP has not been measured under vLLM (docs/vllm.md).
VLLM_EXTRA_DEFAULTS: dict[str, Any] = {"nixl_progress_us": 1000, "idle_progress_ms": 5}

# what to change when a spec field kvbridge cannot move is set
_FIXES = {
    "page_size_padded": (
        " (vLLM padded the attention page up to a larger page of another layer, e.g. a "
        "Mamba state or a draft model's); start vLLM with a --block-size whose attention "
        "page holds the larger page, as vLLM's own hybrid config does"
    ),
    "state_content_bytes": (
        " (each token is one packed record of that many bytes, e.g. FlashMLA sparse's "
        "fp8_ds_mla: latent, rope and scales together); start vLLM with --kv-cache-dtype "
        "auto, or an fp8 dtype with per-tensor scales (fp8, fp8_e4m3)"
    ),
}

# vLLM KVQuantMode names whose pages hold only the KV elements (no scales inside)
_PLAIN_QUANT_MODES = frozenset({"NONE", "FP8_PER_TENSOR"})

NULL_BLOCK_ID = 0  # vLLM's block pool hands block 0 out as the "null" placeholder


def transfer_config(vllm_kv_config: Any) -> KVTransferConfig:
    """kvbridge's config from vLLM's ``KVTransferConfig``.

    Top-level vLLM keys map one to one; ``kv_load_failure_policy`` is the failure policy
    (vLLM's scheduler applies it, so kvbridge must agree); every other kvbridge key
    (``kv_ip``, ``lease_s``, ``secret``, ``extra``, ...) goes in
    ``kv_connector_extra_config``. ``extra`` starts from :data:`VLLM_EXTRA_DEFAULTS`.
    """
    extra_config = dict(getattr(vllm_kv_config, "kv_connector_extra_config", None) or {})
    clash = sorted(set(extra_config) & {*_TOP_LEVEL, "failure_policy", "kv_role"})
    if clash:
        where = {
            "failure_policy": "kv_load_failure_policy",
        }
        hints = ", ".join(f"{k} -> {where.get(k, k)}" for k in clash)
        raise ConfigError(
            f"kv_connector_extra_config sets {clash}; set them at the top level of "
            f"--kv-transfer-config instead ({hints})"
        )
    role = getattr(vllm_kv_config, "kv_role", None)
    if role is None:
        raise ConfigError("kv_role is required (kv_producer, kv_consumer or kv_both)")
    raw: dict[str, Any] = {
        "kv_role": getattr(role, "value", role),
        "engine_id": vllm_kv_config.engine_id,
        "kv_port": vllm_kv_config.kv_port,
        # vLLM's default is the platform's device type: the cache's own memory
        "kv_buffer_device": vllm_kv_config.kv_buffer_device or "auto",
        "failure_policy": getattr(vllm_kv_config, "kv_load_failure_policy", "fail"),
        **extra_config,
    }
    extra = raw.get("extra", {})
    if isinstance(extra, dict):  # anything else: the decoder names the key and the type
        raw["extra"] = {**VLLM_EXTRA_DEFAULTS, **extra}
    return KVTransferConfig.from_dict(raw)


def _state_spec(where: str, vspec: Any) -> StateSpec:
    """A vLLM ``MambaSpec`` (Mamba1/2, GDN, short conv, ...): the layer's state tensors
    back to back at the start of each page, the page padded to the attention page (what
    ``MambaBase.bind_kv_cache`` reads). Each block holds one state (see
    :func:`state_resume_block`); equal TP sizes only, unless the state is replicated."""
    # (prefill checkpoint blocks, prefix caching's extra state at the replay boundary, are
    # the engine's own business: decode reads the running state)
    spec_blocks = int(getattr(vspec, "num_speculative_blocks", 0) or 0)
    if spec_blocks and getattr(vspec, "mamba_cache_mode", "none") != "none":
        raise ConfigError(
            f"{where}: num_speculative_blocks={spec_blocks} with mamba_cache_mode="
            f"{vspec.mamba_cache_mode!r} (prefix caching): kvbridge has not been shown to "
            f"find the running state among prefix caching's checkpoint blocks and the "
            f"speculative scratch blocks; start vLLM with --no-enable-prefix-caching, or "
            f"without speculative decoding for this model"
        )
    # mode "none": a request's blocks are [running state, scratch...]; the scratch blocks
    # are the engine's own (vLLM's NixlConnector drops them alike: clip_ssm_state_blocks)
    # and kvbridge moves the first (position_block_ids)
    shapes = tuple(tuple(int(d) for d in shape) for shape in vspec.shapes)
    sharding = None  # vLLM does not say how it splits a state: equal TP sizes only
    if getattr(vspec, "tp_replicated", False):
        sharding = tuple(StateSharding(dim=None) for _ in shapes)
    return StateSpec(
        block_size=vspec.block_size,
        shapes=shapes,
        dtypes=tuple(vspec.dtypes),
        page_size_padded=vspec.page_size_padded,
        sharding=sharding,
    )


def _spec(group_id: int, layer_names: Sequence[str], vspec: Any) -> KVCacheSpec:
    kind = type(vspec).__name__
    where = f"KV-cache group {group_id} ({kind}, layers {list(layer_names)[:3]}...)"
    if kind == "MambaSpec":
        return _state_spec(where, vspec)
    if kind == "UniformTypeKVCacheSpecs":
        raise ConfigError(
            f"{where}: vLLM packs this group's layers into each block (a block-outer layout "
            f"of a hybrid model, e.g. BLHNC); kvbridge moves hybrid models laid out per layer: "
            f"set VLLM_KV_CACHE_LAYOUT=LBHNC"
        )
    if kind not in ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec"):
        raise ConfigError(
            f"{where}: kvbridge moves full attention, sliding window, MLA and Mamba state "
            f"groups; {kind} is not supported yet"
        )
    head_size_v = getattr(vspec, "head_size_v", None)
    # MLA keeps one latent per token: vLLM 0.32 says so with head_size_v=0
    no_v = kind == "MLAAttentionSpec" and head_size_v == 0
    if head_size_v not in (None, vspec.head_size) and not no_v:
        raise ConfigError(f"{where}: head_size_v={head_size_v} != head_size={vspec.head_size}")
    for name in ("page_size_padded", "num_head_slots", "state_content_bytes"):
        if getattr(vspec, name, None) is not None:
            raise ConfigError(
                f"{where}: {name}={getattr(vspec, name)} is not supported{_FIXES.get(name, '')}"
            )
    quant = getattr(vspec, "kv_quant_mode", None)
    # fp8 with per-tensor scales: the page holds plain one-byte elements (the scales are
    # the layer's, equal on both sides); per-token/head scales live in the page: refused
    if quant is not None and getattr(quant, "name", "NONE") not in _PLAIN_QUANT_MODES:
        raise ConfigError(
            f"{where}: quantised KV caches ({getattr(quant, 'name', quant)}: scales kept "
            f"inside the page) are not supported; start vLLM with --kv-cache-dtype auto, "
            f"or an fp8 dtype with per-tensor scales (fp8, fp8_e4m3, fp8_e5m2)"
        )
    common = {"block_size": vspec.block_size, "head_size": vspec.head_size, "dtype": vspec.dtype}
    if kind == "FullAttentionSpec":
        return FullAttentionSpec(num_kv_heads=vspec.num_kv_heads, **common)
    if kind == "SlidingWindowSpec":
        return SlidingWindowSpec(
            num_kv_heads=vspec.num_kv_heads, sliding_window=vspec.sliding_window, **common
        )
    return MLASpec(**common)


# vLLM --kv-cache-dtype values that store one-byte fp8 elements (as torch.uint8), by format
_FP8_FORMATS = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def kv_element_format(cache_dtype: str, storage: torch.dtype) -> str:
    """What one KV element is, for the handshake to compare: the storage dtype's name, or
    for an fp8 cache its format. vLLM stores every fp8 variant as ``torch.uint8``, so
    prefill in e4m3 and decode in e5m2 would pass a dtype check and decode would read the
    bytes in the wrong format; ``"fp8"`` is vLLM's name for e4m3. Per-tensor scales are the
    checkpoint's (or 1.0), the same on both sides of one model."""
    if cache_dtype in _FP8_FORMATS:
        return _FP8_FORMATS[cache_dtype]
    if cache_dtype in ("auto", "") or storage != torch.uint8:
        return dtype_name(storage)
    # another one-byte format under its own name; the group refuses the ones whose pages
    # hold more than elements (fp8_ds_mla: state_content_bytes; int8/int4/nvfp4 caches:
    # kv_quant_mode), so what passes is compared by name here
    return cache_dtype


def single_block_groups(vllm_kv_cache_config: Any) -> frozenset[int]:
    """State groups vLLM gives one block per request: Mamba without prefix caching
    (``mamba_cache_mode`` "none", block size ``max_model_len``), whose one block holds the
    running state whatever the position. kvbridge's state groups are position-indexed
    (block ``i`` holds the state after block ``i``'s last token), so such a group is shown
    to kvbridge with the attention block size, its one block standing at every position
    (see :func:`position_block_ids`)."""
    return frozenset(
        gid
        for gid, g in enumerate(vllm_kv_cache_config.kv_cache_groups)
        if type(g.kv_cache_spec).__name__ == "MambaSpec"
        and getattr(g.kv_cache_spec, "mamba_cache_mode", "none") == "none"
    )


def position_block_ids(
    block_ids: Sequence[Sequence[int]], single: frozenset[int]
) -> list[list[int]]:
    """vLLM's per-group block ids with each single-block group's block repeated at every
    position the other groups' lists cover (see :func:`single_block_groups`)."""
    out = [list(ids) for ids in block_ids]
    if not single:
        return out
    length = max((len(ids) for g, ids in enumerate(out) if g not in single), default=1)
    for g in single:
        out[g] = out[g][:1] * max(length, 1)
    return out


def kv_cache_config(vllm_kv_cache_config: Any) -> KVCacheConfig:
    """kvbridge's groups from vLLM's ``KVCacheConfig`` (same order, same block ids)."""
    groups = []
    for gid, g in enumerate(vllm_kv_cache_config.kv_cache_groups):
        if not getattr(g, "enable_kv_transfer", True) or getattr(g, "host_resident", False):
            raise ConfigError(
                f"KV-cache group {gid} is host-resident or excluded from transfer; "
                f"not supported by kvbridge yet"
            )
        if not g.layer_names:  # a pipeline stage without a layer of this group
            raise ConfigError(
                f"KV-cache group {gid} ({type(g.kv_cache_spec).__name__}) has no layer on "
                f"this worker: with --pipeline-parallel-size, vLLM split the model so that "
                f"a stage holds none of this group's layers (a speculative draft model's "
                f"own group lives on the last stage only), and a stage's groups must each "
                f"hold some; choose a split (VLLM_PP_LAYER_PARTITION) that gives every "
                f"stage layers of every group, or --pipeline-parallel-size 1"
            )
        groups.append(
            KVCacheGroup(
                group_id=gid,
                layer_names=tuple(g.layer_names),
                spec=_spec(gid, g.layer_names, g.kv_cache_spec),
            )
        )
    single = single_block_groups(vllm_kv_cache_config)
    attention = [g.spec.block_size for g in groups if g.group_id not in single]
    if single and attention:
        groups = [
            replace(g, spec=g.spec.with_block_size(attention[0])) if g.group_id in single else g
            for g in groups
        ]
    return KVCacheConfig(groups=tuple(groups), num_blocks=vllm_kv_cache_config.num_blocks)


def kv_layout(vllm_kv_cache_config: Any) -> tuple[KVLayout | None, bool | None]:
    """The layout vLLM resolved for the cache, if it says (None when it does not)."""
    name = getattr(vllm_kv_cache_config, "kv_cache_layout", None)
    if name is None:
        return None, None
    name = getattr(name, "name", name)
    if name not in _VLLM_LAYOUTS:
        raise ConfigError(
            f"vLLM KV-cache layout {name!r} is not supported; kvbridge reads "
            f"{sorted(_VLLM_LAYOUTS)}"
        )
    return _VLLM_LAYOUTS[name]


# Block sizes every GPU attention backend takes as a kernel block: a block-outer layout
# runs the kernels on whole manager blocks (vLLM does not split them).
_BLOCK_OUTER_SIZES = frozenset({16, 32, 64})


def preferred_layout(vllm_config: Any, *, is_cpu: bool) -> str | None:
    """The ``KVCacheLayout`` kvbridge asks vLLM for (``get_required_kvcache_layout``).

    ``BHLNC`` where it can: a block of every layer is one run, and each head of it too,
    so one descriptor moves a block between ranks of any TP sizes and neither side
    rewrites (vLLM's prefill may not: its prefix cache reads the blocks). Otherwise
    ``LBHNC``, head-major per layer: hybrid models (vLLM overlays the groups of a
    block-outer block, which kvbridge does not move), block sizes some backend may not
    run as one kernel block, and vLLM's CPU attention (LBHNC only). MLA: None (one
    latent head; vLLM's default layout moves whole pages). vLLM uses the answer when
    every backend supports it, and ``VLLM_KV_CACHE_LAYOUT`` overrides it.
    """
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return None
    if getattr(model, "use_mla", False):
        return None
    hybrid = getattr(model, "is_hybrid", False) or model.get_sliding_window() is not None
    block_size = getattr(vllm_config.cache_config, "block_size", None)
    if is_cpu or hybrid or block_size not in _BLOCK_OUTER_SIZES:
        return "LBHNC"
    return "BHLNC"


def parse_params(raw: object) -> KVTransferParams | None:
    """``request.kv_transfer_params`` (a dict from the API) as kvbridge params.

    vLLM-style proxies send placeholder keys as ``None`` (``"remote_block_ids": null``);
    they mean "not set" and are dropped, as are vLLM's own annotations. Any other unknown
    key, or a bad value, raises ``ParamsError`` naming the field.
    """
    if raw is None:
        return None
    if isinstance(raw, KVTransferParams):
        return raw
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if v is not None and k not in _VLLM_ANNOTATIONS}
    return KVTransferParams.from_dict(raw)


def engine_block_ids(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """vLLM's per-group block ids with the null placeholder as -1 (kvbridge's "no block")."""
    return [[-1 if b == NULL_BLOCK_ID else int(b) for b in ids] for ids in block_ids]
