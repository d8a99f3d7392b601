"""What the metrics sources read, and the pure half of reading it: PromQL in, per-pod samples out;
a pod's /metrics page in, one sample out. No I/O here (metrics.py does that).

A reading never raises on bad input: a value that is missing, not a number, NaN, negative, or a
KV-cache share above 1 becomes a `Problem` with a reason, which the autoscaler turns into a
condition instead of a scale decision.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
NUM_WAITING = "vllm:num_requests_waiting"
NUM_RUNNING = "vllm:num_requests_running"
METRICS = (KV_CACHE_USAGE, NUM_WAITING, NUM_RUNNING)
# A counter (summed over finished_reason), read where a pod exports it: two readings of it give
# the pod's completion rate, which the autoscaler drains a backlog by.
REQUESTS_FINISHED = "vllm:request_success_total"
# Histograms (cumulative buckets), read where a pod exports them: two readings give the latencies
# of the requests in between, which autoscaling.targets compares with its targets.
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
HISTOGRAMS = (TTFT, ITL)
# A router's gauge (with routing): the requests it holds because no replica is ready to take them.
REQUESTS_HELD = "kvpilot:router_requests_held"

# The reasons of MetricsAvailable=False.
MISSING = "MetricsMissing"
STALE = "MetricsStale"
INVALID = "MetricsInvalid"
UNREACHABLE = "PrometheusUnreachable"


@dataclass(frozen=True)
class PodSample:
    pod: str
    kv_cache_usage: float  # 0 to 1
    num_waiting: float
    num_running: float
    observed_at: float  # seconds since the epoch: when the pod's gauges were last read
    num_finished: float | None = None  # REQUESTS_FINISHED; None where the pod does not export it
    # TTFT and ITL's cumulative buckets, ((upper bound, count), ...) by bound, the last one +Inf;
    # None where the pod does not export the histogram.
    ttft: Buckets | None = None
    itl: Buckets | None = None


Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Problem:
    reason: str  # MISSING, INVALID or UNREACHABLE
    message: str


@dataclass(frozen=True)
class Reading:
    """One interval's read of an engine's ready pods: a sample per pod that answered well, a
    problem per pod that did not, or one failure for the whole read (Prometheus unreachable)."""

    samples: Mapping[str, PodSample] = field(default_factory=dict)
    problems: Mapping[str, Problem] = field(default_factory=dict)
    failure: Problem | None = None


def checked(pod: str, values: Mapping[str, float], observed_at: float,
            histograms: Mapping[str, Mapping[float, float]] | None = None) -> PodSample | Problem:
    """A sample from the three gauges' values (and the finished-requests counter and the latency
    histograms' buckets, {name: {upper bound: cumulative count}}, where there), or the problem
    with them."""
    missing = [name for name in METRICS if name not in values]
    if missing:
        return Problem(MISSING, f"pod {pod} reports no {', '.join(missing)}")
    for name in (*METRICS, REQUESTS_FINISHED):
        value = values.get(name, 0.0)
        if not math.isfinite(value) or value < 0 or (name == KV_CACHE_USAGE and value > 1):
            return Problem(INVALID, f"pod {pod} reports {name} = {value}")
    found: dict[str, Buckets] = {}
    for name, buckets in (histograms or {}).items():
        ordered = tuple(sorted(buckets.items()))
        counts = [count for _, count in ordered]
        if not ordered or ordered[-1][0] != math.inf or not all(math.isfinite(c) and c >= 0 for c in counts) \
                or counts != sorted(counts):
            return Problem(INVALID, f"pod {pod} reports a {name} histogram whose buckets are not cumulative"
                                    " counts up to +Inf")
        found[name] = ordered
    return PodSample(pod, values[KV_CACHE_USAGE], values[NUM_WAITING], values[NUM_RUNNING], observed_at,
                     values.get(REQUESTS_FINISHED), found.get(TTFT), found.get(ITL))


def from_page(pod: str, text: str, observed_at: float, *, latencies: bool = False) -> PodSample | Problem:
    """A pod's /metrics page (Prometheus text format) -> its sample, with the latency histograms
    where `latencies` asks for them. Series of one metric (one per model name, or finish reason)
    are summed."""
    try:
        wanted = _WANTED_FAMILIES + (HISTOGRAMS if latencies else ())
        families = list(text_string_to_metric_families(_wanted_lines(text, wanted)))
        values = _summed_samples(families, (*METRICS, REQUESTS_FINISHED))
        histograms = _summed_buckets(families)
    except _NOT_TEXT_FORMAT as error:
        return Problem(INVALID, f"pod {pod}: /metrics is not Prometheus text ({error})")
    return checked(pod, values, observed_at, histograms)


def counter_from_page(text: str, name: str) -> float | None:
    """A counter's value on a /metrics page, summed over its series; None where the page has none
    of it or is not Prometheus text (the router shows the replicas' prefix-cache hits with this)."""
    try:
        value = _summed(text, (name.removesuffix("_total"),), (name,)).get(name)
    except _NOT_TEXT_FORMAT:
        return None
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def held_from_page(pod: str, text: str) -> float | Problem:
    """A router pod's /metrics page -> the requests it holds, or the problem with it."""
    try:
        values = _summed(text, (REQUESTS_HELD,), (REQUESTS_HELD,))
    except _NOT_TEXT_FORMAT as error:
        return Problem(INVALID, f"router pod {pod}: /metrics is not Prometheus text ({error})")
    return checked_held(pod, values.get(REQUESTS_HELD))


def checked_held(pod: str, value: float | None) -> float | Problem:
    if value is None:
        return Problem(MISSING, f"router pod {pod} reports no {REQUESTS_HELD}")
    if not math.isfinite(value) or value < 0:
        return Problem(INVALID, f"router pod {pod} reports {REQUESTS_HELD} = {value}")
    return value


def total_held(held: Mapping[str, float | Problem]) -> float | Problem:
    """The requests every ready router holds, or the first problem: a router not read may hold
    the only request there is."""
    if not held:
        return Problem(MISSING, "no router is ready to be read")
    for value in held.values():
        if isinstance(value, Problem):
            return value
    return sum(value for value in held.values() if not isinstance(value, Problem))


# What the parser raises for a page that is not in the text format.
_NOT_TEXT_FORMAT = (ValueError, TypeError, IndexError)


def _summed(text: str, families: tuple[str, ...], names: tuple[str, ...]) -> dict[str, float]:
    """The page's samples of `names`, each summed over its series (one per model name, or
    finish reason); one of _NOT_TEXT_FORMAT where the page is not Prometheus text."""
    return _summed_samples(text_string_to_metric_families(_wanted_lines(text, families)), names)


def _summed_samples(families: Iterable[Any], names: tuple[str, ...]) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name in names:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def _summed_buckets(families: Iterable[Any]) -> dict[str, dict[float, float]]:
    """{histogram: {upper bound: cumulative count}} of HISTOGRAMS' buckets, summed over series."""
    found: dict[str, dict[float, float]] = {}
    for family in families:
        for sample in family.samples:
            if sample.name.removesuffix("_bucket") in HISTOGRAMS and sample.name.endswith("_bucket"):
                buckets = found.setdefault(sample.name.removesuffix("_bucket"), {})
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return found


# The families a sample is made of (a counter's family name has no _total). The parser would take
# some 5 ms of CPU for an engine's whole page, most of it histogram buckets, per pod and interval:
# a fleet's worth of that on the loop delays the reads that time out meanwhile. The latency
# histograms are parsed only for engines with autoscaling.targets: they triple a page's cost.
_WANTED_FAMILIES = (*METRICS, REQUESTS_FINISHED.removesuffix("_total"))
# What a line of the text format starts with: a metric name and its labels or value, a comment, or
# nothing. An HTML error page starts otherwise.
_TEXT_FORMAT_LINE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*[{ \t]|#|\s*$")


def _wanted_lines(text: str, families: tuple[str, ...]) -> str:
    """The lines of `families`' samples and metadata, for the parser; ValueError for a line that
    is no text-format line at all."""
    kept = []
    for line in text.splitlines():
        named = line[len("# HELP "):] if line.startswith(("# HELP ", "# TYPE ")) else line
        if named.startswith(families):
            kept.append(line)
        elif not _TEXT_FORMAT_LINE.match(line):
            raise ValueError(f"line {line[:40]!r}")
    return "\n".join(kept) + "\n"


def label_matcher(name: str, value: str) -> str:
    """`name="value"`, matching exactly that value."""
    return f"{name}={_string_literal(value)}"


def label_regex_matcher(name: str, values: Iterable[str]) -> str:
    """`name=~"a|b"`, matching exactly the given values: each is regex-escaped, then the whole
    pattern is escaped as a string literal."""
    return f"{name}=~{_string_literal('|'.join(re.escape(value) for value in sorted(values)))}"


def _string_literal(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def queries(namespace: str, pods: Iterable[str], window: str) -> dict[str, str]:
    """The PromQL per metric, and for the time of each pod's last scrape, each answering one
    series per pod. Pods are matched by the `namespace` and `pod` labels that a ServiceMonitor's
    scrape gives its targets; `max by (pod)` folds a pod's series (one per model name) into one."""
    selector = f"{label_matcher('namespace', namespace)},{label_regex_matcher('pod', pods)}"
    found = {name: f"max by (pod) (avg_over_time({name}{{{selector}}}[{window}]))" for name in METRICS}
    found[REQUESTS_FINISHED] = f"sum by (pod) ({REQUESTS_FINISHED}{{{selector}}})"
    found["observed_at"] = f"max by (pod) (timestamp({KV_CACHE_USAGE}{{{selector}}}))"
    return found


def held_query(namespace: str, pods: Iterable[str]) -> str:
    """The PromQL for each router pod's held requests, one series per pod (as `queries`)."""
    selector = f"{label_matcher('namespace', namespace)},{label_regex_matcher('pod', pods)}"
    return f"max by (pod) ({REQUESTS_HELD}{{{selector}}})"


def held_from_vector(pods: Iterable[str], answer: Mapping[str, float]) -> float | Problem:
    """The answer of `held_query` -> the requests the routers hold, or the problem with it."""
    return total_held({pod: checked_held(pod, answer.get(pod)) for pod in pods})


def vector(answer: Any) -> dict[str, float]:
    """An /api/v1/query answer -> {pod: value}; raises ValueError when it is not a successful
    instant-vector answer whose series carry a pod label and a value."""
    found: dict[str, float] = {}
    for series, value in _series(answer):
        try:
            found[str(series["metric"]["pod"])] = value
        except (KeyError, TypeError) as error:
            raise ValueError(f"a series without a pod label and a value: {series!r:.200}") from error
    return found


def _series(answer: Any) -> list[tuple[Any, float]]:
    """A successful instant-vector answer's (series, value) pairs; ValueError otherwise."""
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else None
        raise ValueError(f"the query failed: {error or 'not a Prometheus API answer'}")
    data = answer.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise ValueError("the answer is not an instant vector")
    pairs = []
    for series in data["result"]:
        try:
            _, value = series["value"]
            pairs.append((series, float(value)))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"a series without a pod label and a value: {series!r:.200}") from error
    return pairs


def bucket_queries(namespace: str, pods: Iterable[str]) -> dict[str, str]:
    """The PromQL for each latency histogram's cumulative buckets, one series per pod and bound."""
    selector = f"{label_matcher('namespace', namespace)},{label_regex_matcher('pod', pods)}"
    return {name: f"sum by (pod, le) ({name}_bucket{{{selector}}})" for name in HISTOGRAMS}


def bucket_vector(answer: Any) -> dict[str, dict[float, float]]:
    """An /api/v1/query answer of a `bucket_queries` query -> {pod: {upper bound: count}}; raises
    ValueError as `vector` does, and for a series without an le label that is a number."""
    found: dict[str, dict[float, float]] = {}
    for series, value in _series(answer):
        try:
            found.setdefault(str(series["metric"]["pod"]), {})[float(series["metric"]["le"])] = value
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"a bucket without a pod and an le label: {series!r:.200}") from error
    return found


def from_vectors(pods: Iterable[str], vectors: Mapping[str, Mapping[str, float]],
                 buckets: Mapping[str, Mapping[str, Mapping[float, float]]] | None = None) -> Reading:
    """The answers of `queries` (by the same keys), and of `bucket_queries` where read, -> a
    sample or a problem per pod."""
    samples: dict[str, PodSample] = {}
    problems: dict[str, Problem] = {}
    for pod in pods:
        values = {name: vectors[name][pod] for name in (*METRICS, REQUESTS_FINISHED)
                  if pod in vectors.get(name, {})}
        observed_at = vectors["observed_at"].get(pod)
        if observed_at is None or not math.isfinite(observed_at):
            problems[pod] = Problem(MISSING, f"Prometheus has no {KV_CACHE_USAGE} of pod {pod}")
            continue
        histograms = {name: by_pod[pod] for name, by_pod in (buckets or {}).items() if pod in by_pod}
        result = checked(pod, values, observed_at, histograms)
        if isinstance(result, Problem):
            problems[pod] = result
        else:
            samples[pod] = result
    return Reading(samples, problems)
