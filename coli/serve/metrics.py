"""Prometheus text exposition (format 0.0.4) for the gateway's `/metrics`: the gateway's own request
counters and latency histograms, plus every stage's latest stats counters as the supervisor republishes
them (`status()["stats"]`), one gauge family per counter name with a `stage` label."""

from __future__ import annotations

import bisect
import math
import re
from typing import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(raw: str) -> str:
    n = _NAME_BAD.sub("_", raw)
    return n if n and not n[0].isdigit() else f"_{n}"


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str] | tuple) -> str:
    items = labels.items() if isinstance(labels, dict) else labels
    inner = ",".join(f'{k}="{_esc(str(v))}"' for k, v in items)
    return "{" + inner + "}" if inner else ""


def _num(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class Counter:
    def __init__(self, name: str, help: str, kind: str = "counter"):
        self.name, self.help, self.kind = name, help, kind
        self.values: dict[tuple, float] = {}

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for key, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(key)} {_num(v)}"


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.series: dict[tuple, list] = {}  # labels -> [bucket counts..., sum, count]

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        s = self.series.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[i] += 1
        s[-2] += value
        s[-1] += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for key, s in sorted(self.series.items()):
            acc = 0
            for le, c in zip(self.buckets, s):
                acc += c
                yield f"{self.name}_bucket{_labels(key + (('le', _num(float(le))),))} {acc}"
            yield f"{self.name}_bucket{_labels(key + (('le', '+Inf'),))} {s[-1]}"
            yield f"{self.name}_sum{_labels(key)} {_num(s[-2])}"
            yield f"{self.name}_count{_labels(key)} {s[-1]}"


def stage_stats_lines(stats: dict[str, dict], prefix: str = "coli_stage_") -> list[str]:
    """{stage: {counter: value}} -> one gauge family per counter name, labelled by stage. Stages report a
    mix of running totals and instantaneous values, so all are exposed as gauges (use rate() on the totals)."""
    families: dict[str, list[tuple[str, float]]] = {}
    for stage, counters in sorted(stats.items()):
        for k, v in counters.items():
            if k == "t" or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            families.setdefault(metric_name(k), []).append((stage, v))
    out: list[str] = []
    for name, rows in sorted(families.items()):
        full = prefix + name
        out.append(f"# HELP {full} stage stats counter '{name}' as last reported by each stage")
        out.append(f"# TYPE {full} gauge")
        out.extend(f'{full}{{stage="{_esc(stage)}"}} {_num(v)}' for stage, v in rows)
    return out
