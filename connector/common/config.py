"""Connector configuration, read once at the edge (CLI / JSON) into a frozen dataclass.

In the spirit of ``--kv-transfer-config``::

    {"kv_role": "kv_producer", "engine_id": "prefill-0", "kv_port": 5600,
     "failure_policy": "recompute", "lease_s": 30, "extra": {"transfer_mode": "pull"}}

Unknown keys are an error, in ``extra`` too (a typo must not silently fall back to a
default): ``EXTRA_KEYS`` lists every ``extra`` key a worker or scheduler reads.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvbridge.layouts.errors import KVBridgeError


class ConfigError(KVBridgeError, ValueError):
    """A connector configuration value is missing, unknown or out of range."""


class KVRole(enum.Enum):
    PRODUCER = "kv_producer"  # prefill: keeps finished blocks for a reader
    CONSUMER = "kv_consumer"  # decode: reads blocks from producers
    BOTH = "kv_both"


class FailurePolicy(enum.Enum):
    RECOMPUTE = "recompute"  # recompute from the last valid token
    FAIL = "fail"  # end the request with the reason


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "kv_role": (KVRole,),
    "engine_id": (str,),
    "kv_ip": (str,),
    "kv_port": (int,),
    "kv_buffer_device": (str,),
    "failure_policy": (FailurePolicy,),
    "lease_s": (int, float),
    "heartbeat_s": (int, float),
    "handshake_timeout_s": (int, float),
    "transfer_timeout_s": (int, float),
    "secret": (str, type(None)),
    "extra": (dict,),
}

# Every key of ``extra`` kvbridge reads (kvbridge.connector.worker.worker_setup and
# staging, the scheduler); max_peer_block_size is retired and refused by the scheduler
# with its own message.
EXTRA_KEYS = frozenset(
    {
        "transfer_mode",
        "rewrite_on_save",
        "staging_mib",
        "warm_peers",
        "nixl_progress_us",
        "idle_progress_ms",
        "merge_runs",
        "engine_thread_nice",
        "max_peer_block_size",
    }
)


@dataclass(frozen=True, kw_only=True)
class KVTransferConfig:
    kv_role: KVRole
    engine_id: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 5600  # side-channel base port: rank r binds kv_port + r; 0: ephemeral
    # where the memory NIXL moves lives: "auto" (the cache's own), "cpu" (a CUDA cache is
    # staged through a pinned host mirror), "cuda" / "cuda:N" (VRAM, the cache's own)
    kv_buffer_device: str = "auto"
    failure_policy: FailurePolicy = FailurePolicy.RECOMPUTE
    lease_s: float = 30.0
    heartbeat_s: float = 5.0
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    secret: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, types in _FIELD_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, types):
                expected = " or ".join(t.__name__ for t in types)
                raise ConfigError(f"{name}={value!r} must be of type {expected}")
        if not self.engine_id:
            raise ConfigError("engine_id must be a non-empty string")
        if self.kv_buffer_device != "auto":
            parse_buffer_device(self.kv_buffer_device)
        if not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_port={self.kv_port} must lie in [0, 65535]")
        for name in ("lease_s", "heartbeat_s", "handshake_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.heartbeat_s >= self.lease_s:
            raise ConfigError(
                f"heartbeat_s={self.heartbeat_s} must be shorter than lease_s={self.lease_s}, "
                f"or leases expire between heartbeats"
            )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in (KVRole.CONSUMER, KVRole.BOTH)

    @property
    def secret_bytes(self) -> bytes | None:
        return self.secret.encode() if self.secret else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVTransferConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown kv-transfer-config keys {unknown}; known: {sorted(known)}")
        values = dict(raw)
        if "kv_role" not in values:
            raise ConfigError("kv_role is required (kv_producer, kv_consumer or kv_both)")
        for name, enum_type in (("kv_role", KVRole), ("failure_policy", FailurePolicy)):
            if name in values:
                try:
                    values[name] = enum_type(values[name])
                except ValueError:
                    choices = [member.value for member in enum_type]
                    raise ConfigError(f"{name}={values[name]!r} is not one of {choices}") from None
        if not isinstance(values.get("extra", {}), dict):
            raise ConfigError("extra must be a JSON object")
        unknown = sorted(set(values.get("extra", {})) - EXTRA_KEYS)
        if unknown:
            raise ConfigError(f"unknown extra keys {unknown}; known: {sorted(EXTRA_KEYS)}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"bad kv-transfer-config: {exc}") from None

    @classmethod
    def from_json(cls, text_or_path: str) -> KVTransferConfig:
        """A JSON string, or the path of a JSON file."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            path = Path(text_or_path)
            if not path.is_file():
                raise ConfigError(f"kv-transfer-config {text_or_path!r} is neither JSON nor a file")
            text = path.read_text()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"kv-transfer-config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError("kv-transfer-config must be a JSON object")
        return cls.from_dict(raw)


def parse_buffer_device(kv_buffer_device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a device (``ConfigError`` otherwise)."""
    try:
        wanted = torch.device(kv_buffer_device)
    except (RuntimeError, ValueError):
        wanted = None
    if wanted is None or wanted.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"kv_buffer_device={kv_buffer_device!r} is not one of 'auto', 'cpu', 'cuda' or "
            f"'cuda:N' (kvbridge moves CPU or CUDA memory)"
        )
    return wanted
