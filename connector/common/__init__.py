"""The contract both sides of the connector share.

``api`` (the Protocols an engine calls), ``config`` (``KVTransferConfig``, decoded by
msgspec; ``struct_errors`` words its errors), ``params``
(``kv_transfer_params`` on the HTTP hop) and ``signing``, ``metadata`` (scheduler ->
worker each step, and back), ``notifications`` (typed NIXL notifications between
workers), ``metrics`` (counters).

May import ``kvbridge.layouts`` and ``kvbridge.handshake`` only: never the scheduler side,
the worker side or the transfer layer.
"""
