"""Whether two descriptions are a prefill -> decode pair, by the role each carries.

A prefill (``kv_role`` ``kv_producer``) only sends and a decode (``kv_consumer``) only
loads; ``kv_both`` does either. So the prefill side must send, the decode side must load,
and the two must be different workers::

    prefill side    kv_producer | kv_both        decode side    kv_consumer | kv_both

A description from before descriptions carried the role (``kv_role`` empty) passes: its
role is unknown, not wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.connector.common.config import KVRole
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.layouts.errors import KVBridgeError

_WORDS = {KVRole.PRODUCER: "prefill", KVRole.CONSUMER: "decode", KVRole.BOTH: "prefill+decode"}
SENDS = (KVRole.PRODUCER, KVRole.BOTH)
LOADS = (KVRole.CONSUMER, KVRole.BOTH)


class RoleError(KVBridgeError):
    """A description whose ``kv_role`` is no :class:`KVRole` value."""


def role_of(desc: WorkerDescription) -> KVRole | None:
    """The description's role; None when it does not say (an older kvbridge)."""
    if not desc.kv_role:
        return None
    try:
        return KVRole(desc.kv_role)
    except ValueError:
        raise RoleError(
            f"engine {desc.engine_id!r} describes kv_role {desc.kv_role!r}; expected one of "
            f"{[r.value for r in KVRole]}"
        ) from None


def role_text(desc: WorkerDescription) -> str:
    """``decode (kv_consumer)``, or ``unknown`` for a description without a role."""
    role = role_of(desc)
    return "unknown" if role is None else f"{_WORDS[role]} ({role.value})"


@dataclass(frozen=True, kw_only=True)
class RoleRefusal:
    """Why two descriptions are no prefill -> decode pair."""

    prefill: WorkerDescription  # the description given as the prefill side
    decode: WorkerDescription  # the one given as the decode side

    @property
    def same_worker(self) -> bool:
        a, b = self.prefill, self.decode
        return (a.engine_id, a.rank, a.pp_rank) == (b.engine_id, b.rank, b.pp_rank)

    @property
    def prefill_sends(self) -> bool:
        return role_of(self.prefill) in (None, *SENDS)

    @property
    def decode_loads(self) -> bool:
        return role_of(self.decode) in (None, *LOADS)

    @property
    def swapped(self) -> bool:
        """The two pair the other way round."""
        return (
            not self.same_worker
            and role_of(self.prefill) in (None, *LOADS)
            and role_of(self.decode) in (None, *SENDS)
        )

    def text(self, prefill_name: str, decode_name: str, fix: str) -> str:
        """What ``kvbridge plan``/``probe`` print: both roles, why, and ``fix``."""
        lines = [
            "REFUSED: not a prefill -> decode pair",
            f"  prefill side {prefill_name}: engine {self.prefill.engine_id} rank "
            f"{self.prefill.rank}, {role_text(self.prefill)}",
            f"  decode side {decode_name}: engine {self.decode.engine_id} rank "
            f"{self.decode.rank}, {role_text(self.decode)}",
        ]
        if self.same_worker:
            lines.append("  both sides are the same worker: a worker never loads from itself")
        if not self.prefill_sends:
            lines.append("  the prefill side never sends (kv_role kv_producer or kv_both does)")
        if not self.decode_loads:
            lines.append("  the decode side never loads (kv_role kv_consumer or kv_both does)")
        lines.append(f"  fix: {fix}")
        return "\n".join(lines)


def check_roles(prefill: WorkerDescription, decode: WorkerDescription) -> RoleRefusal | None:
    """None when ``prefill`` may send to ``decode``; else what is wrong."""
    refusal = RoleRefusal(prefill=prefill, decode=decode)
    if refusal.same_worker or not refusal.prefill_sends or not refusal.decode_loads:
        return refusal
    return None
