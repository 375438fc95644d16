"""Decode role of the worker side: receive a request's KV.

``receiver`` turns load specs into NIXL READs (pull, ``pull_reads``) or Push requests (push,
``push_rounds``) and reports loads done or failed; ``load_records`` is the per-load state,
``load_timeline`` where a load's time goes. Never imports the prefill role.
"""
