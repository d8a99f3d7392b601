"""The simulator's reference scalers, which size the fleet from the request rate instead of the
engines' metrics. Each turns one interval into a recommendation; strategies.py puts it under the
same stabilization windows, bounds and start-up delay as the operator's autoscaler
(autoscaler.stabilized).

- `oracle-reactive`: knows the arrivals of the coming interval and asks for what they need at the
  profile's capacity, as the load changes and never earlier. No reactive scaler can do better on a
  step, so it is the bar there, not static-peak (provisioned before the step).
- `ttft-planner`: Dynamo's SLA planner in an aggregated fleet: the last interval's request rate as
  the next one's (its constant predictor), over the profile's capacity at the TTFT target.
- `hpa-rps`: a HorizontalPodAutoscaler on requests per second per replica (an external metric,
  AverageValue), its target the profile's capacity; it scales up by at most 100 % or 4 pods per
  period, whichever is more, as the HPA's default scale-up policy does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

ORACLE = "oracle-reactive"
TTFT_PLANNER = "ttft-planner"
HPA_RPS = "hpa-rps"
NAMES = (ORACLE, TTFT_PLANNER, HPA_RPS)
# The HPA's default tolerance, and its default scale-up policy (per 15 s period).
HPA_TOLERANCE = 0.1
HPA_UP_FACTOR = 2
HPA_UP_PODS = 4


@dataclass(frozen=True)
class Rates:
    """What the reference scalers know of the load: requests per second one replica serves within
    the TTFT SLO (the profile's capacity at targetKVCacheUsage, as static-peak is sized), and the
    trace's arrivals between two times."""

    capacity: float
    arrivals: Callable[[float, float], int]

    def rate(self, start: float, end: float) -> float:
        return self.arrivals(start, end) / (end - start)


def recommend(name: str, rates: Rates, now: float, interval: float, replicas: int) -> int:
    """The count `name` asks for at `now`, with `replicas` asked for so far."""
    if name == ORACLE:
        return math.ceil(rates.rate(now, now + interval) / rates.capacity - 1e-9)
    if now < interval:  # nothing seen yet: the count the run began with
        return replicas
    needed = rates.rate(now - interval, now) / rates.capacity
    if name == TTFT_PLANNER:
        return math.ceil(needed - 1e-9)
    if name == HPA_RPS:
        if replicas and abs(needed / replicas - 1) <= HPA_TOLERANCE:
            return replicas
        return min(math.ceil(needed - 1e-9), max(replicas * HPA_UP_FACTOR, replicas + HPA_UP_PODS))
    raise ValueError(f"unknown planner {name!r}: one of {', '.join(NAMES)}")
