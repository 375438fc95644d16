"""KV-transfer figures from a vLLM server's Prometheus ``/metrics``.

vLLM exports a connector's stats through the connector's own Prometheus metrics:

- NixlConnector (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py``):
  histograms ``vllm:nixl_bytes_transferred``, ``vllm:nixl_xfer_time_seconds`` (seconds,
  per transfer), ``vllm:nixl_post_time_seconds``, ``vllm:nixl_num_descriptors`` and
  counters ``vllm:nixl_num_failed_transfers_total``, ...;
- kvbridge (``connector/vllm/stats.py``): counters ``vllm:kvbridge_bytes_read_total``,
  ``vllm:kvbridge_transfer_seconds_total``, ``vllm:kvbridge_transfers_total``, ...

and, for every connector, ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``
(prompt tokens the engine took from the connector instead of computing them).
The text is parsed with ``prometheus_client.parser``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvbridge.examples.vllm.procs import http_get

# (bytes, seconds, transfers): the sample names (summed over labels) for each connector.
KNOWN: dict[str, tuple[str, str, str]] = {
    "kvbridge": (
        "vllm:kvbridge_bytes_read_total",
        "vllm:kvbridge_transfer_seconds_total",
        "vllm:kvbridge_transfers_total",
    ),
    "nixl": (
        "vllm:nixl_bytes_transferred_sum",
        "vllm:nixl_xfer_time_seconds_sum",
        "vllm:nixl_xfer_time_seconds_count",
    ),
}
FAILURES: dict[str, tuple[str, ...]] = {
    "kvbridge": ("vllm:kvbridge_loads_failed_total",),
    "nixl": ("vllm:nixl_num_failed_transfers_total",),
}
EXTERNAL_TOKENS = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
KVBRIDGE = "vllm:kvbridge_"  # prefix of kvbridge's samples

SOURCES = "vllm:prompt_tokens_by_source_total"  # also kept per ``source`` label


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (``prometheus_client.parser``);
    ``prompt_tokens_by_source_total`` is also kept per source (``name{source="..."}``)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            source = sample.labels.get("source")
            if sample.name == SOURCES and source is not None:
                key = f'{sample.name}{{source="{source}"}}'
                out[key] = out.get(key, 0.0) + sample.value
    return out


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Parsed ``/metrics`` of the server at ``url`` (empty when it does not answer)."""
    status, body = http_get(url.rstrip("/") + "/metrics", timeout_s=timeout_s)
    if status != 200:
        return {}
    return parse_metrics(body.decode(errors="replace"))


def kvbridge_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much kvbridge's counter ``name`` (e.g. ``loads_loaded``) grew between scrapes."""
    key = KVBRIDGE + name + "_total"
    return after.get(key, 0.0) - before.get(key, 0.0)


def kvbridge_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Every kvbridge counter that moved, by short name (for assertion messages)."""
    return {
        k.removeprefix(KVBRIDGE): v - before.get(k, 0.0)
        for k, v in after.items()
        if k.startswith(KVBRIDGE) and k.endswith("_total") and v != before.get(k, 0.0)
    }


def connector_names(metrics: dict[str, float]) -> list[str]:
    """The connector-related sample names present (for reports and debugging)."""
    keys = ("nixl", "kvbridge", "kv_connector", "kv_transfer")
    return sorted(n for n in metrics if any(k in n for k in keys) and not n.endswith("_created"))


@dataclass
class TransferFigures:
    """What one connector moved between two scrapes; ``None`` where it exports nothing."""

    connector: str | None
    bytes_moved: float | None
    seconds: float | None
    transfers: float | None
    failures: float | None
    external_tokens: float | None

    def fmt(self) -> str:
        def num(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
            return "n/a" if value is None else f"{value * scale:.{digits}f}"

        return (
            f"bytes_moved={num(self.bytes_moved)} transfer_ms={num(self.seconds, 1e3, 3)} "
            f"transfers={num(self.transfers)} failed_transfers={num(self.failures)} "
            f"external_prompt_tokens={num(self.external_tokens)}"
        )


def transfer_figures(
    before: dict[str, float], after: dict[str, float], connector: str | None = None
) -> TransferFigures:
    """Increase of the transfer metrics from ``before`` to ``after``.

    ``connector`` picks the metric names; ``None``: whichever known connector's metrics
    are present in ``after``.
    """
    names = [connector] if connector else [c for c in KNOWN if KNOWN[c][0] in after]
    chosen = next((c for c in names if c in KNOWN and KNOWN[c][0] in after), None)

    def delta(name: str) -> float | None:
        if name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    ext = delta(EXTERNAL_TOKENS)
    if chosen is None:
        return TransferFigures(connector, None, None, None, None, ext)
    b, s, n = KNOWN[chosen]
    fails = [d for d in (delta(f) for f in FAILURES.get(chosen, ())) if d is not None]
    return TransferFigures(chosen, delta(b), delta(s), delta(n), sum(fails) if fails else None, ext)
