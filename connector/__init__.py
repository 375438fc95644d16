"""What an engine plugs in: scheduler side, worker side, request lifecycle and transfers.

::

    vllm/        the vLLM adapter (KVConnectorBase_V1): thin, no kvbridge logic
    scheduler/   scheduler side: which tokens load, which blocks stay held, leases
    worker/      worker side: caches, side channel, peers, notifications
      decode/    receive: pull READs, push rounds, per-load records
      prefill/   send: blocks kept for readers, rewrite after save, push WRITEs
      staging/   staging slots and the host mirror of a GPU cache
    transfer/    the transport protocol and the NIXL engine behind it
    common/      the contract both sides share: api, config, params, metadata,
                 notifications, metrics, signing

Imports point down that list: ``vllm`` -> ``scheduler``/``worker`` -> ``transfer`` ->
``common`` -> ``kvbridge.handshake`` -> ``kvbridge.layouts``; the scheduler side never
imports the worker side, torch or NIXL (import-linter contracts in ``pyproject.toml``).
Submodules are imported explicitly (``from kvbridge.connector.transfer.nixl_engine import
...``) so that importing a package never loads NIXL as a side effect.
"""
