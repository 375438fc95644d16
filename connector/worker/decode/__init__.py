"""Decode role of the worker side: receive a request's KV.

A load's life, one room each::

    receiver     the load state machine: takes load specs, drives each source, reports
                 loads done or failed
    inflight     what it tracks per load: the load, its sources, where its time goes
    claims       is prefill still holding what we read (pull claims) or alive (push)
    transfers    how the bytes arrive: READs we post (pull), rounds prefill writes (push)
    landing      once every transfer ended: verify, rewrite, fence
    quarantine   failed loads whose transfers may still run

Never imports the prefill role.
"""
