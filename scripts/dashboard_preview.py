"""Draw the Grafana dashboard's panels (``dashboards/kvbridge.json``) from a live run, as
PNGs (for ``docs/operator.md``), with no Grafana and no Prometheus.

::

    .venv/bin/python scripts/dashboard_preview.py --out docs/img [--seconds 40]

It starts an example prefill/decode pair behind vllm-router (``kvbridge.examples.launch``:
prefill block 32, decode block 16, tiny-hybrid, decode verifying every load), sends
requests through the router from two clients for ``--seconds``, and in the middle fifth of
the run replays params prefill has already released straight to decode (each such load
fails and decode recomputes), so that the failure panels have something to show. Every
``--interval`` seconds it scrapes both workers' ``/metrics`` (``instance`` is ``prefill``
or ``decode``); then it evaluates each panel's queries at each scrape with
``examples/promql.py`` (``$__rate_interval`` is ``--window``) and draws one PNG
per dashboard row, ``dashboard_<row>.png``. A row none of whose queries has a series in the
run (vLLM's own metrics, with the example servers) is left out and named on stdout.

Needs matplotlib (the ``plot`` extra) and vllm-router (the ``router`` extra).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from kvbridge.examples.check import complete, http_get, make_prompts
from kvbridge.examples.launch import Cluster
from kvbridge.examples.promql import Labels, Scrape, evaluate, parse, samples, substitute

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "dashboards" / "kvbridge.json"
Series = dict[str, list[tuple[float, float]]]  # legend -> (seconds, value)


def panel_series(panel: dict, scrapes: list[Scrape], variables: dict[str, str]) -> Series:
    """Each of ``panel``'s queries at each scrape (the earlier ones feeding ``rate``), by
    the legend its ``legendFormat`` gives; non-finite points (0/0) are left out."""
    out: Series = {}
    start = scrapes[0].t
    for target in panel["targets"]:
        node = parse(substitute(target["expr"], variables))
        for i in range(1, len(scrapes)):
            value = evaluate(node, scrapes[: i + 1])
            points = value.items() if isinstance(value, dict) else [((), value)]
            for labels, v in points:
                if math.isfinite(v):
                    legend = _legend(target.get("legendFormat", ""), labels)
                    out.setdefault(legend, []).append((scrapes[i].t - start, v))
    return out


def _legend(fmt: str, labels: Labels) -> str:
    values = dict(labels)
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values.get(m.group(1), ""), fmt)
    return text.strip() or "{" + ", ".join(f'{k}="{v}"' for k, v in labels) + "}"


def rows(dash: dict) -> list[tuple[str, list[dict]]]:
    """The dashboard's rows in order, each with its panels."""
    out: list[tuple[str, list[dict]]] = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            out.append((panel["title"], list(panel.get("panels", []))))
        elif out:
            out[-1][1].append(panel)
        else:
            out.append(("", [panel]))
    return out


_UNIT_SCALE = {"Bps": (1 / 1024, "KiB/s"), "bytes": (1 / 1024, "KiB"), "s": (1000, "ms")}


def _draw(ax: Axes, panel: dict, series: Series, seconds: float) -> None:
    unit = panel["fieldConfig"]["defaults"].get("unit", "")
    scale, label = _UNIT_SCALE.get(unit, (1, {"percentunit": "share", "ops": "/s"}.get(unit, unit)))
    ax.set_title(panel["title"], fontsize=9)
    ax.tick_params(labelsize=7)
    ax.set_xlabel("seconds into the run", fontsize=7)
    ax.set_ylabel(label, fontsize=7)
    ax.set_xlim(0, seconds)
    if not series:
        ax.text(
            0.5,
            0.5,
            "no series in this run",
            ha="center",
            va="center",
            fontsize=8,
            transform=ax.transAxes,
            color="grey",
        )
        return
    # as Grafana's "hide series: only zeros" would: the panel says how many it left out
    zeros = sum(1 for points in series.values() if not any(y for _, y in points))
    for legend, points in sorted(series.items()):
        if any(y for _, y in points):
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, [y * scale for y in ys], label=legend, linewidth=1.2)
    ax.set_ylim(bottom=0)
    if zeros:
        ax.plot([], [], " ", label=f"({zeros} series at 0 throughout)")
    ax.legend(fontsize=6, loc="upper left")


