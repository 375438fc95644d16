"""vLLM's configs and params in kvbridge's words, built from vLLM's own config classes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from vllm.config.kv_transfer import KVTransferConfig as VLLMTransferConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec as VFull,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig as VKVCacheConfig,
)
from vllm.v1.kv_cache_interface import (
    SlidingWindowSpec as VSliding,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge.connector.common.config import ConfigError, ExtraConfig, FailurePolicy, KVRole
from kvbridge.connector.common.params import ParamsError
from kvbridge.connector.vllm import translate
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.specs import KVCacheKind, StateSpec

pytestmark = pytest.mark.vllm


def _vcfg(**kw) -> VLLMTransferConfig:
    base = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_producer", "engine_id": "p0"}
    return VLLMTransferConfig(**{**base, **kw})


def test_transfer_config_maps_top_level_and_extra_keys():
    cfg = translate.transfer_config(
        _vcfg(
            kv_port=6100,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "kv_ip": "127.0.0.2",
                "lease_s": 7,
                "extra": {"merge_runs": True},
            },
        )
    )
    assert cfg.kv_role is KVRole.PRODUCER and cfg.engine_id == "p0"
    assert (cfg.kv_ip, cfg.kv_port, cfg.lease_s) == ("127.0.0.2", 6100, 7)
    assert cfg.failure_policy is FailurePolicy.RECOMPUTE
    # vLLM's own defaults for the progress keys, under what the user set
    assert cfg.extra == ExtraConfig(merge_runs=True, nixl_progress_us=1000, idle_progress_ms=5)


def test_a_user_value_wins_over_vllms_extra_defaults():
    extra = {"extra": {"nixl_progress_us": 0}}
    cfg = translate.transfer_config(_vcfg(kv_connector_extra_config=extra))
    assert (cfg.extra.nixl_progress_us, cfg.extra.idle_progress_ms) == (0, 5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"failure_policy": "fail"}, r"failure_policy -> kv_load_failure_policy"),
        ({"kv_port": 1}, r"top level"),
        ({"lease_s": -1}, r"lease_s=-1 must be positive"),
        ({"typo_key": 1}, r"unknown kv-transfer-config key 'typo_key'; known keys: \["),
        ({"extra": {"merge_run": True}}, r"unknown kv-transfer-config key 'extra\.merge_run'"),
        ({"extra": {"merge_runs": "yes"}}, r"extra\.merge_runs='yes' must be of type bool"),
        ({"extra": [1]}, r"extra=\[1\] must be of type object"),
    ],
)
def test_bad_transfer_config_is_a_config_error(extra, message):
    with pytest.raises(ConfigError, match=message):
        translate.transfer_config(_vcfg(kv_connector_extra_config=extra))


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_buffer_device_passes_through(device):
    """Checked against the cache's device when the caches are registered."""
    assert translate.transfer_config(_vcfg(kv_buffer_device=device)).kv_buffer_device == device


def test_bad_buffer_device_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_buffer_device='xpu' is not one of"):
        translate.transfer_config(_vcfg(kv_buffer_device="xpu"))


def _full(bs: int = 32) -> VFull:
    return VFull(block_size=bs, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


def test_hybrid_groups_keep_order_kind_and_window():
    sw = VSliding(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64
    )
    vcfg = VKVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=["a.1", "a.3"], kv_cache_spec=_full()),
            KVCacheGroupSpec(layer_names=["a.0", "a.2"], kv_cache_spec=sw),
        ],
        kv_cache_layout="LBHNC",
    )
    cfg = translate.kv_cache_config(vcfg)
    assert cfg.num_blocks == 100
    assert [g.layer_names for g in cfg.groups] == [("a.1", "a.3"), ("a.0", "a.2")]
    assert [g.spec.kind for g in cfg.groups] == [
        KVCacheKind.FULL_ATTENTION,
        KVCacheKind.SLIDING_WINDOW,
    ]
    assert cfg.groups[1].spec.sliding_window == 64
    assert translate.kv_layout(vcfg) == (KVLayout.HND, False)


def test_a_pipeline_stage_without_a_layer_of_a_group_is_refused_by_name():
    """vLLM gives every stage every group, each cut to the stage's layers: a split that
    leaves a stage none of a group's layers is named, not a bare layout error."""
    sw = VSliding(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64
    )
    vcfg = VKVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=["a.3"], kv_cache_spec=_full()),
            KVCacheGroupSpec(layer_names=[], kv_cache_spec=sw),
        ],
    )
    with pytest.raises(ConfigError, match=r"group 1 \(SlidingWindowSpec\) has no layer.*"):
        translate.kv_cache_config(vcfg)


