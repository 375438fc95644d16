"""The worker's ``/metrics``: the connector's counters and the engine's state as
Prometheus text."""

from __future__ import annotations

from kvbridge.examples.engine_loop import EngineLoop

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def metrics_text(loop: EngineLoop) -> str:
    lines = []
    metrics = getattr(loop.worker, "metrics", None)
    if metrics is not None:
        lines.append(metrics.prometheus().rstrip("\n"))
        lines += [
            "# TYPE kvbridge_live_transfer_handles gauge",
            f"kvbridge_live_transfer_handles {loop.worker.num_live_handles}",
        ]
    pool = loop.engine.pool
    lines += [
        "# TYPE kvbridge_free_blocks gauge",
        f'kvbridge_free_blocks{{pool="kv"}} {loop.free_blocks}',
        "# TYPE kvbridge_total_blocks gauge",
        f'kvbridge_total_blocks{{pool="kv"}} {pool.num_blocks}',
        "# TYPE kvbridge_requests gauge",
    ]
    lines += [f'kvbridge_requests{{state="{s}"}} {n}' for s, n in loop.status_counts.items()]
    lines.append("# TYPE kvbridge_requests_finished counter")
    lines += [
        f'kvbridge_requests_finished{{reason="{r}"}} {n}' for r, n in list(loop.finished.items())
    ]
    sched = loop.engine.scheduler
    if sched is not None:
        lines.append("# TYPE kvbridge_load_outcomes counter")
        for state, n in list(sched.load_outcomes.items()):
            lines.append(f'kvbridge_load_outcomes{{outcome="{state.name.lower()}"}} {n}')
        lines.append("# TYPE kvbridge_send_outcomes counter")
        for state, n in list(sched.send_outcomes.items()):
            lines.append(f'kvbridge_send_outcomes{{outcome="{state.name.lower()}"}} {n}')
    return "\n".join(lines) + "\n"
