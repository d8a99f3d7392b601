"""The LoRA gauges of /metrics, read from the engine's latest stats at each scrape.

- `vllm:lora_requests_info`, as vLLM defines it: a gauge whose value is the time of the reading,
  labelled `max_lora`, `waiting_lora_adapters` and `running_lora_adapters` (adapter names joined
  with commas). One series at a time: vLLM leaves each past label set behind, which a query for
  the latest value then has to sort out.
- `kvpilot:lora_adapter_loaded{lora_name}` 1 for each adapter the engine holds loaded (in host
  memory): what a router prefers a replica for, and what the operator reads each pod has loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpilot.runtime.engine.messages import EngineStats


class LoRAMetrics(Collector):
    def __init__(self, latest_stats: Callable[[], EngineStats | None], max_loras: int) -> None:
        self.latest_stats = latest_stats
        self.max_loras = max_loras

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info, loaded = self._families()
        stats = self.latest_stats()
        if stats is not None:
            info.add_metric([str(self.max_loras), ",".join(stats.waiting_lora_adapters),
                             ",".join(stats.running_lora_adapters)], time.time())
            for name in stats.loaded_lora_adapters:
                loaded.add_metric([name], 1)
        yield info
        yield loaded

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                  labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"]),
                GaugeMetricFamily("kvpilot:lora_adapter_loaded",
                                  "1 for each LoRA adapter the engine holds loaded (in host memory).",
                                  labels=["lora_name"]))
