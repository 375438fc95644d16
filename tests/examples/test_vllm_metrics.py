"""vLLM's ``/metrics`` text read with ``prometheus_client.parser``: samples summed over
label sets, prompt tokens also per source, counters under their ``_total`` names."""

from __future__ import annotations

from kvbridge.examples.vllm.scraped_metrics import EXTERNAL_TOKENS, parse_metrics, transfer_figures

TEXT = """\
# HELP vllm:prompt_tokens_by_source Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 12.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 3.0
# HELP vllm:kvbridge_bytes_read Bytes read.
# TYPE vllm:kvbridge_bytes_read counter
vllm:kvbridge_bytes_read_total{engine="0"} 4096.0
vllm:kvbridge_bytes_read_total{engine="1"} 1024.0
# HELP vllm:kvbridge_transfer_seconds Seconds.
# TYPE vllm:kvbridge_transfer_seconds counter
vllm:kvbridge_transfer_seconds_total{engine="0"} 0.25
# HELP vllm:kvbridge_transfers Transfers.
# TYPE vllm:kvbridge_transfers counter
vllm:kvbridge_transfers_total{engine="0"} 2.0
# HELP vllm:nixl_xfer_time_seconds Transfer time.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{le="0.1"} 1.0
vllm:nixl_xfer_time_seconds_bucket{le="+Inf"} 2.0
vllm:nixl_xfer_time_seconds_count 2.0
vllm:nixl_xfer_time_seconds_sum 0.5
"""


def test_samples_are_summed_over_labels_and_kept_per_source() -> None:
    m = parse_metrics(TEXT)
    assert m["vllm:kvbridge_bytes_read_total"] == 5120.0
    assert m["vllm:prompt_tokens_by_source_total"] == 15.0
    assert m[EXTERNAL_TOKENS] == 12.0
    assert m['vllm:prompt_tokens_by_source_total{source="local_compute"}'] == 3.0
    assert m["vllm:nixl_xfer_time_seconds_sum"] == 0.5
    assert m["vllm:nixl_xfer_time_seconds_count"] == 2.0


def test_transfer_figures_between_two_scrapes() -> None:
    after = parse_metrics(TEXT)
    figures = transfer_figures({}, after)
    assert figures.connector == "kvbridge"
    assert (figures.bytes_moved, figures.seconds, figures.transfers) == (5120.0, 0.25, 2.0)
    assert figures.external_tokens == 12.0
    assert figures.failures is None
