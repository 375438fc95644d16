"""Staging memory of the worker side.

``staging`` (registered landing slots for remote pages that do not fit local blocks),
``staged_reads`` (loads through those slots), ``host_stage`` (a GPU cache moved through a
pinned host mirror), ``engine_copies`` (that mirror filled by the engine's own block copies).
"""
