"""`kvpilot simulate` (and `simulate calibrate`): argument definitions and handlers. Stdlib only
until a handler runs, so that the command line loads without numpy, torch or kopf."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvpilot.runtime.argtypes import DefaultsHelpFormatter, non_negative_float, positive_float, positive_int

BUILTIN_TRACES = ("poisson", "diurnal", "flash-crowd", "two-tenant", "multi-turn")
# routing.NAMES, spelled out so that the command line loads without numpy.
ROUTINGS = ("service", "prefix-aware", "least-loaded", "round-robin")
# The two-tenant mix's tenants, as CRD priorities (higher = more important).
TWO_TENANT_PRIORITIES = {"interactive": 1, "batch": 0}


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _tenant_priority(text: str) -> tuple[str, int]:
    name, _, priority = text.partition("=")
    if name and priority.lstrip("-").isdigit():
        return name, int(priority)
    raise argparse.ArgumentTypeError(f"must be TENANT=PRIORITY (an integer), got {text}")


def _names(text: str, known: tuple[str, ...], kind: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {kind} {', '.join(unknown) or repr(text)}: from {', '.join(known)}")
    return names


def _strategy_list(text: str) -> list[str]:
    from kvpilot.operator.sim.strategies import NAMES

    return _names(text, NAMES, "strategy")


def _routing_list(text: str) -> list[str]:
    return _names(text, ROUTINGS, "routing")


def add_simulate(commands: argparse._SubParsersAction) -> None:
    sim = commands.add_parser(
        "simulate", help="simulate an InferenceEngine fleet under the operator's autoscaler and tuner",
        description="Drive the operator's own autoscaler and policy tuner with a discrete-event model of a fleet of "
                    "engine replicas over a trace, beside the usual alternatives (static, KEDA-style queue-only, "
                    "KV-only), and report cost and latency per strategy.",
        formatter_class=DefaultsHelpFormatter)
    load = sim.add_argument_group("load")
    load.add_argument("--trace", default="poisson", metavar="|".join(BUILTIN_TRACES) + "|FILE",
                      help="a built-in generator, or a CSV/JSONL file with timestamp,tenant,prompt_tokens,output_tokens "
                           "(see examples/sim/)")
    load.add_argument("--rate", type=positive_float, default=10.0, metavar="RPS",
                      help="generators: the mean (poisson, diurnal), base (flash-crowd: 10x in its middle third) or "
                           "batch flood (two-tenant: interactive at a fifth of it) rate")
    load.add_argument("--duration", type=positive_float, metavar="SECONDS",
                      help="generators: the trace's length (default: 86400 for diurnal, else 3600)")
    load.add_argument("--prompt-tokens", type=positive_int, default=512,
                      help="generators: mean prompt length (multi-turn: of each turn's new message)")
    load.add_argument("--output-tokens", type=positive_int, default=256, help="generators: mean output length")
    load.add_argument("--seed", type=int, default=0, help="the trace's and the routing's seed")
    load.add_argument("--tenant-priority", type=_tenant_priority, action="append", default=[], metavar="TENANT=N",
                      help="a tenant's CRD priority (higher = more important; default 0; two-tenant: interactive=1)")
    load.add_argument("--turns", type=positive_int, default=4,
                      help="multi-turn: mean turns per conversation (uniform from 1 to twice this less 1)")
    load.add_argument("--think-seconds", type=non_negative_float, default=30.0,
                      help="multi-turn: mean time from one turn's request to the next (exponential)")
    load.add_argument("--system-tokens", type=_non_negative_int, default=1000, metavar="TOKENS",
                      help="multi-turn: the system prompt every conversation starts with (0: none)")
    load.add_argument("--conversation-arrivals", choices=("poisson", "diurnal", "flash-crowd"), default="poisson",
                      help="multi-turn: how new conversations arrive (--rate / --turns per second, on average "
                           "or at the base, as the trace of that name)")

    fleet = sim.add_argument_group("replicas")
    fleet.add_argument("--profile", default="h200-llama-8b",
                       help="step costs and KV pool: h200-llama-8b, h200-llama-70b-fp8, or a JSON file from "
                            "`simulate calibrate`")
    fleet.add_argument("--max-num-seqs", type=positive_int, default=256)
    fleet.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    fleet.add_argument("--startup-seconds", type=non_negative_float, default=120.0,
                       help="from spec.replicas to a ready replica (image pull, weight load)")
    fleet.add_argument("--request-timeout", type=positive_float, default=60.0, metavar="SECONDS",
                       help="a request without its first token by then is given up (timed out)")

    control = sim.add_argument_group("control (spec.autoscaling, spec.scheduling)")
    control.add_argument("--strategies", type=_strategy_list, metavar="S1,S2,...",
                         help="from static-peak, static-mean, oracle-reactive (knows the coming interval's rate), "
                              "ttft-planner (Dynamo-style: the last interval's rate over the profile's capacity), "
                              "hpa-rps (an HPA on requests/s per replica), queue-only, kv-only, kvpilot, each with "
                              "scheduling.policy auto (the CRD's default: the policy tuner on) and each also with "
                              "+fcfs (fcfs pinned); the autoscaled three also with +zero (minReplicas 0: scale "
                              "to zero, which needs a router), as in kvpilot+zero or kvpilot+zero+fcfs; "
                              "default: those without +zero")
    control.add_argument("--min-replicas", type=positive_int, default=1, help="of the strategies without +zero")
    control.add_argument("--max-replicas", type=positive_int, default=100)
    control.add_argument("--target-kv-cache-usage", type=_fraction, default=0.8)
    control.add_argument("--target-queue-depth", type=positive_float, default=5.0)
    control.add_argument("--interval-seconds", type=positive_float, default=15.0)
    control.add_argument("--scale-up-stabilization-seconds", type=non_negative_float, default=0.0)
    control.add_argument("--scale-down-stabilization-seconds", type=non_negative_float, default=300.0)
    control.add_argument("--scale-to-zero-after-seconds", type=non_negative_float, default=300.0,
                         help="+zero: how long the engine stays idle before it goes to 0 replicas")
    control.add_argument("--backlog-drain-seconds", type=positive_float, default=60.0,
                         help="how soon kvpilot's autoscaler means to drain a backlog once new replicas are ready")
    control.add_argument("--calm-window-seconds", type=non_negative_float, default=300.0)

    route = sim.add_argument_group("routing")
    route.add_argument("--routing", type=_routing_list, default=["service"], metavar="R1,R2,...",
                       help="how requests reach replicas, each run in turn: service (a Kubernetes Service, uniformly "
                            "at random), or kvpilot router's prefix-aware, least-loaded or round-robin")
    route.add_argument("--router-counts", choices=("interval", "fresh"), default="interval",
                       help="the engines' running and waiting counts the router reads: as of the last control "
                            "interval (a scrape each interval, as the operator's), or as of each request")
    route.add_argument("--hold-timeout", type=non_negative_float, default=60.0, metavar="SECONDS",
                       help="routing.holdTimeoutSeconds: how long a router holds a request while no replica is "
                            "ready (then it fails); with +zero, longer than --startup-seconds plus an interval")

    out = sim.add_argument_group("output")
    out.add_argument("--ttft-slo", type=positive_float, default=1.0, metavar="SECONDS",
                     help="a request meets its SLO when its first token comes within this")
    out.add_argument("--result-json", type=Path, metavar="PATH", help="write every strategy's figures and series here")
    out.add_argument("--plot-dir", type=Path, metavar="DIR", help="write timeline.png and cost_vs_slo.png here")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="a progress bar per strategy (default: on a terminal, for traces over a million requests)")
    sim.set_defaults(handler=_simulate, subparser=sim)

    kinds = sim.add_subparsers(dest="simulate_command", metavar="calibrate")
    calibrate = kinds.add_parser(
        "calibrate", help="time the real engine's steps on this machine and write a profile",
        description="Time LLM steps over batch sizes and context lengths, fit the profile's step cost, and write "
                    "it as JSON for `kvpilot simulate --profile`.",
        formatter_class=DefaultsHelpFormatter)
    calibrate.add_argument("model", metavar="MODEL_DIR", help="a Hugging Face checkpoint folder")
    calibrate.add_argument("--output", type=Path, required=True, metavar="PATH", help="the profile JSON to write")
    calibrate.add_argument("--batch-sizes", default="1,4,16", metavar="N1,N2,...")
    calibrate.add_argument("--context-lens", default="32,256", metavar="N1,N2,...")
    calibrate.add_argument("--decode-steps", type=positive_int, default=16, help="decode steps timed per point")
    calibrate.add_argument("--num-gpu-blocks", type=positive_int, default=1024,
                           help="the KV pool the engine gets (and the profile states)")
    calibrate.add_argument("--block-size", type=positive_int, default=16)
    calibrate.set_defaults(handler=_calibrate, subparser=calibrate)


def _simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import sys

    from kvpilot.operator.sim import fleet, planners, profile, report, strategies, trace

    for flag in ("rate", "duration"):
        if not math.isfinite(getattr(args, flag) or 0.0):
            parser.error(f"argument --{flag}: must be finite")
    try:
        if args.trace == "multi-turn":
            daylong = args.conversation_arrivals == "diurnal"
            loaded = trace.multi_turn(args.rate, args.duration or (trace.DAY if daylong else 3600.0),
                                      args.prompt_tokens, args.output_tokens, args.seed, turns=args.turns,
                                      think_seconds=args.think_seconds, system_tokens=args.system_tokens,
                                      pattern=args.conversation_arrivals)
        elif args.trace in BUILTIN_TRACES:
            duration = args.duration or (trace.DAY if args.trace == "diurnal" else 3600.0)
            loaded = trace.GENERATORS[args.trace](args.rate, duration, args.prompt_tokens, args.output_tokens,
                                                  args.seed)
        else:
            loaded = trace.read(Path(args.trace))
        chosen = profile.resolve(args.profile)
    except ValueError as error:
        parser.error(str(error))
    crd_priorities = dict(TWO_TENANT_PRIORITIES) if args.trace == "two-tenant" else {}
    crd_priorities.update(dict(args.tenant_priority))
    unknown = sorted(set(crd_priorities) - set(loaded.tenants))
    if args.tenant_priority and unknown:
        parser.error(f"argument --tenant-priority: the trace has no tenant {', '.join(unknown)}")
    # The engine runs the lower number first; the CRD's higher priority is the more important.
    priorities = [-crd_priorities.get(name, 0) for name in loaded.tenants]
    if args.min_replicas > args.max_replicas:
        parser.error("argument --min-replicas: must not exceed --max-replicas")
    if "service" in args.routing and any(strategies.TO_ZERO in name for name in args.strategies or ()):
        parser.error("argument --strategies: +zero needs a router (--routing), as minReplicas 0 does in the CRD")

    engine = fleet.Engine(args.max_num_seqs, args.max_num_batched_tokens, args.request_timeout, args.startup_seconds)
    settings = strategies.Settings(
        args.min_replicas, args.max_replicas, args.target_kv_cache_usage, args.target_queue_depth,
        args.interval_seconds, args.scale_up_stabilization_seconds, args.scale_down_stabilization_seconds,
        scale_to_zero_after_seconds=args.scale_to_zero_after_seconds, calm_window_seconds=args.calm_window_seconds,
        backlog_drain_seconds=args.backlog_drain_seconds)
    sizes = fleet.sizes(loaded, chosen, engine, args.target_kv_cache_usage)
    rates = planners.Rates(sizes.capacity, loaded.arrivals)
    show = args.progress if args.progress is not None else (sys.stderr.isatty() and len(loaded) > 1_000_000)
    print(f"{len(loaded)} requests over {loaded.duration:.0f} s ({loaded.mean_rate():.3g}/s mean,"
          f" {loaded.peak_rate():.3g}/s peak); profile {chosen.name}; one replica sustains about"
          f" {sizes.capacity:.3g} requests/s: static-peak {sizes.peak}, static-mean {sizes.mean} replicas")
    summaries, all_series = [], {}
    for name in args.strategies or strategies.DEFAULTS:
        for routing in args.routing:
            label = name if len(args.routing) == 1 else f"{name} {routing}"
            loop = strategies.build(name, settings, initial=sizes.initial, peak=sizes.peak, mean=sizes.mean,
                                    rates=rates)
            run = fleet.simulate(loaded, loop, chosen, engine, priorities=priorities, seed=args.seed,
                                 progress=_progress_bar(label, len(loaded)) if show else None, routing_name=routing,
                                 fresh_counts=args.router_counts == "fresh", hold_timeout_seconds=args.hold_timeout)
            summaries.append(report.summary(run, args.ttft_slo))
            all_series[label] = report.series(run)
    print(report.table(summaries))
    events = sum(s["events"] for s in summaries)
    wall = sum(s["wall_seconds"] for s in summaries)
    cpu = sum(s["cpu_seconds"] for s in summaries)
    print(f"{events} events in {wall:.1f} s ({cpu:.1f} s of CPU): {events / wall:.0f} events/s,"
          f" {events / max(cpu, 1e-9):.0f} per CPU second")
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(
            {"trace": args.trace, "profile": chosen.name, "sizes": sizes._asdict(), "summaries": summaries,
             "series": all_series}) + "\n")
    if args.plot_dir is not None:
        from kvpilot.operator.sim import plots

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        title = f"{args.trace}: {len(loaded)} requests, {chosen.name}"
        plots.timeline(all_series, args.plot_dir / "timeline.png", title)
        plots.cost_vs_slo(summaries, args.plot_dir / "cost_vs_slo.png", title)
    return 0


def _progress_bar(name: str, total: int):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=name, unit="req", unit_scale=True)

    def update(done: int) -> None:
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def _list(text: str, flag: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"argument {flag}: must be a comma-separated list of positive integers, got {text}")
    return values


def _calibrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvpilot.operator.sim import calibrate

    batches = _list(args.batch_sizes, "--batch-sizes", parser)
    contexts = _list(args.context_lens, "--context-lens", parser)
    if not Path(args.model, "config.json").is_file():
        parser.error(f"argument MODEL_DIR: no config.json in {args.model}")
    fitted = calibrate.calibrate(args.model, batch_sizes=batches, context_lens=contexts,
                                 decode_steps=args.decode_steps, num_gpu_blocks=args.num_gpu_blocks,
                                 block_size=args.block_size)
    fitted.save(args.output)
    print(json.dumps(fitted.__dict__, indent=1))
    return 0
