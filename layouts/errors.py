"""The project's exception base and the errors raised by the pure layout model.

Every error kvbridge raises on bad input derives from :class:`KVBridgeError`; the message
names the field, the value(s) seen and what would be accepted. ``handshake`` and
``connector`` define their own subclasses on top of this base.
"""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base class of every error kvbridge raises on purpose."""


class LayoutError(KVBridgeError, ValueError):
    """A spec, layout, block size or buffer cannot describe a valid KV cache."""


class NonUniformPageError(LayoutError):
    """KV-cache groups cannot be given one common page size."""


class BlockIdError(LayoutError, IndexError):
    """A block id lies outside the pool or region it indexes."""


class ExternalLayoutError(LayoutError):
    """An engine's KV-cache tensor has a shape or strides kvbridge cannot describe."""
