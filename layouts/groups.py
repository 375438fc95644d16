"""KV-cache groups: layers that share a spec, and the pool-wide uniform page size.

All groups draw block ids from one pool, so every layer's page must have the same size
(vLLM's hybrid allocator makes the same demand). Attention pages must already agree;
state pages (which do not scale with tokens) are padded up to the attention page.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from kvbridge.layouts.errors import LayoutError, NonUniformPageError
from kvbridge.layouts.specs import AttentionSpec, KVCacheKind, KVCacheSpec, StateSpec


@dataclass(frozen=True, kw_only=True)
class KVCacheGroup:
    """Layers (by name, in model order) that share one spec and one block table."""

    group_id: int
    layer_names: tuple[str, ...]
    spec: KVCacheSpec

    def __post_init__(self) -> None:
        if not self.layer_names:
            raise LayoutError(f"KV-cache group {self.group_id} has no layers")

    @property
    def kind(self) -> KVCacheKind:
        return self.spec.kind

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def is_attention(self) -> bool:
        return isinstance(self.spec, AttentionSpec)


@dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """Groups plus the number of blocks in the shared pool; pages are uniform."""

    groups: tuple[KVCacheGroup, ...]
    num_blocks: int

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise LayoutError(f"num_blocks={self.num_blocks} must be positive")
        if not self.groups:
            raise LayoutError("a KV-cache config needs at least one group")
        ids = [g.group_id for g in self.groups]
        if ids != list(range(len(ids))):
            raise LayoutError(f"group ids must be 0..{len(ids) - 1} in order, got {ids}")
        names = [n for g in self.groups for n in g.layer_names]
        if len(set(names)) != len(names):
            raise LayoutError(f"a layer belongs to more than one group: {names}")
        sizes = {g.spec.page_size_bytes for g in self.groups}
        if len(sizes) != 1:
            detail = ", ".join(f"group {g.group_id}={g.spec.page_size_bytes}" for g in self.groups)
            raise NonUniformPageError(
                f"page sizes differ across groups ({detail}); build the config with "
                f"KVCacheConfig.uniform(...) to pad state pages"
            )

    @classmethod
    def uniform(cls, groups: list[KVCacheGroup] | tuple[KVCacheGroup, ...], num_blocks: int):
        """Pad state pages up to the common attention page size."""
        attention = [g for g in groups if isinstance(g.spec, AttentionSpec)]
        pages = {g.spec.page_size_bytes for g in attention}
        if len(pages) > 1:
            detail = ", ".join(f"group {g.group_id}={g.spec.page_size_bytes}" for g in attention)
            raise NonUniformPageError(
                f"attention page sizes differ ({detail}); choose block sizes so that "
                f"block_size * num_kv_heads * head_size * itemsize agrees across groups"
            )
        if not groups:
            raise LayoutError("a KV-cache config needs at least one group")
        if pages:
            page = pages.pop()
        else:  # states only: the largest state, rounded up to keep every state aligned
            page = max(g.spec.page_size_bytes for g in groups)
            page += -page % max(d.itemsize for g in groups for d in g.spec.dtypes)
        padded = []
        for g in groups:
            spec = g.spec
            if isinstance(spec, StateSpec):
                if spec.state_bytes > page:
                    raise NonUniformPageError(
                        f"group {g.group_id}: state needs {spec.state_bytes} bytes per page "
                        f"but the attention page is {page} bytes; raise the attention "
                        f"block size to at least "
                        f"{_min_block_size(attention, spec.state_bytes)} tokens"
                    )
                align = max(d.itemsize for d in spec.dtypes)
                if page % align:
                    raise NonUniformPageError(
                        f"group {g.group_id}: the {page}-byte page is not a multiple of the "
                        f"{align}-byte state element, so state views of every block cannot "
                        f"be aligned; pick an attention page size divisible by {align}"
                    )
                spec = replace(spec, page_size_padded=page)
            padded.append(replace(g, spec=spec))
        return cls(groups=tuple(padded), num_blocks=num_blocks)

    @property
    def page_size_bytes(self) -> int:
        return self.groups[0].spec.page_size_bytes

    @cached_property
    def layer_names(self) -> tuple[str, ...]:
        """All layers, group-major: the order of pages inside a cross-layer block."""
        return tuple(n for g in self.groups for n in g.layer_names)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def group_of(self, layer_name: str) -> KVCacheGroup:
        for g in self.groups:
            if layer_name in g.layer_names:
                return g
        raise LayoutError(f"unknown layer {layer_name!r}; known: {list(self.layer_names)}")

    def group_layer_offset(self, group_id: int) -> int:
        """Index of the group's first layer in :attr:`layer_names`."""
        return sum(g.num_layers for g in self.groups[:group_id])


def _min_block_size(attention: list[KVCacheGroup], state_bytes: int) -> int:
    spec = attention[0].spec
    assert isinstance(spec, AttentionSpec)
    per_token = spec.page_size_bytes // spec.block_size
    return -(-state_bytes // per_token)
