"""Pure layout math on tensors handed in: specs and groups, NHD/HND, kernel vs manager
blocks, canonical cross-layer buffers, descriptor arrays, in-place rewrites, hybrid
prefix-hit search.

The bottom layer of kvbridge: imports nothing of kvbridge's but itself, and holds the
project's base error (``errors.KVBridgeError``) so that every package can derive from it.
No sockets, no NIXL, no threads, no global state.
"""
