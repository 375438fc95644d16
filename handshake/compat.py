"""What must match between two peers, as a hash and as a field-by-field diff.

A model is identified by what decides its KV cache, never by where it was loaded from:
``model_name`` (vLLM's ``--model``, a path or a hub id) is not compared, so two copies of
a model in two directories pair. Compared are the architecture (vLLM's model class) and
the weights' fingerprint (``extra.model_fingerprint``, else vLLM's served model name),
each where both sides know it, and the shapes below.

The hash covers the protocol version, the model's shapes (dtype, layer count, KV heads,
head size) and the group structure (kinds, layer names, specs without block size
or page size, which negotiation may bridge). A pipeline stage (``pp_size`` above 1) holds
only some of the model's layers, so its hash leaves the layer count and names out, and
:func:`check_compatible` leaves them to negotiation, which plans over the layers both
ranks hold (:mod:`kvbridge.handshake.layer_window`). A state spec whose TP sharding is described
counts as the whole model's state (its sharding included), the same at any TP size; one
without counts as its rank's shapes. Equal hashes are the fast path; on a mismatch
:func:`check_compatible` names every differing field with both values.
"""

from __future__ import annotations

import hashlib

import msgspec

from kvbridge.handshake.description import WorkerIdentity
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.messages import PROTOCOL_VERSION, WireSpec, WorkerDescription
from kvbridge.handshake.tp_plan import check_groups_across_tp
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.specs import KVCacheKind, StateSpec, dtype_name


class _HashInput(msgspec.Struct, array_like=True):
    protocol_version: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    groups: list[tuple[str, list[str], list[object]]]


def _group_fingerprints(
    config: KVCacheConfig, tp_size: int, *, with_layers: bool = True
) -> list[tuple[str, list[str], list[object]]]:
    out = []
    for g in config.groups:
        spec = g.spec
        names = list(g.layer_names) if with_layers else []
        if isinstance(spec, StateSpec) and spec.sharding is not None:
            # the whole model's state (rank shapes x TP on the split dims), as on any rank
            shapes, dtypes = [list(s) for s in spec.shapes], [dtype_name(d) for d in spec.dtypes]
            sharding: Sharding = [(how.dim, list(how.sections)) for how in spec.sharding]
            whole_shapes, whole_sharding = _whole_state(shapes, sharding, tp_size)
            state: list[object] = [str(whole_shapes), str(dtypes), str(whole_sharding)]
            out.append((spec.kind.value, names, state))
            continue
        # a rank's own head count follows from the model's (identity) and its TP rank
        fields: list[object] = [
            str(getattr(spec, name))
            for name in (
                "head_size",
                "dtype",
                "sliding_window",
                "shapes",
                "dtypes",
                "kv_interleaved",
            )
            if hasattr(spec, name)
        ]
        out.append((spec.kind.value, names, fields))
    return out


def compat_hash(identity: WorkerIdentity, config: KVCacheConfig) -> str:
    """A short hex digest of everything that must be equal on both sides."""
    whole = identity.pp_size == 1  # a pipeline stage holds only some of the layers
    payload = msgspec.msgpack.encode(
        _HashInput(
            protocol_version=PROTOCOL_VERSION,
            dtype=identity.dtype,
            num_layers=identity.num_layers if whole else 0,
            num_kv_heads=identity.num_kv_heads,
            head_size=identity.head_size,
            groups=_group_fingerprints(config, identity.tp_size, with_layers=whole),
        )
    )
    return hashlib.sha256(payload).hexdigest()[:32]


Sharding = list[tuple[int | None, list[int]]]  # per state tensor: (split dim, sections)


def _whole_state(
    shapes: list[list[int]], sharding: Sharding, tp_size: int
) -> tuple[list[list[int]], Sharding]:
    """The whole model's state shapes and sections from one rank's: the split dimension
    and its sections times ``tp_size``."""
    whole_shapes: list[list[int]] = []
    whole_sharding: Sharding = []
    for shape, (dim, sections) in zip(shapes, sharding, strict=True):
        whole = list(shape)
        if dim is not None and 0 <= dim < len(whole):
            whole[dim] *= tp_size
        whole_shapes.append(whole)
        whole_sharding.append((dim, [s * tp_size for s in sections]))
    return whole_shapes, whole_sharding


