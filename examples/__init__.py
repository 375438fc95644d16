"""A small real engine that uses the connector: tiny deterministic models with paged caches.

``model`` holds the model family and its config, ``paged_attention`` the attention cache
views and block-table addressing, ``state_layer`` the recurrent (Mamba-like) layer and its
state cache, ``tokenizer`` a byte-level tokenizer.
"""
