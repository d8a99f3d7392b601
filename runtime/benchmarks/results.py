"""Per-request measurements -> the summary `vllm bench serve` prints, under the same names."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    # perf_counter() when it was sent; the other times are seconds from then.
    sent_at: float = 0.0
    ttft: float | None = None
    e2e_latency: float = 0.0
    # Seconds between consecutive streamed chunks that carried text.
    itl: list[float] = field(default_factory=list)
    error: str = ""


def latency_summary(values: list[float], name: str, percentiles: tuple[int, ...]) -> dict[str, float]:
    """mean / median / pN of `values` in milliseconds (0 where there are none, as vLLM reports)."""
    ms = sorted(v * 1000 for v in values)
    summary = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
               f"median_{name}_ms": statistics.median(ms) if ms else 0.0}
    for p in percentiles:
        # Nearest-rank percentile: an observed value, never an interpolation past the largest.
        summary[f"p{p}_{name}_ms"] = ms[min(len(ms) - 1, max(0, -(-p * len(ms) // 100) - 1))] if ms else 0.0
    return summary


def summarize(results: list[RequestResult], duration: float, percentiles: tuple[int, ...] = (99,)) -> dict:
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    # Time per output token after the first: a request's decode speed as its client saw it.
    tpot = [(r.e2e_latency - r.ttft) / (r.output_tokens - 1) for r in done
            if r.ttft is not None and r.output_tokens > 1]
    summary = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    summary |= latency_summary([r.ttft for r in done if r.ttft is not None], "ttft", percentiles)
    summary |= latency_summary(tpot, "tpot", percentiles)
    summary |= latency_summary([gap for r in done for gap in r.itl], "itl", percentiles)
    summary |= latency_summary([r.e2e_latency for r in done], "e2el", percentiles)
    return summary


def format_summary(summary: dict, title: str = "Serving Benchmark Result") -> str:
    lines = [f"{' ' + title + ' ':=^60}"]
    for key, label in (("completed", "Successful requests"), ("failed", "Failed requests"),
                       ("duration", "Benchmark duration (s)"), ("total_input_tokens", "Total input tokens"),
                       ("total_output_tokens", "Total generated tokens"),
                       ("request_throughput", "Request throughput (req/s)"),
                       ("output_throughput", "Output token throughput (tok/s)"),
                       ("total_token_throughput", "Total token throughput (tok/s)")):
        value = summary[key]
        lines.append(f"{label:<44}{value:>16.2f}" if isinstance(value, float) else f"{label:<44}{value:>16}")
    for name, heading in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                          ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + heading + ' ':-^60}")
        for key in [k for k in summary if k.endswith(f"_{name}_ms")]:
            stat = key.split("_")[0]
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            lines.append(f"{f'{label} {name.upper()} (ms)':<44}{summary[key]:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
