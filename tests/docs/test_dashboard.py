"""dashboards/kvbridge.json: a dashboard Grafana imports, whose every panel query names only
metrics kvbridge exports.

The example servers' names are checked against a live prefill/decode pair's ``/metrics``
after real requests (one loaded, one recomputed); the ``vllm:`` names against what
kvbridge's vLLM adapter registers (``KVBridgePromMetrics`` on a registry of its own) and
vLLM's own metrics (``vllm/v1/metrics/loggers.py``: the TTFT panel). A query with the
``${kv}`` variable is checked under each of its values. The queries are read by
``examples/promql.py``, the reader ``scripts/dashboard_preview.py`` draws with, so
every panel also parses there.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.examples.check import http_get
from kvbridge.examples.promql import Scrape, evaluate, metric_names, parse, samples, substitute
from tests.reliability.servers import Worker, post, worker_pair

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "kvbridge.json"
VLLM_PREFIX = "vllm:"


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def panels(dash: dict) -> list[dict]:
    """Every panel but the rows (and those inside a collapsed row)."""
    out = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def variable(dash: dict, name: str) -> dict:
    (found,) = [v for v in dash["templating"]["list"] if v["name"] == name]
    return found


def expansions(dash: dict, expr: str) -> list[str]:
    """``expr`` under each value of ``${kv}`` (the other variables match everything)."""
    values = [option["value"] for option in variable(dash, "kv")["options"]]
    others = {"instance": ".*", "engine": ".*", "__rate_interval": "1m"}
    return sorted({substitute(expr, {"kv": kv, **others}) for kv in values})


def unknown_names(dash: dict, exported: set[str], *, vllm: bool) -> dict[str, set[str]]:
    """Per panel title, the names its queries select that ``exported`` lacks: the ``vllm:``
    names (``vllm=True``) or the others."""
    out: dict[str, set[str]] = {}
    for panel in panels(dash):
        for target in panel["targets"]:
            for expr in expansions(dash, target["expr"]):
                names = {n for n in metric_names(parse(expr)) if n.startswith(VLLM_PREFIX) == vllm}
                if names - exported:
                    out.setdefault(panel["title"], set()).update(names - exported)
    return out


def exported_names(text: str) -> set[str]:
    """The names a query may select from Prometheus text: every sample's, and each
    family's by its type (a family with no sample yet, such as the quarantine gauge of a
    decode with nothing quarantined, is exported all the same)."""
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "gauge": ("",),
    }
    out = set()
    for family in text_string_to_metric_families(text):
        out.update(s.name for s in family.samples)
        out.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
    return out


# -- the live pair ---------------------------------------------------------------------------


def _scrape(workers: dict[str, Worker]) -> dict[str, str]:
    texts = {}
    for name, w in workers.items():
        status, body = http_get(w.url + "/metrics")
        assert status == 200, (name, status)
        texts[name] = body.decode()
    return texts


def _load_then_recompute(prefill: Worker, decode: Worker) -> None:
    """One request decode loads from prefill, then the same params again: prefill has
    released them, so decode's load fails and it recomputes."""
    body = {"prompt": "dashboards draw what was scraped " * 8, "max_tokens": 4}
    status, out = prefill.post(
        {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert status == 200, out
    params = out["kv_transfer_params"]
    loaded = post(decode.url, {**body, "kv_transfer_params": params})
    recomputed = post(decode.url, {**body, "kv_transfer_params": params})
    assert loaded[0] == recomputed[0] == 200, (loaded, recomputed)
    assert loaded[1]["usage"]["loaded_tokens"] > 0
    assert recomputed[1]["usage"]["loaded_tokens"] == 0


@pytest.fixture(scope="module")
def live() -> dict:
    """Two scrapes of both workers with a loaded and a recomputed request before each
    (Prometheus' rate, as ours, needs a series in both scrapes)."""
    with worker_pair() as (prefill, decode):
        workers = {"prefill": prefill, "decode": decode}
        _load_then_recompute(prefill, decode)
        before = (time.monotonic(), _scrape(workers))
        _load_then_recompute(prefill, decode)
        after = (time.monotonic(), _scrape(workers))
    return {"before": before, "after": after}


@pytest.fixture(scope="module")
def live_names(live: dict) -> set[str]:
    texts = live["after"][1]
    return exported_names(texts["prefill"]) | exported_names(texts["decode"])


# -- vLLM's names ----------------------------------------------------------------------------


@functools.cache
def vllm_names() -> set[str]:
    """What vLLM's ``/metrics`` holds with kvbridge's connector: the adapter's metrics
    (registered and observed once on a registry of their own) and vLLM's own, read from
    the source of its stat logger."""
    pytest.importorskip("vllm")
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.v1.metrics import loggers

    from kvbridge.connector.vllm.stats import COUNTERS, GAUGES, KVBridgePromMetrics

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = KVBridgePromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    data = {name: 1.0 for name in COUNTERS + GAUGES}
    prom.observe({**data, "engine_calls": [["get_finished", 0.001]]}, engine_idx=0)
    names = exported_names(generate_latest(registry).decode())
    suffixes = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    source = Path(loggers.__file__).read_text()
    for kind, name in re.findall(
        r'self\._(gauge|counter|histogram)_cls\(\s*name="([\w:]+)"', source
    ):
        names.update(name + suffix for suffix in suffixes[kind])
    return names


# -- the checks ------------------------------------------------------------------------------


def test_grafana_imports_it() -> None:
    dash = load()
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash["uid"] and dash["title"] and dash["id"] is None
    source = variable(dash, "datasource")
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    kv = variable(dash, "kv")
    assert [o["value"] for o in kv["options"]] == ["vllm:kvbridge", "kvbridge"]
    assert kv["query"] == ", ".join(f"{o['text']} : {o['value']}" for o in kv["options"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']!r} overlaps another panel"
        cells |= mine
    for p in panels(dash):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert p["description"], p["title"]


def test_the_pair_counted_what_the_panels_draw(live: dict) -> None:
    """The live run is not all zeros: between the scrapes decode loaded once and
    recomputed once, which the dashboard's queries read back."""
    (t0, before), (t1, after) = live["before"], live["after"]
    scrapes = [
        Scrape(
            t,
            {k: v for name, text in texts.items() for k, v in samples(text, instance=name).items()},
        )
        for t, texts in ((t0, before), (t1, after))
    ]
    dash = load()
    (share,) = [p for p in panels(dash) if p["title"] == "Share of loads served"]
    (example_query,) = [
        t["expr"] for t in share["targets"] if "kvbridge_load_outcomes" in t["expr"]
    ]
    window = f"{int(t1 - t0) + 60}s"
    expr = substitute(example_query, {"instance": ".*", "__rate_interval": window})
    assert evaluate(parse(expr), scrapes) == {(("instance", "decode"),): 0.5}
    (loads,) = [p for p in panels(dash) if p["title"] == "Loads completed"]
    expr = substitute(
        loads["targets"][0]["expr"],
        {"kv": "kvbridge", "instance": ".*", "engine": ".*", "__rate_interval": window},
    )
    rates = evaluate(parse(expr), scrapes)
    assert isinstance(rates, dict) and rates[(("instance", "decode"),)] == pytest.approx(
        1 / (t1 - t0)
    )


def test_every_example_server_query_names_a_metric_the_pair_exports(live_names: set[str]) -> None:
    assert unknown_names(load(), live_names, vllm=False) == {}


def test_every_vllm_query_names_a_metric_vllm_exports() -> None:
    names = vllm_names()
    assert "vllm:kvbridge_loads_recomputed_total" in names
    assert "vllm:time_to_first_token_seconds_bucket" in names
    assert unknown_names(load(), names, vllm=True) == {}


def with_bogus_names() -> dict:
    """A copy of the dashboard with two queries naming metrics nobody exports."""
    dash = copy.deepcopy(load())
    (panel,) = [p for p in panels(dash) if p["title"] == "Mean load time"]
    panel["targets"].append({"refId": "Z", "expr": "rate(kvbridge_load_secnds_total[5m])"})
    (panel,) = [p for p in panels(dash) if p["title"] == "Handshakes"]
    panel["targets"].append({"refId": "Z", "expr": "sum(${kv}_handshake_fails_total)"})
    return dash


def test_a_panel_naming_a_metric_the_pair_does_not_export_fails(live_names: set[str]) -> None:
    assert unknown_names(with_bogus_names(), live_names, vllm=False) == {
        "Mean load time": {"kvbridge_load_secnds_total"},
        "Handshakes": {"kvbridge_handshake_fails_total"},
    }


def test_a_panel_naming_a_metric_vllm_does_not_export_fails() -> None:
    assert unknown_names(with_bogus_names(), vllm_names(), vllm=True) == {
        "Handshakes": {"vllm:kvbridge_handshake_fails_total"}
    }


def test_the_preview_draws_a_panel_from_its_queries() -> None:
    """scripts/dashboard_preview.py: a panel's series, by legend, from two scrapes 2 s
    apart (rate over the window; the all-labels legend when none is given)."""
    from scripts.dashboard_preview import panel_series

    def scrape(t: float, loaded: float, le_01: float, total: float) -> Scrape:
        text = (
            "# TYPE kvbridge_transfers counter\n"
            f"kvbridge_transfers_total {loaded}\n"
            "# TYPE kvbridge_engine_call_seconds histogram\n"
            f'kvbridge_engine_call_seconds_bucket{{hook="get_finished",le="0.1"}} {le_01}\n'
            f'kvbridge_engine_call_seconds_bucket{{hook="get_finished",le="+Inf"}} {total}\n'
            f'kvbridge_engine_call_seconds_count{{hook="get_finished"}} {total}\n'
            'kvbridge_engine_call_seconds_sum{hook="get_finished"} 1.0\n'
        )
        return Scrape(t, samples(text, instance="decode"))

    variables = {"kv": "kvbridge", "instance": ".*", "engine": ".*", "__rate_interval": "5s"}
    scrapes = [scrape(10.0, 3, 0, 0), scrape(12.0, 7, 4, 8)]
    dash = load()
    (loads,) = [p for p in panels(dash) if p["title"] == "Loads completed"]
    assert panel_series(loads, scrapes, variables) == {"decode": [(2.0, 2.0)]}
    panel = {
        "targets": [
            {
                "expr": "histogram_quantile(0.75, sum by (le) "
                "(rate(kvbridge_engine_call_seconds_bucket[5s])))"
            }
        ]
    }
    # 4 of 8 calls up to 0.1 s, the rest above the highest finite bound: p75 reads 0.1
    assert panel_series(panel, scrapes, variables) == {"{}": [(2.0, 0.1)]}