def draw(dash: dict, scrapes: list[Scrape], variables: dict[str, str], out: Path) -> list[Path]:
    """One PNG per dashboard row with a series in ``scrapes``."""
    written = []
    for title, panels in rows(dash):
        drawn = [(p, panel_series(p, scrapes, variables)) for p in panels]
        slug = re.sub(r"[^a-z]+", "_", title.lower().split(":")[0]).strip("_") or "panels"
        if not any(series for _, series in drawn):
            print(f"row {title!r}: no series in this run, not drawn")
            continue
        fig, axes = plt.subplots(1, len(drawn), figsize=(4.2 * len(drawn), 2.9), squeeze=False)
        for ax, (panel, series) in zip(axes[0], drawn, strict=True):
            _draw(ax, panel, series, scrapes[-1].t - scrapes[0].t)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path = out / f"dashboard_{slug}.png"
        fig.savefig(path, dpi=80, metadata={"Software": None})
        plt.close(fig)
        print(f"wrote {path}")
        written.append(path)
    return written


# -- the live run ----------------------------------------------------------------------------


def _until(
    stop: threading.Event, work: Callable[[], None], pause_s: float, errors: list[BaseException]
) -> None:
    """``work`` every ``pause_s`` until ``stop``; an error stops it and is kept for the
    caller (a client that died would leave panels short of traffic without a word)."""
    try:
        while not stop.is_set():
            work()
            stop.wait(pause_s)
    except BaseException as exc:
        errors.append(exc)


def run(seconds: float, interval_s: float, logs: Path) -> list[Scrape]:
    """Scrapes of an example pair behind the router while clients send requests."""
    cluster = Cluster(logs=logs, decode_kv={"extra": {"verify": "all"}}).start()
    prompts = make_prompts(16)
    picks = itertools.count()  # next() is atomic: the clients share it
    try:
        router, prefill, decode = (cluster[n].url for n in ("router", "prefill", "decode"))

        def client() -> None:
            prompt = prompts[next(picks) % len(prompts)] * 2
            complete(router, {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}, 60)

        def stale_params() -> None:
            body = {"prompt": prompts[next(picks) % len(prompts)][::-1] * 2, "max_tokens": 4}
            first = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            params = complete(prefill, first, 60)["kv_transfer_params"]
            for _ in range(2):  # loaded, then recomputed: prefill released the blocks
                complete(decode, {**body, "kv_transfer_params": params}, 60)

        def scrape() -> Scrape:
            found = {}
            for name in ("prefill", "decode"):
                status, text = http_get(cluster[name].url + "/metrics")
                assert status == 200, (name, status)
                found.update(samples(text.decode(), instance=name, job="kvbridge"))
            return Scrape(time.monotonic(), found)

        stop, faults = threading.Event(), threading.Event()
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=_until, args=(stop, client, 0.2, errors)) for _ in range(2)
        ]
        threads.append(threading.Thread(target=_until, args=(faults, stale_params, 0.3, errors)))
        scrapes = [scrape()]
        threads[0].start()
        threads[1].start()
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            if elapsed >= 0.4 * seconds and threads[2].ident is None:
                threads[2].start()
            if elapsed >= 0.6 * seconds:
                faults.set()
            stop.wait(max(0.0, scrapes[0].t + len(scrapes) * interval_s - time.monotonic()))
            scrapes.append(scrape())
        stop.set()
        faults.set()
        for t in threads:
            if t.ident is not None:
                t.join(timeout=90)
        if errors:
            raise RuntimeError(f"a client failed; the panels would be short: {errors[0]!r}")
        print(f"{next(picks)} requests sent, {len(scrapes)} scrapes")
        return scrapes
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--seconds", type=float, default=40.0, help="traffic (default 40)")
    parser.add_argument("--interval", type=float, default=1.0, help="scrape every (s)")
    parser.add_argument("--window", type=int, default=5, help="$__rate_interval (s)")
    args = parser.parse_args(argv)
    dash = json.loads(args.dashboard.read_text())
    with tempfile.TemporaryDirectory(prefix="dashboard_preview_") as logs:
        scrapes = run(args.seconds, args.interval, Path(logs))
    variables = {
        "kv": "kvbridge",  # the example servers' names
        "instance": ".*",
        "engine": ".*",
        "__rate_interval": f"{args.window}s",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    draw(dash, scrapes, variables, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
