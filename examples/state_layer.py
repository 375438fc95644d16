"""A Mamba-like recurrent layer and the paged cache of its states.

The layer (per token ``t``, ``x_t`` the normed hidden state)::

    u_t = W_in x_t                      z_t = W_gate x_t
    c_t = silu(sum_j conv[j] * u_{t-W+1+j})             causal depthwise conv, width W
    h_t = decay * h_{t-1} + c_t (outer) (W_B c_t)       h: [d_inner, d_state], decay in (0, 1)
    y_t = W_out((h_t @ W_C c_t) * silu(z_t))

so a request's whole past is two state tensors: ``conv`` [W-1, d_inner] (the last inputs
``u``) and ``ssm`` = ``h`` [d_inner, d_state].

State cache contract. A :class:`StateCache` holds one tensor per state, shape
``(num_blocks, *state_shape)``, arbitrary strides. The state group has a block table in
*manager* block ids of ``block_size`` tokens; entry ``j`` holds the state after
``min((j + 1) * block_size, p)`` tokens, ``p`` the tokens run so far: the boundary state
of a full block, the running state in the entry of the block still filling (as vLLM's
state-space groups keep it)::

    positions  [0 ........ bs-1][bs ....... 2bs-1][2bs ... p-1]
    table      [      j=0      ][      j=1       ][  j=2 (filling)
    state      after bs         after 2bs         after p (running)

So the state after ``n`` tokens always sits in entry ``(n - 1) // bs``: a run of tokens
``p0 .. p1-1`` starts from zeros (``p0 == 0``) or from that entry, writes every boundary
it passes and its final state into entry ``(p1 - 1) // bs``. A negative entry means the
caller keeps no block there; writes to it are skipped. That is also what a KV transfer
delivers: the state after the resume point, in the entry of the resume point's block.

A *snapshot* ``(n, slot)`` also stores the state after ``n`` tokens (``p0 < n <= p1``)
into block ``slot``: a prefill keeps the state where its decode resumes (``N - 1`` of an
``N``-token prompt) while it runs the prompt's last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvbridge.layouts.errors import BlockIdError, LayoutError

States = tuple[torch.Tensor, ...]


def state_shapes(*, d_inner: int, d_state: int, conv_width: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of the (conv, ssm) states of one request."""
    return ((conv_width - 1, d_inner), (d_inner, d_state))


