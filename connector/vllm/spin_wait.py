"""vLLM's busy-wait between engine steps, made fair to what shares its core.

vLLM's engine core and workers hand each step over through shared-memory queues, and the
side that waits spins (``SpinCondition.wait``: for a second after each message) calling
``vllm.distributed.utils.sched_yield``, i.e. ``os.sched_yield``. Under Linux's EEVDF
scheduler (the default since 6.6) a thread that yields gives its core away to any busy
thread there almost entirely. Measured on this project's 2-core VM (Linux 6.18;
``python scripts/measure_sched_yield.py``): a ``sched_yield`` loop pinned beside a busy
loop got 0.01 s of CPU in 3 s, a ``time.sleep(0)`` loop its fair half. When servers
share cores (vLLM's CPU build pins each engine's worker to its cores; more servers than
cores), a waiting engine then takes seconds to notice each step, and so does every
connector call of that step: decode's loads, prefill's answers to its claims. With vLLM's
wait switched to ``time.sleep(0)`` (which releases the GIL, returns at once and costs the
thread nothing in the scheduler's eyes) the first load of a fresh pair took 0.04-0.2 s
instead of 0.1-11.6 s, and a warm P/D request 0.12-0.15 s instead of 1.1-1.7 s
(``docs/handover.md``, "Third round").

kvbridge switches it in each vLLM process it is loaded in (the engine core for the
scheduler side, each worker for the worker side) unless ``extra.engine_sched_yield`` is
true. vLLM reads ``USE_SCHED_YIELD`` at every wait, so switching it at the connector's
construction covers every wait that follows.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

logger = logging.getLogger(__name__)

_MODULE = "vllm.distributed.utils"
_FLAG = "USE_SCHED_YIELD"


def apply(*, sched_yield: bool, module: ModuleType | None = None) -> bool:
    """Make vLLM's step wait spin on ``time.sleep(0)`` instead of ``os.sched_yield``
    (``sched_yield`` true: leave it). Returns whether vLLM now waits with ``sched_yield``.
    ``module``: vLLM's ``vllm.distributed.utils`` (default: imported)."""
    if module is None:
        import importlib

        module = importlib.import_module(_MODULE)
    if not hasattr(module, _FLAG):
        logger.warning(
            "kvbridge: %s has no %s (a vLLM other than 0.32?): vLLM's busy-wait between "
            "steps is left as it is; on machines where servers share cores, loads may stall "
            "(docs/handover.md)",
            _MODULE,
            _FLAG,
        )
        return True
    if sched_yield or not sys.platform.startswith("linux"):
        return bool(getattr(module, _FLAG))
    if getattr(module, _FLAG):
        setattr(module, _FLAG, False)
        logger.info(
            "kvbridge: vLLM's busy-wait between engine steps in this process spins on "
            "time.sleep(0) instead of os.sched_yield (Linux's EEVDF scheduler all but stops a "
            "sched_yield spinner that shares its core with a busy thread); "
            "extra.engine_sched_yield=true keeps vLLM's"
        )
    return False
