"""kvbridge inside real vLLM API servers with data parallelism (``--data-parallel-size``).

vLLM runs one engine core per data-parallel rank behind one API server, and appends
``_dp<rank>`` to each rank's ``engine_id``. kvbridge binds each rank's side channel at
``kv_port + dp_index * tp_size + tp_rank`` (``connector/vllm/parallelism.py``), so one
``kv_port`` base serves every DP rank on a host, and each rank advertises its own port in
the params of the requests it prefilled. Servers, kv_both, tiny-llama, block 32, pull:

    P     --data-parallel-size 2, a fixed kv_port base (ranks at base and base + 1)
    D     data-parallel size 1

- P -> D: requests prefilled on both of P's DP ranks load on D from the rank that holds
  their KV (one handshake per rank), verified, output equal to one server.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.examples.vllm.client import compare, make_prompts
from kvbridge.examples.vllm.procs import Service
from kvbridge.examples.vllm.scraped_metrics import kvbridge_delta as _delta
from kvbridge.examples.vllm.scraped_metrics import kvbridge_deltas as _deltas
from kvbridge.examples.vllm.scraped_metrics import scrape
from tests.integration.vllm_both import prefilled, run, serving, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

LOGPROB_TOL = 1e-4
DP = 2


@pytest.fixture(scope="module")
def servers(vllm_pool, tmp_path_factory) -> Iterator[dict[str, Service]]:
    specs = [spec("P", data_parallel_size=DP, fixed_kv_port=True), spec("D")]
    with serving(vllm_pool, specs, tmp_path_factory.mktemp("vllm-dp-logs")) as running:
        yield running


def test_every_data_parallel_rank_serves_its_loads_from_one_port_base(servers):
    prefill, decode = servers["P"], servers["D"]
    base = prefill.launch.details["kv_transfer_config"]["kv_port"]  # type: ignore[index]
    prompts = make_prompts(4 * DP, 200, seed=7070)
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: vLLM spreads them over ranks
        params = list(pool.map(lambda p: prefilled(prefill, p), prompts))
    by_port = {p["remote_port"] for p in params}
    assert by_port == {base + d for d in range(DP)}, (base, by_port)
    engines = {p["remote_engine_id"] for p in params}
    assert engines == {f"P_dp{d}" for d in range(DP)}, engines
    before = scrape(decode.url)
    got = [run(decode, p, kv_transfer_params=kp) for p, kp in zip(prompts, params, strict=True)]
    after = scrape(decode.url)
    moved = str(_deltas(before, after))
    assert _delta(before, after, "loads_loaded") == len(prompts), moved
    assert _delta(before, after, "loads_verified") == len(prompts), moved
    assert _delta(before, after, "handshakes") == DP, moved
    for p, g in zip(prompts, got, strict=True):
        cmp = compare(run(prefill, p), g)  # one server (decode holds the loaded KV now)
        assert cmp.first_mismatch is None and cmp.max_logprob_diff <= LOGPROB_TOL, cmp
