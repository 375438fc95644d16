"""``kv_transfer_params``: what crosses the HTTP hop (client -> proxy -> workers).

Prefill returns them with its response; the proxy hands them to decode unchanged. A
typed msgspec Struct that round-trips through JSON.
"""

from __future__ import annotations

import msgspec

from kvbridge.layouts.errors import KVBridgeError


class ParamsError(KVBridgeError, ValueError):
    """``kv_transfer_params`` that cannot be used as they are."""


MAX_TOKENS = 1 << 24  # bounds num_tokens and block sizes (and so every block list)
# keys an older decode does not know: sent only when set (pipeline stages)
_NEWER_KEYS = ("remote_pp_layers",)


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    do_remote_prefill: bool = False  # decode: load this request's KV from a remote prefill
    do_remote_decode: bool = False  # prefill: keep the KV for a remote decode
    remote_engine_id: str = ""
    remote_host: str = ""
    remote_port: int = 0
    # the rank remote_port belongs to (see remote_ports): pipeline stage s, TP rank t is rank
    # s * remote_tp_size + t
    remote_rank: int = 0
    remote_tp_size: int = 1  # prefill's tensor-parallel size: decode rank d reads ranks by heads
    # prefill's pipeline stages: the model layers [first, end) each holds, in stage order;
    # empty: one stage holding every layer
    remote_pp_layers: list[list[int]] = msgspec.field(default_factory=list)
    remote_block_ids: list[list[int]] = msgspec.field(default_factory=list)  # per group
    remote_first_block: list[int] = msgspec.field(default_factory=list)  # logical index of [0]
    remote_block_size: int = 0
    num_tokens: int = 0  # prompt tokens prefill computed
    remote_request_id: str = ""
    # the resume point: prefill kept the KV of tokens [0, resume_tokens) and, for state
    # groups, the state after exactly resume_tokens tokens (see
    # kvbridge.connector.scheduler.retention)
    resume_tokens: int = 0
    # set by a prefill with a secret (kvbridge.connector.common.signing): wall-clock expiry and HMAC
    expires_at: float = 0.0
    signature: str = ""
    # the side-channel port of every prefill rank, in rank order, when the prefill bound
    # ephemeral ports (kv_port 0); empty: rank r listens on remote_port - remote_rank + r
    remote_ports: list[int] = msgspec.field(default_factory=list)

    @property
    def remote_pp_size(self) -> int:
        return len(self.remote_pp_layers) or 1

    @property
    def remote_num_ranks(self) -> int:
        """Prefill's ranks: every TP rank of every pipeline stage."""
        return self.remote_tp_size * self.remote_pp_size

    def rank_port(self, rank: int) -> int:
        """The side-channel port of prefill rank ``rank``."""
        if self.remote_ports:
            if not 0 <= rank < len(self.remote_ports):
                raise ParamsError(
                    f"prefill rank {rank}: remote_ports={self.remote_ports} lists ranks "
                    f"0..{len(self.remote_ports) - 1}"
                )
            return self.remote_ports[rank]
        return self.remote_port - self.remote_rank + rank

    def to_json(self) -> bytes:
        return msgspec.json.encode(self.to_dict())

    def to_dict(self) -> dict:
        """The params as JSON-ready builtins. Keys added after a release are left out at
        their default, so that a decode of that release (which refuses unknown keys)
        still reads the params of a prefill that does not use them."""
        out = msgspec.to_builtins(self)
        for key in _NEWER_KEYS:
            if not out[key]:
                del out[key]
        return out

    @classmethod
    def from_json(cls, data: bytes | str) -> KVTransferParams:
        try:
            return msgspec.json.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ParamsError(f"invalid kv_transfer_params: {exc}") from None

    @classmethod
    def from_dict(cls, raw: object) -> KVTransferParams:
        try:
            return msgspec.convert(raw, type=cls)
        except (msgspec.ValidationError, TypeError) as exc:
            raise ParamsError(f"invalid kv_transfer_params: {exc}") from None

    def validate_for_load(self, num_groups: int) -> None:
        """Raise :class:`ParamsError` naming the field when decode cannot use these."""
        if not self.do_remote_prefill:
            raise ParamsError("do_remote_prefill is false; nothing to load")
        missing = [
            name
            for name in ("remote_engine_id", "remote_host", "remote_request_id")
            if not getattr(self, name)
        ]
        if missing:
            raise ParamsError(f"kv_transfer_params lack {missing}")
        if not 0 < self.remote_port < 65536:
            raise ParamsError(f"remote_port={self.remote_port} is not a port")
        self._validate_stages()
        if self.remote_tp_size < 1 or not 0 <= self.remote_rank < self.remote_num_ranks:
            raise ParamsError(
                f"remote_rank={self.remote_rank} must lie in [0, remote_tp_size="
                f"{self.remote_tp_size} x {self.remote_pp_size} pipeline stage(s))"
            )
        if self.remote_ports:
            self._validate_ports()
        elif self.remote_port - self.remote_rank + self.remote_num_ranks > 65536:
            raise ParamsError(
                f"remote_port={self.remote_port}: the ports of {self.remote_num_ranks} prefill "
                f"ranks do not fit below 65536"
            )
        if len(self.remote_block_ids) != num_groups:
            raise ParamsError(
                f"remote_block_ids has {len(self.remote_block_ids)} lists, this model has "
                f"{num_groups} KV-cache groups"
            )
        if self.remote_first_block and len(self.remote_first_block) != num_groups:
            raise ParamsError(
                f"remote_first_block has {len(self.remote_first_block)} entries, expected "
                f"{num_groups}"
            )
        if self.remote_block_size <= 0 or self.num_tokens < 0:
            raise ParamsError(
                f"remote_block_size={self.remote_block_size} and num_tokens={self.num_tokens} "
                f"must be positive"
            )
        if not 0 <= self.resume_tokens <= self.num_tokens:
            raise ParamsError(
                f"resume_tokens={self.resume_tokens} must lie in [0, num_tokens={self.num_tokens}]"
            )
        if self.num_tokens > MAX_TOKENS or self.remote_block_size > MAX_TOKENS:
            raise ParamsError(
                f"num_tokens={self.num_tokens} and remote_block_size={self.remote_block_size} "
                f"must be at most {MAX_TOKENS}"
            )
        # a group holds at most the blocks of the prompt (+1: a state group's resume block)
        limit = -(-self.num_tokens // self.remote_block_size) + 1
        for g, ids in enumerate(self.remote_block_ids):
            if len(ids) > limit:
                raise ParamsError(
                    f"remote_block_ids[{g}] lists {len(ids)} blocks; a {self.num_tokens}-token "
                    f"prompt in {self.remote_block_size}-token blocks has at most {limit}"
                )
            if any(b < 0 for b in ids) or len(set(ids)) != len(ids):
                raise ParamsError(f"remote_block_ids[{g}] must be distinct non-negative block ids")
        if any(f < 0 for f in self.remote_first_block):
            raise ParamsError(f"remote_first_block={self.remote_first_block} must be >= 0")

    def _validate_stages(self) -> None:
        """Stages hold consecutive, non-empty runs of layers from layer 0 on."""
        end = 0
        for stage, span in enumerate(self.remote_pp_layers):
            if len(span) != 2 or span[0] != end or span[1] <= span[0]:
                raise ParamsError(
                    f"remote_pp_layers={self.remote_pp_layers}: stage {stage} must hold "
                    f"layers [first, end) with first={end} (where the stage before ended) "
                    f"and end > first"
                )
            end = span[1]

    def _validate_ports(self) -> None:
        ports = self.remote_ports
        if len(ports) != self.remote_num_ranks:
            raise ParamsError(
                f"remote_ports lists {len(ports)} ports, remote_tp_size={self.remote_tp_size} "
                f"x {self.remote_pp_size} pipeline stage(s) = {self.remote_num_ranks} prefill "
                f"ranks need one each"
            )
        if any(not 0 < p < 65536 for p in ports):
            raise ParamsError(f"remote_ports={ports} must all be ports (1..65535)")
        if ports[self.remote_rank] != self.remote_port:
            raise ParamsError(
                f"remote_ports[{self.remote_rank}]={ports[self.remote_rank]} differs from "
                f"remote_port={self.remote_port} (remote_rank={self.remote_rank})"
            )
