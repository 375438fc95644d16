"""The PromQL the dashboard's panels use (``dashboards/kvbridge.json``), parsed and evaluated
over scraped samples, without a Prometheus.

Two readers: ``tests/docs/test_dashboard.py`` takes every metric name a panel's query
names (:func:`metric_names`) and checks it against what live workers export, and
``scripts/dashboard_preview.py`` draws each panel from a live run's scrapes
(:func:`evaluate`). The subset is what the dashboard writes, and anything else is refused
with :class:`PromQLError` (so a new panel either fits or says what it needs)::

    expr     := term (("+" | "-") term)*
    term     := unary (("/" | "*") unary)*
    unary    := NUMBER | "(" expr ")" | sum | call | selector
    sum      := "sum" ["by" "(" label, ... ")"] "(" expr ")"
    call     := ("rate" | "increase") "(" selector "[" DURATION "]" ")"
              | "histogram_quantile" "(" NUMBER "," expr ")"
    selector := NAME ["{" label ("=" | "!=" | "=~" | "!~") STRING, ... "}"]

Grafana's variables (``$instance``, ``${kv}``, ``$__rate_interval``) are replaced first by
:func:`substitute`. Evaluation follows Prometheus where the dashboard relies on it:
``rate`` is the increase over the window (a counter reset counts from zero) per second of
the scrapes it spans (no extrapolation), ``sum by`` keeps the named labels, a binary
operator matches series with the same labels, ``histogram_quantile`` interpolates linearly
within the bucket the rank falls in.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, __name__ included
Vector = dict[Labels, float]


class PromQLError(ValueError):
    """A query outside the subset this module reads, or a malformed one."""


@dataclass(frozen=True)
class Scrape:
    """One scrape of every target: at ``t`` seconds, each sample's labels and value."""

    t: float
    samples: Vector


def samples(text: str, **target_labels: str) -> Vector:
    """Prometheus text as samples, each with ``target_labels`` added (as Prometheus adds
    ``instance`` and ``job`` to what it scrapes)."""
    out: Vector = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {**s.labels, **target_labels, "__name__": s.name}
            out[tuple(sorted(labels.items()))] = float(s.value)
    return out


# -- the syntax tree -------------------------------------------------------------------------


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # = != =~ !~
    value: str

    def matches(self, labels: Mapping[str, str]) -> bool:
        got = labels.get(self.label, "")
        if self.op in ("=", "!="):
            return (got == self.value) == (self.op == "=")
        return (re.fullmatch(self.value, got) is not None) == (self.op == "=~")


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[Matcher, ...] = ()


@dataclass(frozen=True)
class Rate:
    func: str  # rate | increase
    selector: Selector
    window_s: float


@dataclass(frozen=True)
class Sum:
    by: tuple[str, ...] | None  # None: sum(...) over every label
    expr: Node


@dataclass(frozen=True)
class Quantile:
    q: float
    expr: Node


@dataclass(frozen=True)
class Binary:
    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class Number:
    value: float


Node = Selector | Rate | Sum | Quantile | Binary | Number