@dataclass(frozen=True, kw_only=True)
class StateLayerWeights:
    w_in: torch.Tensor  # [hidden, d_inner]
    w_gate: torch.Tensor  # [hidden, d_inner]
    conv: torch.Tensor  # [conv_width, d_inner]
    w_b: torch.Tensor  # [d_inner, d_state]
    w_c: torch.Tensor  # [d_inner, d_state]
    decay: torch.Tensor  # [d_inner, d_state]
    w_out: torch.Tensor  # [d_inner, hidden]

    @classmethod
    def init(
        cls, gen: torch.Generator, *, hidden: int, d_inner: int, d_state: int, conv_width: int
    ) -> StateLayerWeights:
        def randn(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        return cls(
            w_in=randn(hidden, d_inner, std=hidden**-0.5),
            w_gate=randn(hidden, d_inner, std=hidden**-0.5),
            conv=randn(conv_width, d_inner, std=conv_width**-0.5),
            w_b=randn(d_inner, d_state, std=d_inner**-0.5),
            w_c=randn(d_inner, d_state, std=d_inner**-0.5),
            decay=torch.sigmoid(randn(d_inner, d_state, std=1.0) + 2.0),
            w_out=randn(d_inner, hidden, std=d_inner**-0.5),
        )

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        d_inner, d_state = self.w_b.shape
        return state_shapes(d_inner=d_inner, d_state=d_state, conv_width=self.conv.shape[0])

    def zero_states(self) -> States:
        return tuple(
            torch.zeros(s, dtype=self.w_in.dtype, device=self.w_in.device) for s in self.shapes
        )


def scan(
    w: StateLayerWeights, x: torch.Tensor, states: States, save_after: Sequence[int] = ()
) -> tuple[torch.Tensor, States, list[States]]:
    """Run ``x`` [T, hidden] from ``states``.

    Returns the output [T, hidden], the states after the last token and the states after
    each token offset in ``save_after`` (in order).
    """
    conv_state, h = states
    width = w.conv.shape[0]
    num_tokens = x.shape[0]
    u = x @ w.w_in
    conv_in = torch.cat([conv_state, u])  # row i holds u at offset i - (width - 1)
    c = sum(w.conv[j] * conv_in[j : j + num_tokens] for j in range(width))
    c = F.silu(c)
    b, readout = c @ w.w_b, c @ w.w_c
    save = set(save_after)
    ys, saved = [], []
    for t in range(num_tokens):
        h = w.decay * h + c[t, :, None] * b[t, None, :]
        ys.append(h @ readout[t])
        if t in save:
            saved.append((conv_in[t + 1 : t + width].clone(), h.clone()))
    y = torch.stack(ys) * F.silu(x @ w.w_gate)
    return y @ w.w_out, (conv_in[num_tokens:].clone(), h), saved


@dataclass(frozen=True, kw_only=True)
class StateCache:
    """One state layer's cache: a tensor per state, each ``(num_blocks, *state_shape)``."""

    tensors: tuple[torch.Tensor, ...]
    block_size: int

    def __post_init__(self) -> None:
        if not self.tensors or len({t.shape[0] for t in self.tensors}) != 1:
            shapes = [tuple(t.shape) for t in self.tensors]
            raise LayoutError(f"StateCache: tensors {shapes} must share a leading num_blocks")
        if self.block_size <= 0:
            raise LayoutError(f"StateCache: block_size={self.block_size} must be positive")

    @classmethod
    def allocate(
        cls,
        *,
        num_blocks: int,
        block_size: int,
        shapes: Sequence[tuple[int, ...]],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> StateCache:
        tensors = tuple(torch.zeros((num_blocks, *s), dtype=dtype, device=device) for s in shapes)
        return cls(tensors=tensors, block_size=block_size)

    def check(self, shapes: Sequence[tuple[int, ...]]) -> None:
        got = tuple(tuple(t.shape[1:]) for t in self.tensors)
        if got != tuple(tuple(s) for s in shapes):
            raise LayoutError(f"StateCache holds states {got}; the layer needs {tuple(shapes)}")

    @property
    def num_blocks(self) -> int:
        return self.tensors[0].shape[0]

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockIdError(f"state block id {block_id} lies outside [0, {self.num_blocks})")

    def load(self, block_id: int) -> States:
        self._check(block_id)
        return tuple(t[block_id].clone() for t in self.tensors)

    def store(self, block_id: int, states: States) -> None:
        self._check(block_id)
        for dst, src in zip(self.tensors, states, strict=True):
            dst[block_id] = src.to(dst.dtype)


def run_paged(
    w: StateLayerWeights,
    cache: StateCache,
    x: torch.Tensor,
    *,
    start_pos: int,
    block_table: Sequence[int] | np.ndarray,
    snapshot: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Run ``x`` [T, hidden] at positions ``start_pos ..`` against the cache (see module doc)."""
    table = np.asarray(block_table, dtype=np.int64)
    bs = cache.block_size
    num_tokens = x.shape[0]
    end = start_pos + num_tokens
    last = (end - 1) // bs  # the entry that receives the final state
    if last >= table.size:
        raise BlockIdError(
            f"state group: positions up to {end - 1} need entry {last} but the block table "
            f"has {table.size} entries"
        )
    if start_pos == 0:
        states = w.zero_states()
    else:
        j = (start_pos - 1) // bs
        if table[j] < 0:
            raise BlockIdError(
                f"state group: start position {start_pos} needs the state in entry {j} but "
                f"the table {table.tolist()} has no block there"
            )
        states = cache.load(int(table[j]))
    # Boundary j sits after token (j + 1) * bs - 1; those inside start_pos .. end - 1:
    boundaries = list(range(start_pos // bs, end // bs))
    offsets = [(j + 1) * bs - 1 - start_pos for j in boundaries]
    if snapshot is not None and start_pos < snapshot[0] <= end:
        offsets.append(snapshot[0] - 1 - start_pos)
    y, final, saved = scan(w, x, states, sorted(set(offsets)))
    saved_at = dict(zip(sorted(set(offsets)), saved, strict=True))
    for j in boundaries:
        if table[j] >= 0:
            cache.store(int(table[j]), saved_at[(j + 1) * bs - 1 - start_pos])
    if table[last] >= 0 and end % bs:
        cache.store(int(table[last]), final)
    if snapshot is not None and start_pos < snapshot[0] <= end:
        cache.store(snapshot[1], saved_at[snapshot[0] - 1 - start_pos])
    return y
