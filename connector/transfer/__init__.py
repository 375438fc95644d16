"""The transfer layer: what moves the bytes.

``transport`` is the contract the worker side talks to (registrations, prepared descriptor
lists, transfers, notifications); ``nixl_engine`` is the one implementation that talks to
NIXL, with ``nixl_config``, ``nixl_calls`` (NIXL's exceptions and status strings mapped to
ours), ``registrations`` and ``xfer_rows``; ``errors`` holds ``TransferError`` and its
subclasses.

May import ``kvbridge.layouts`` (and torch, NIXL); nothing of the connector above it.
"""