def _state(spec: WireSpec, tp_size: int) -> tuple[object, ...]:
    """What must be equal about a state spec on the wire: the whole model's shapes and
    sharding when described, else one rank's shapes (equal TP sizes only)."""
    if not spec.state_sharding:
        return (spec.state_shapes, spec.state_dtypes)
    sharding: Sharding = [
        (None if w.dim == -1 else w.dim, list(w.sections)) for w in spec.state_sharding
    ]
    if len(sharding) != len(spec.state_shapes):
        return (spec.state_shapes, spec.state_dtypes, sharding)  # malformed: shown as is
    whole_shapes, whole_sharding = _whole_state(spec.state_shapes, sharding, tp_size)
    return (whole_shapes, spec.state_dtypes, whole_sharding)


_IDENTITY_FIELDS = (
    "protocol_version",
    "dtype",
    "num_layers",
    "num_kv_heads",
    "head_size",
)
# compared where both sides set them ("" : an engine that does not say, or an older peer)
_NAMED_FIELDS = ("architecture", "model_fingerprint")

_HINTS = {
    "architecture": "the two sides serve different model architectures: serve the same model",
    "model_fingerprint": (
        "the two sides name different weights (extra.model_fingerprint, else vLLM's "
        "--served-model-name): if they serve the same weights, set the same "
        "extra.model_fingerprint on both (a copy of a model in another directory is the "
        "same model); else serve the same model"
    ),
}
_SHAPES_HINT = "both sides must serve the same model with the same KV-cache groups"


def check_compatible(
    local: WorkerDescription, remote: WorkerDescription, *, peer: str = ""
) -> None:
    """Raise :class:`IncompatiblePeerError` listing every field that must match but does not."""
    diffs: list[tuple[str, object, object]] = []
    staged = local.pp_size > 1 or remote.pp_size > 1  # negotiation matches the layers
    for desc in (local, remote):
        if not 0 <= desc.pp_rank < desc.pp_size:
            diffs.append(("pp_rank", desc.pp_rank, f"[0, pp_size={desc.pp_size})"))
    for name in _IDENTITY_FIELDS:
        if staged and name == "num_layers":
            continue
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            diffs.append((name, a, b))
    for name in _NAMED_FIELDS:
        a, b = getattr(local, name), getattr(remote, name)
        if a and b and a != b:
            diffs.append((name, a, b))
    # before the per-rank state shapes, which differ across TP sizes for the same model
    kinds = [KVCacheKind(g.spec.kind) for g in local.groups]
    described = [
        lg.group_id
        for lg, rg in zip(local.groups, remote.groups, strict=False)
        if lg.spec.state_sharding and rg.spec.state_sharding
    ]
    check_groups_across_tp(
        kinds, local.tp_size, remote.tp_size, peer or _name(remote), described=described
    )
    if len(local.groups) != len(remote.groups):
        diffs.append(("num_groups", len(local.groups), len(remote.groups)))
    for lg, rg in zip(local.groups, remote.groups, strict=False):
        prefix = f"groups[{lg.group_id}]"
        if lg.layer_names != rg.layer_names and not staged:
            diffs.append((f"{prefix}.layer_names", lg.layer_names, rg.layer_names))
        names = ["kind", "head_size", "dtype", "sliding_window", "kv_interleaved"]
        if local.tp_size == remote.tp_size:
            names.insert(1, "num_kv_heads")  # per rank; across TP sizes the plan checks
        for name in names:
            a, b = getattr(lg.spec, name), getattr(rg.spec, name)
            if a != b:
                diffs.append((f"{prefix}.spec.{name}", a, b))
        lstate, rstate = _state(lg.spec, local.tp_size), _state(rg.spec, remote.tp_size)
        if lstate != rstate:
            diffs.append((f"{prefix}.spec.state", lstate, rstate))
    if not diffs and not staged and local.compat_hash != remote.compat_hash:
        diffs.append(("compat_hash", local.compat_hash, remote.compat_hash))
    if diffs:
        raise IncompatiblePeerError(
            diffs,
            peer=peer or _name(remote),
            hint=_hint([name for name, _, _ in diffs]),
        )


def _hint(names: list[str]) -> str:
    """What to change for these differing fields: the named fields' own advice, and the
    shapes' where a shape differs too."""
    hints = [_HINTS[n] for n in _NAMED_FIELDS if n in names]
    if any(n not in _HINTS for n in names):
        hints.append(_SHAPES_HINT)
    return "; ".join(hints)


def _name(desc: WorkerDescription) -> str:
    stage = f"pp{desc.pp_rank}/" if desc.pp_size > 1 else ""
    return f"{desc.engine_id}/{stage}rank{desc.rank}"