# -- parsing ---------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<duration>\d+(?:ms|s|m|h))(?![\w:])
    | (?P<number>\d+(?:\.\d*)?(?:e[+-]?\d+)?)
    | (?P<string>"(?:[^"\\]|\\.)*")
    | (?P<name>[A-Za-z_:][\w:]*)
    | (?P<op>=~|!=|!~|[=(){}\[\],/*+-])
    )""",
    re.VERBOSE,
)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with Grafana's ``${name}`` and ``$name`` replaced (longest names first)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    if "$" in expr:
        raise PromQLError(f"unknown Grafana variable in {expr!r}: pass it in variables")
    return expr


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise PromQLError(f"cannot read {text[pos : pos + 20]!r} at {pos} of {text!r}")
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.toks, self.i = text, _tokens(text), 0

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        got_kind, got = self.peek()
        if (value is not None and got != value) or (kind is not None and got_kind != kind):
            want = value or kind
            raise PromQLError(f"expected {want!r}, found {got or 'the end'!r} in {self.text!r}")
        self.i += 1
        return got

    def parse(self) -> Node:
        node = self.expr()
        if self.i != len(self.toks):
            raise PromQLError(f"unexpected {self.peek()[1]!r} in {self.text!r}")
        return node

    def expr(self) -> Node:
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            node = Binary(self.take(), node, self.term())
        return node

    def term(self) -> Node:
        node = self.unary()
        while self.peek()[1] in ("/", "*"):
            node = Binary(self.take(), node, self.unary())
        return node

    def unary(self) -> Node:
        kind, value = self.peek()
        if kind == "number":
            return Number(float(self.take()))
        if value == "(":
            self.take("(")
            node = self.expr()
            self.take(")")
            return node
        name = self.take(kind="name")
        if name == "sum":
            by = None
            if self.peek()[1] == "by":
                self.take("by")
                by = self.labels()
            self.take("(")
            inner = self.expr()
            self.take(")")
            return Sum(by, inner)
        if name in ("rate", "increase"):
            self.take("(")
            selector = self.selector(self.take(kind="name"))
            self.take("[")
            duration = self.take(kind="duration")
            self.take("]")
            self.take(")")
            unit = re.sub(r"\d+", "", duration)
            return Rate(name, selector, float(duration[: -len(unit)]) * _UNITS[unit])
        if name == "histogram_quantile":
            self.take("(")
            q = float(self.take(kind="number"))
            self.take(",")
            inner = self.expr()
            self.take(")")
            return Quantile(q, inner)
        if self.peek()[1] == "(":
            raise PromQLError(f"function {name!r} is outside the subset read here: {self.text!r}")
        return self.selector(name)

    def labels(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            names.append(self.take(kind="name"))
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return tuple(names)

    def selector(self, name: str) -> Selector:
        matchers = []
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label = self.take(kind="name")
                op = self.take(kind="op")
                if op not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"bad matcher {label}{op} in {self.text!r}")
                raw = self.take(kind="string")
                matchers.append(Matcher(label, op, raw[1:-1].encode().decode("unicode_escape")))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        return Selector(name, tuple(matchers))


def parse(expr: str) -> Node:
    """The syntax tree of ``expr`` (variables already substituted)."""
    return _Parser(expr).parse()


def metric_names(node: Node) -> set[str]:
    """Every metric name ``node`` selects."""
    match node:
        case Selector(name=name):
            return {name}
        case Rate(selector=selector):
            return {selector.name}
        case Sum(expr=inner) | Quantile(expr=inner):
            return metric_names(inner)
        case Binary(left=left, right=right):
            return metric_names(left) | metric_names(right)
    return set()


# -- evaluation ------------------------------------------------------------------------------


def _select(scrape: Scrape, sel: Selector) -> Vector:
    out: Vector = {}
    for labels, value in scrape.samples.items():
        d = dict(labels)
        if d["__name__"] == sel.name and all(m.matches(d) for m in sel.matchers):
            out[tuple(kv for kv in labels if kv[0] != "__name__")] = value
    return out


def _rate(scrapes: Sequence[Scrape], node: Rate) -> Vector:
    now = scrapes[-1]
    window = [s for s in scrapes if now.t - node.window_s <= s.t]
    if len(window) < 2:
        return {}
    series: dict[Labels, list[float]] = defaultdict(list)
    for s in window:
        for labels, value in _select(s, node.selector).items():
            series[labels].append(value)
    span = now.t - window[0].t
    out: Vector = {}
    for labels, values in series.items():
        if len(values) < 2:
            continue
        grown = sum(b - a if b >= a else b for a, b in pairwise(values))
        out[labels] = grown / span if node.func == "rate" else grown
    return out


def _sum(vec: Vector, by: tuple[str, ...] | None) -> Vector:
    out: Vector = defaultdict(float)
    for labels, value in vec.items():
        out[tuple(kv for kv in labels if by is not None and kv[0] in by)] += value
    return dict(out)


def _binary(op: str, left: Vector | float, right: Vector | float) -> Vector | float:
    def apply(a: float, b: float) -> float:
        if op == "/":
            return a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))
        return {"*": a * b, "+": a + b, "-": a - b}[op]

    if isinstance(left, float) and isinstance(right, float):
        return apply(left, right)
    if isinstance(right, float):
        assert isinstance(left, dict)
        return {k: apply(v, right) for k, v in left.items()}
    if isinstance(left, float):
        return {k: apply(left, v) for k, v in right.items()}
    return {k: apply(v, right[k]) for k, v in left.items() if k in right}


def _quantile(q: float, vec: Vector) -> Vector:
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for labels, count in vec.items():
        le = dict(labels)["le"]
        groups[tuple(kv for kv in labels if kv[0] != "le")].append((float(le), count))
    out: Vector = {}
    for labels, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1]
        if total <= 0 or not math.isinf(buckets[-1][0]):
            continue
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if math.isinf(bound):  # Prometheus: the highest finite bound
                    out[labels] = lower_bound
                else:
                    grown = count - lower_count
                    share = (rank - lower_count) / grown if grown else 1.0
                    out[labels] = lower_bound + (bound - lower_bound) * share
                break
            lower_bound, lower_count = bound, count
    return out


def evaluate(node: Node, scrapes: Sequence[Scrape]) -> Vector | float:
    """``node`` at the time of the last of ``scrapes`` (the earlier ones feed ``rate``)."""
    match node:
        case Number(value=value):
            return value
        case Selector():
            return _select(scrapes[-1], node)
        case Rate():
            return _rate(scrapes, node)
        case Sum(by=by, expr=inner):
            vec = evaluate(inner, scrapes)
            return _sum(vec, by) if isinstance(vec, dict) else vec
        case Quantile(q=q, expr=inner):
            vec = evaluate(inner, scrapes)
            return _quantile(q, vec) if isinstance(vec, dict) else math.nan
        case Binary(op=op, left=left, right=right):
            return _binary(op, evaluate(left, scrapes), evaluate(right, scrapes))
    raise PromQLError(f"cannot evaluate {node!r}")
