"""The worker side: ``KVBridgeWorker`` and what both roles share.

``worker`` (the object an engine's model runner calls), ``nixl_setup`` (the NIXL engine,
the engine lock), ``side_channel`` and ``peers`` (handshakes,
plans and descriptor lists per peer), ``inbox``/``outbox`` (notifications in and out),
``routing`` (which prefill ranks a decode rank reads from), ``rows`` and ``digests``
(the descriptor rows of one load, and their digests on either side), ``idle_progress``
and ``engine_thread`` (threads that keep transfers moving).

Role-specific parts live in ``decode/`` (receive) and ``prefill/`` (send); staging memory in
``staging/``. May import the transfer layer, ``common``, ``kvbridge.handshake`` and
``kvbridge.layouts``; never the scheduler side.
"""
