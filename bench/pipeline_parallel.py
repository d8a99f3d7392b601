"""Pipeline parallelism on this CPU: the bubble, and what crosses between hosts for TP and for PP.

The bubble: the time a decode batch takes to gain a token, for one model in four layouts on the
same cores, the runs alternating: one rank (with every core, and with one), two pipeline stages and
two tensor-parallel ranks (one core each). Under PP 2 the running requests go through in two
micro-batches, one in each stage; one request cannot be split, so at batch 1 the stages take
turns. Each layout is put against the one-core rank: what two cores add is the two-thread rank's
ratio.

Between hosts: the same engine split over two hosts, one rank each, host 1 in a network namespace
joined to this one by a veth pair (runtime/benchmarks/netns.py); the bytes on the pair over a
timed decode, per step, beside the data-plane bytes the layouts' arithmetic predicts (what remains
is rank 0 relaying the calls and replies, which both layouts pay). Needs root and iproute2; without
them the second table is left out and the report says so.

    .venv/bin/python bench/pipeline_parallel.py [--model DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.argtypes import positive_int
from kvpilot.runtime.benchmarks import netns
from kvpilot.runtime.benchmarks.report import BenchReport, best_and_median, interleaved, markdown_table
from kvpilot.runtime.config import EngineArgs

ROOT = Path(__file__).resolve().parents[1]
# Larger than the shared bench model: a step long enough (~20 ms on one core) that the ranks'
# handing on, not Python, is what the layouts add.
MODEL_SHAPE = dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4, vocab_size=2048)
DESCRIPTION = "an 8-layer, hidden-1024 llama (16 heads over 4 KV heads, vocab 2048, random weights, float32)"
PROMPT_LEN = 8
FLOAT32_BYTES, TOKEN_ID_BYTES = 4, 8
LAYOUTS = {
    "1 rank, 2 threads": dict(threads=2),
    "1 rank, 1 thread": dict(threads=1),
    "PP 2 (1 thread each)": dict(pipeline_parallel_size=2),
    "TP 2 (1 thread each)": dict(tensor_parallel_size=2),
}


def _prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(PROMPT_LEN)] for _ in range(count)]


def _decode_seconds_per_step(llm: LLM, batch: int, new_tokens: int, seed: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    prompts = _prompts(batch, llm.config.model.vocab_size, seed)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - start) / new_tokens


def _engine(model: str, layout: dict, **engine_args) -> LLM:
    layout = dict(layout)
    threads = layout.pop("threads", None)
    if threads is not None:  # workers set their own share: cores over local ranks
        torch.set_num_threads(threads)
    return LLM(model, max_model_len=256, **layout, **engine_args)


def step_times(model: str, batches: list[int], new_tokens: int, repetitions: int) -> dict[str, list[float]]:
    threads = torch.get_num_threads()

    def measure(layout: dict, batch: int):
        def one(repetition: int) -> float:
            llm = _engine(model, layout)
            try:
                _decode_seconds_per_step(llm, batch, 4, seed=-1)  # kernels built, buffers sized
                return _decode_seconds_per_step(llm, batch, new_tokens, seed=1000 * repetition + batch)
            finally:
                llm.engine.shutdown()
                torch.set_num_threads(threads)
        return one

    return interleaved({f"{name}, batch {batch}": measure(layout, batch)
                        for batch in batches for name, layout in LAYOUTS.items()}, repetitions)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bytes_per_step_across_hosts(model: str, layout: dict, batch: int, new_tokens: int) -> float:
    """Bytes on the veth pair per decode step, with one rank on each host. (Not the step time: on a
    shared 2-core machine, with both hosts' ranks on the same cores, it says nothing of a network.)"""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in layout.items()]
    kvpilot = str(Path(sys.executable).with_name("kvpilot"))
    with netns.two_hosts() as hosts:
        port = _free_port()
        second = subprocess.Popen(
            ["ip", "netns", "exec", hosts.namespace, kvpilot, "serve", model, "--headless", "--nnodes=2",
             "--node-rank=1", f"--master-addr={hosts.address}", f"--master-port={port}", "--max-model-len=256",
             *flags], env={**os.environ, "GLOO_SOCKET_IFNAME": hosts.their_interface}, stderr=subprocess.DEVNULL)
        os.environ["GLOO_SOCKET_IFNAME"] = hosts.interface
        try:
            llm = LLM(model, max_model_len=256, nnodes=2, master_addr=hosts.address, master_port=port, **layout)
            try:
                _decode_seconds_per_step(llm, batch, 4, seed=-1)
                before = hosts.bytes_crossed()
                _decode_seconds_per_step(llm, batch, new_tokens, seed=7)
                return (hosts.bytes_crossed() - before) / new_tokens
            finally:
                llm.engine.shutdown()
        finally:
            del os.environ["GLOO_SOCKET_IFNAME"]
            second.wait(timeout=60)


def predicted_bytes_per_step(config, layout: str, batch: int) -> int:
    """The data plane's bytes across the two hosts in one decode step of `batch` rows (float32):
    - PP 2: the residual stream (hidden and residual) one way, the sampled tokens back;
    - TP 2: each all-reduce (the embedding's, and two per layer) sends its whole tensor each way
      (reduce-scatter, then all-gather, of two halves); the LM head's gather swaps the two halves
      of the vocabulary."""
    stream = batch * config.hidden_size * FLOAT32_BYTES
    if layout == "pp":
        return 2 * stream + batch * TOKEN_ID_BYTES
    all_reduces = 1 + 2 * config.num_hidden_layers
    return all_reduces * 2 * stream + batch * config.vocab_size * FLOAT32_BYTES


def _make_model() -> str:
    # transformers (which tiny_model imports) takes seconds to import: only without --model.
    from kvpilot.runtime.tiny_model import make_tiny_model

    return str(make_tiny_model(tempfile.mkdtemp(prefix="kvpilot-bench-pp-"), **MODEL_SHAPE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"a checkpoint folder (default: {DESCRIPTION})")
    parser.add_argument("--batches", type=lambda s: [positive_int(n) for n in s.split(",")], default=[1, 16],
                        help="decode batches, one row each")
    parser.add_argument("--new-tokens", type=positive_int, default=48)
    parser.add_argument("--repetitions", type=positive_int, default=3)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/pipeline_parallel")
    args = parser.parse_args()
    # Imported here, not at the top: every rank this script starts is spawned, and re-imports the
    # script's top level; matplotlib only this process uses.
    from kvpilot.runtime.benchmarks.plot import line_figure

    report = BenchReport(__file__, args.output_dir, None, ROOT)
    model = args.model or _make_model()

    samples = step_times(model, args.batches, args.new_tokens, args.repetitions)
    medians = {name: best_and_median(values)[1] for name, values in samples.items()}
    rows = []
    for batch in args.batches:
        ms = {name: medians[f"{name}, batch {batch}"] for name in LAYOUTS}
        one_core = ms["1 rank, 1 thread"]
        rows.append([batch, *(f"{1000 * ms[name]:.2f}" for name in LAYOUTS),
                     *(f"{ms[name] / one_core:.2f}x" for name in LAYOUTS if name != "1 rank, 1 thread")])
    bubble = markdown_table(["decode batch", *(f"{name} (ms a step)" for name in LAYOUTS),
                             *(f"{name} / 1 rank, 1 thread" for name in LAYOUTS if name != "1 rank, 1 thread")],
                            rows)
    body = (f"Model: {model if args.model else DESCRIPTION}. Decode steps of batches of {PROMPT_LEN}-token random "
            f"prompts, {args.new_tokens} tokens out (EOS ignored), median of {args.repetitions} runs per layout, the "
            f"layouts alternating, one engine alive at a time.\n\n{bubble}")

    data = {"seconds_per_step": samples}
    reason = netns.unavailable()
    if reason is None:
        config = EngineArgs(model=model).create_engine_config().model
        rows, data["bytes_per_step"] = [], {}
        batch = args.batches[-1]
        for name, key, layout in (("TP 2", "tp", {"tensor_parallel_size": 2}),
                                  ("PP 2", "pp", {"pipeline_parallel_size": 2})):
            measured = bytes_per_step_across_hosts(model, layout, batch, args.new_tokens)
            predicted = predicted_bytes_per_step(config, key, batch)
            data["bytes_per_step"][name] = measured
            rows.append([name, f"{measured / 1024:.1f}", f"{predicted / 1024:.1f}",
                         f"{(measured - predicted) / 1024:.1f}"])
        body += ("\n\nAcross two hosts (a network namespace and a veth pair), one rank on each, decode batch "
                 f"{batch}: KiB a step on the pair, both directions, headers included.\n\n" + markdown_table(
                     ["layout", "measured", "data plane, predicted", "the rest (rank 0's relay of calls and replies; "
                      "gloo's and TCP's own messages)"], rows))
    else:
        body += f"\n\nThe bytes between hosts were not measured: {reason}."
    first, last = args.batches[0], args.batches[-1]

    def against_one_core(name: str, batch: int) -> float:
        return medians[f"{name}, batch {batch}"] / medians[f"1 rank, 1 thread, batch {batch}"]

    headline = (f"pipeline parallelism, two micro-batches in flight: PP 2's decode step "
                f"{against_one_core('PP 2 (1 thread each)', first):.2f}x a one-core rank's at batch {first}, "
                f"{against_one_core('PP 2 (1 thread each)', last):.2f}x at {last} (two threads on one rank: "
                f"{against_one_core('1 rank, 2 threads', last):.2f}x)")
    if "bytes_per_step" in data:
        crossed = data["bytes_per_step"]
        headline += f"; TP 2 moves {crossed['TP 2'] / crossed['PP 2']:.0f}x PP 2's bytes between hosts"
    figure = line_figure(report.output_path("step_time.png"),
                         {name: [(batch, 1000 * medians[f"{name}, batch {batch}"]) for batch in args.batches]
                          for name in LAYOUTS},
                         xlabel="decode batch (requests)", ylabel="ms a step (median run)",
                         title="A decode step, by layout, on the same cores", log_x=True)
    report.write(body, [figure], data, headline)


if __name__ == "__main__":
    main()
