"""Prefill role of the worker side: send a request's KV.

``sender`` keeps finished requests' blocks for their reader and rewrites them after save;
``pushes`` writes a kept request's KV into decode's blocks in push mode. Never imports the
decode role.
"""