def test_unsupported_group_kind_and_layout_are_named():
    chunked = ChunkedLocalAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=8, dtype=torch.float16, attention_chunk_size=64
    )
    vcfg = VKVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["m"], kv_cache_spec=chunked)],
    )
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec is not supported yet"):
        translate.kv_cache_config(vcfg)
    # every layout vLLM defines maps (LHBNC: one region per (layer, head); BHLNC:
    # head-outer cross-layer); a layout a later vLLM adds is named, not guessed
    for layout in KVCacheLayout:
        vcfg.kv_cache_layout = layout.name
        token_major = layout in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)
        want = (KVLayout.NHD if token_major else KVLayout.HND, layout.is_block_outermost)
        assert translate.kv_layout(vcfg) == want, layout
    vcfg.kv_cache_layout = "LHNBC"
    with pytest.raises(ConfigError, match=r"'LHNBC' is not supported; kvbridge reads \[.*'LHBNC'"):
        translate.kv_layout(vcfg)


def test_mamba_group_is_a_state_group_with_vllm_shapes_dtypes_and_padded_page():
    mamba = MambaSpec(
        block_size=32,
        shapes=((3, 8), (2, 4, 4)),
        dtypes=(torch.float16, torch.float32),
        page_size_padded=512,
        mamba_cache_mode="align",
    )
    vcfg = VKVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["m"], kv_cache_spec=mamba)],
    )
    (group,) = translate.kv_cache_config(vcfg).groups
    assert isinstance(group.spec, StateSpec)
    assert group.spec.shapes == ((3, 8), (2, 4, 4))
    assert group.spec.dtypes == (torch.float16, torch.float32)
    assert (group.spec.block_size, group.spec.page_size_bytes) == (32, 512)
    assert group.spec.sharding is None  # vLLM does not say how: equal TP sizes only
    replicated = translate.kv_cache_config(
        VKVCacheConfig(
            num_blocks=10,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    layer_names=["m"], kv_cache_spec=replace(mamba, tp_replicated=True)
                )
            ],
        )
    )
    assert all(s.replicated for s in replicated.groups[0].spec.sharding)


def test_params_drop_vllm_proxy_placeholders_and_name_bad_fields():
    p = translate.parse_params(
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_block_ids": None,
            "remote_prefill_cached_tokens": 64,
        }
    )
    assert p is not None and p.do_remote_decode and not p.remote_block_ids
    with pytest.raises(ParamsError, match="unknown field `remote_blocks`"):
        translate.parse_params({"do_remote_prefill": True, "remote_blocks": [1]})
    assert translate.parse_params(None) is None
    with pytest.raises(ParamsError, match="remote_port"):
        translate.parse_params({"do_remote_prefill": True, "remote_port": "x"})


def test_null_block_becomes_placeholder():
    assert translate.engine_block_ids([[0, 0, 5], [7]]) == [[-1, -1, 5], [7]]


@pytest.mark.parametrize(
    ("cache_dtype", "storage", "want"),
    [
        ("auto", torch.bfloat16, "bfloat16"),
        ("auto", torch.float32, "float32"),
        ("fp8", torch.uint8, "fp8_e4m3"),  # vLLM's "fp8" is e4m3
        ("fp8_e4m3", torch.uint8, "fp8_e4m3"),
        ("fp8_e5m2", torch.uint8, "fp8_e5m2"),
        ("bfloat16", torch.bfloat16, "bfloat16"),
    ],
)
def test_the_kv_element_format_names_the_fp8_variant(cache_dtype, storage, want):
    assert translate.kv_element_format(cache_dtype, storage) == want


def test_fp8_e4m3_and_e5m2_caches_are_refused_at_the_handshake_by_name():
    """vLLM stores both as uint8: the storage dtype alone let prefill in e4m3 and decode in
    e5m2 pair, and decode read the bytes in the wrong format."""
    from kvbridge.handshake.compat import check_compatible
    from kvbridge.handshake.errors import IncompatiblePeerError
    from tests.handshake.descriptions import make_description

    e4m3 = translate.kv_element_format("fp8", torch.uint8)
    e5m2 = translate.kv_element_format("fp8_e5m2", torch.uint8)
    with pytest.raises(IncompatiblePeerError, match="fp8_e4m3") as err:
        check_compatible(make_description(dtype=e5m2), make_description(dtype=e4m3))
    assert err.value.differences == [("dtype", "fp8_e5m2", "fp8_e4m3")]
    check_compatible(make_description(dtype=e4m3), make_description(dtype=e4m3))


@pytest.mark.parametrize("mode", ["INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD", "NVFP4"])
def test_caches_with_scales_inside_the_page_are_refused_by_name(mode):
    from vllm.v1.kv_cache_interface import KVQuantMode

    spec = replace(_full(), dtype=torch.uint8, kv_quant_mode=KVQuantMode[mode])
    vcfg = VKVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["m"], kv_cache_spec=spec)],
    )
    with pytest.raises(
        ConfigError, match=f"quantised KV caches \\({mode}: .* --kv-cache-dtype auto"
    ):
        translate.kv_cache_config(vcfg)
    plain = replace(spec, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    vcfg.kv_cache_groups[0] = KVCacheGroupSpec(layer_names=["m"], kv_cache_spec=plain)
    (group,) = translate.kv_cache_config(vcfg).groups  # per-tensor fp8: plain bytes
    assert group.spec.dtype == torch.uint8
