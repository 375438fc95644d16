"""vLLM's busy-wait between engine steps, made fair to what shares its core.

vLLM's engine core and workers hand each step over through shared-memory queues, and the
side that waits spins (``SpinCondition.wait``: for a second after each message) calling
``vllm.distributed.utils.sched_yield``, i.e. ``os.sched_yield``. Under Linux's EEVDF
scheduler (the default since 6.6) a thread that yields gives its core away to any busy
thread there almost entirely. When servers share cores (vLLM's CPU build pins each
engine's worker to its cores; more servers than cores), a waiting engine then takes
seconds to notice each step, and so does every connector call of that step: decode's
loads, prefill's answers to its claims. ``time.sleep(0)`` (a ``clock_nanosleep`` that
releases the GIL and returns at once) polls as tightly and leaves the thread its fair
share of the core. The figures before and after, with their commands:
``docs/handover.md``.

kvbridge switches it in each vLLM process it is loaded in (the engine core for the
scheduler side, each worker for the worker side) on vLLM's CPU platform, where engines'
compute threads share cores with their waits (``extra.engine_step_wait``: ``"auto"``;
``"sleep0"`` or ``"sched_yield"`` force either). A GPU host usually has a core to spare
for each waiting thread, and there the tightest wait is vLLM's choice. vLLM reads
``USE_SCHED_YIELD`` at every wait, so switching it at the connector's construction (the
worker's connector is built before the engine's warm-up, the scheduler's before the
engine core's busy loop) covers every wait that follows. vLLM's C spin loop
(``VLLM_USE_SPINLOOP_EXT``) does not read the flag and is left as it is.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

logger = logging.getLogger(__name__)

_MODULE = "vllm.distributed.utils"
_FLAG = "USE_SCHED_YIELD"


def apply(mode: str, *, cpu_platform: bool, module: ModuleType | None = None) -> bool:
    """Set how vLLM waits between steps in this process: ``mode`` is
    ``extra.engine_step_wait`` (``"auto"``: ``sleep0`` when ``cpu_platform``). Returns
    whether vLLM waits with ``sched_yield`` now. ``module``: vLLM's
    ``vllm.distributed.utils`` (default: imported)."""
    if mode == "auto":
        mode = "sleep0" if cpu_platform else "sched_yield"
    if mode == "sched_yield" or not sys.platform.startswith("linux"):
        return True if module is None else bool(getattr(module, _FLAG, True))
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
    if getattr(module, _FLAG):
        setattr(module, _FLAG, False)
        logger.info(
            "kvbridge: vLLM's busy-wait between engine steps in this process spins on "
            "time.sleep(0) instead of os.sched_yield (Linux's EEVDF scheduler all but stops a "
            "sched_yield spinner that shares its core with a busy thread); "
            'extra.engine_step_wait="sched_yield" keeps vLLM\'s'
        )
    return False
