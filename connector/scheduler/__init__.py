"""The scheduler side: ``KVBridgeScheduler`` and the request lifecycle it drives.

``scheduler`` (the object an engine's scheduler calls), ``lifecycle`` (one state machine
per role), decode's loads (``loads``, ``prompt_span``: which prompt tokens and blocks
a load fills) and prefill's holds (``sends``, ``retention``: what a finished request keeps
for its reader, and for how long).

Runs in the engine's scheduler process: may import ``kvbridge.connector.common``,
``kvbridge.handshake`` and ``kvbridge.layouts``, never the worker side, the transfer layer,
torch or NIXL.
"""
