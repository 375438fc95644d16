"""``kvbridge bench NAME``: the benchmarks a user runs, from the installed package.

One module per benchmark, each with ``main(argv: list[str] | None = None) -> int``, also
runnable as ``python -m kvbridge.cli.bench.NAME``. Every one prints its table and, with
``--json PATH``, writes the same rows as one document (:mod:`kvbridge.cli.bench.results`,
which ``scripts/plot_bench.py`` draws). What their figures mean and the commands that gave
them: ``docs/performance.md``.
"""

from __future__ import annotations

import importlib
import sys

# name -> what it measures (``kvbridge bench`` lists these; a module here that is not a
# key, such as ``results``, is a helper)
BENCHMARKS: dict[str, str] = {
    "block_sizes": "descriptors per request and the sender's split for any pair of block sizes",
    "e2e": "TTFT of paired example servers (pull, push) vs one server, through the router",
    "handshake": "handshake latency and throughput over loopback",
    "layouts": "in-place layout transforms vs a torch copy, and descriptor arrays",
    "multihost": "loads across a rate-limited link between two network namespaces (root)",
    "scheduler": "scheduler-side overhead per engine step",
    "tp": "descriptors per request across tensor-parallel sizes",
    "tp_transfer": "transfer speed across tensor-parallel sizes vs a raw NIXL READ",
    "transfer": "connector loads vs a raw NIXL READ / WRITE of the same bytes",
    "vllm": "kvbridge vs vLLM's NixlConnector on the same vLLM servers (TTFT)",
    "vllm_layouts": "the layout kvbridge asks vLLM for vs vLLM's default",
}


class UnknownBenchmarkError(LookupError):
    """A benchmark name that is not one of :data:`BENCHMARKS`."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no benchmark {name!r}: one of {', '.join(BENCHMARKS)}")


def listing() -> str:
    """The benchmarks, one a line: name and what it measures."""
    width = max(map(len, BENCHMARKS))
    return "\n".join(f"{name:<{width}}  {what}" for name, what in BENCHMARKS.items())


def run(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` with ``argv``; its exit status (a ``SystemExit`` it raises,
    such as ``--help``'s or a failed check's, becomes the status, its message printed)."""
    if name not in BENCHMARKS:
        raise UnknownBenchmarkError(name)
    module = importlib.import_module(f"{__name__}.{name}")
    try:
        return module.main(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
