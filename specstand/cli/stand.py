"""The stand: `specstand workload import`, `specstand record` (an agent's calls) and `specstand bench`."""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specstand.cli.common import (
    API_KEY_ENV,
    AUTO_DTYPE_HELP,
    DTYPE_CHOICES,
    CliError,
    CliParser,
    finite_float,
    log,
)
from specstand.cli.target import apply_speculative_config
from specstand.drafters import method_names

if TYPE_CHECKING:
    from specstand.bench.run import BenchConfig, Target


def add_parsers(commands: argparse._SubParsersAction) -> None:
    _add_workload_parser(commands)
    _add_record_parser(commands)
    _add_bench_parser(commands)


def _add_workload_parser(commands: argparse._SubParsersAction) -> None:
    workload = commands.add_parser("workload", help="import public agent workloads")
    workload_cmd = workload.add_subparsers(dest="workload_command", required=True, parser_class=CliParser)
    imp = workload_cmd.add_parser("import", help="convert a data set into the workload format")
    imp.add_argument("source", choices=["complexfuncbench", "nestful", "spec-bench"], help="the data set")
    imp.add_argument("--out", type=Path, required=True, help="workload file (JSON Lines) to write")
    imp.add_argument("--limit", type=int, default=None, help="at most this many turns")
    imp.add_argument("--skip", type=int, default=0,
                     help="leave out the first N turns that fit (e.g. those a drafter was trained on)")
    imp.add_argument("--max-prompt-chars", type=int, default=6000, help="skip turns with a longer call prompt")
    imp.add_argument("--max-result-chars", type=int, default=600, help="truncate recorded tool results")
    imp.add_argument("--max-tokens", type=int, default=None, help="answer budget per call")
    imp.add_argument("--spec-bench-file", type=Path, default=None,
                     help="spec-bench: its question.jsonl (default: shared/data/spec_bench/question.jsonl beside "
                     "this checkout)")
    imp.add_argument("--plain", action="store_true",
                     help="spec-bench: plain-text prompts, for base models without a chat template")
    imp.add_argument("--per-category", type=int, default=None, help="spec-bench: at most this many per category")


def _add_record_parser(commands: argparse._SubParsersAction) -> None:
    record = commands.add_parser("record", help="pass-through proxy that records an agent's calls as a workload")
    record.add_argument("--upstream", required=True, help="the OpenAI-compatible server the agent uses")
    record.add_argument("--host", default="127.0.0.1", help="address the proxy listens on")
    record.add_argument("--port", type=int, default=8100, help="port the proxy listens on")
    record.add_argument("--out", type=Path, required=True, help="workload file; finished turns are appended")
    record.add_argument("--turn-idle", type=finite_float, default=30.0,
                        help="a turn with no call for this many seconds is finished and written")


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="replay a workload under load and write the report")
    bench.add_argument("--workload", type=Path, required=True, help="workload file (JSON Lines) to replay")
    bench.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                       help="an OpenAI-compatible server to measure (repeatable)")
    bench.add_argument("--endpoint-command", action="append", default=[], metavar="NAME=COMMAND",
                       help="a shell command that serves --endpoint NAME: the bench starts it, and where the server "
                            "has no /reset_prefix_cache route (llama-cpp-python's) restarts it before each run, so "
                            "that every run starts from the same state")
    bench.add_argument("--model", default=None, help="start specstand servers for this model")
    bench.add_argument("--method", action="append", default=[],
                       help="method(s) to serve (repeatable or a,b,c), with adaptive verification; METHOD@fixed: "
                            "every draft verified at fixed K")
    bench.add_argument("--fixed", action="store_true",
                       help="also serve every drafted method at fixed K (as METHOD@fixed)")
    bench.add_argument("--speculative-config", action="append", default=[],
                       help="also serve a target configured by vLLM's JSON (repeatable; needs --model)")
    bench.add_argument("--k", type=int, default=None,
                       help="draft tokens per pass (default 5; block drafters: the drafts of one block)")
    bench.add_argument("--dtype", default="auto", choices=[*DTYPE_CHOICES, "auto"], help=AUTO_DTYPE_HELP)
    bench.add_argument("--max-seq-len", type=int, default=None,
                       help="context of each specstand server (default: the workload's longest call needs)")
    bench.add_argument("--max-batch", type=int, default=8, help="requests each specstand server decodes together")
    bench.add_argument("--users", default="1,4", help="comma-separated concurrent user counts")
    bench.add_argument("--repeats", type=int, default=3, help="runs of every target at every user count")
    bench.add_argument("--warm", default="system",
                       help="what each run finds cached, comma-separated for several tables: system (the "
                            "workload's system prompts and tool definitions, as on a server that has served "
                            "the same agent: an agent repeats them in every call) or none (cold, every head "
                            "computed in the run; a first call of the day). Default: system")
    bench.add_argument("--stagger", type=finite_float, default=0.0, metavar="SECONDS",
                       help="user u starts u * SECONDS into each run (the load ramps from 1 to U), so that the "
                            "users' prompts and answers do not come in lockstep (default 0: all start together)")
    bench.add_argument("--limit-turns", type=int, default=None, help="replay only the workload's first N turns")
    bench.add_argument("--baseline", default=None, help="target the others are compared with (default: first)")
    bench.add_argument("--drafter", action="append", type=Path, default=[],
                       help="trained drafter folder for its method (repeatable; default: the shipped one)")
    bench.add_argument("--out", type=Path, required=True, help="folder of the report (report.md, report.json, plots)")
    bench.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                       help=f"sent as `Authorization: Bearer KEY` to every target (default: ${API_KEY_ENV})")


def cmd_workload(args: argparse.Namespace) -> None:
    from specstand.workloads import save_workload
    from specstand.workloads.importers import SPEC_BENCH, import_spec_bench, import_tool_calls, nestful_wheel

    if args.limit is not None and args.limit < 1:
        raise CliError("--limit must be >= 1")
    if args.skip < 0:
        raise CliError("--skip must be >= 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise CliError("--max-tokens must be >= 1")
    wanted = None if args.limit is None else args.skip + args.limit
    if args.source == "spec-bench":
        turns = import_spec_bench(args.spec_bench_file or SPEC_BENCH, wanted, args.max_prompt_chars,
                                  args.max_tokens or 256, args.plain, args.per_category)
    else:
        turns = import_tool_calls(args.source, nestful_wheel(log=log), wanted, args.max_result_chars,
                                  args.max_prompt_chars, args.max_tokens or 128)
    turns = turns[args.skip:]
    if not turns:
        raise CliError("no turn fits the limits; raise --max-prompt-chars")
    save_workload(turns, args.out)
    calls = sum(len(t.calls) for t in turns)
    log(f"wrote {len(turns)} turns ({calls} calls) to {args.out}")


def cmd_record(args: argparse.Namespace) -> None:
    import uvicorn

    from specstand.recorder.proxy import create_recorder

    if not args.upstream.startswith("http"):
        raise CliError(f"--upstream must be an http(s) URL, not {args.upstream!r}")
    if args.turn_idle <= 0:
        raise CliError("--turn-idle must be > 0")
    if not 0 <= args.port < 2**16:
        raise CliError(f"--port must be in [0, 65535], not {args.port}")
    log(f"recording calls to {args.upstream} via http://{args.host}:{args.port} into {args.out}")
    uvicorn.run(create_recorder(args.upstream, args.out, args.turn_idle), host=args.host, port=args.port,
                log_level="warning")


def _config_target_name(text: str) -> str:
    """A bench target's name for a --speculative-config: its method and K, checked as `serve` will."""
    from specstand.bench.run import FIXED

    probe = argparse.Namespace(speculative_config=text, method="none", k=None, drafter=None, adaptive=True)
    apply_speculative_config(probe)
    return f"{probe.method}-cfg" + (f"-k{probe.k}" if probe.k is not None else "") + ("" if probe.adaptive else FIXED)


def _parse_users(text: str) -> list[int]:
    try:
        users = [int(u) for u in text.split(",") if u.strip()]
    except ValueError:
        raise CliError(f"--users must be comma-separated integers, not {text!r}") from None
    if not users or min(users) < 1:
        raise CliError("--users needs counts >= 1")
    return list(dict.fromkeys(users))  # "1,1" would summarise each run twice


def cmd_bench(args: argparse.Namespace) -> None:
    import asyncio

    from specstand.bench.run import run_bench, stop_servers, workload_context
    from specstand.workloads import load_workload

    users = _parse_users(args.users)
    warm = _parse_warm(args.warm)
    if args.repeats < 1:
        raise CliError("--repeats must be >= 1")
    if args.stagger < 0:
        raise CliError("--stagger must be >= 0 seconds")
    if args.limit_turns is not None and args.limit_turns < 1:
        raise CliError("--limit-turns must be >= 1")
    turns = load_workload(args.workload)[: args.limit_turns]
    if args.stagger and len(turns) < max(users):
        log(f"--stagger with {len(turns)} turns for {max(users)} users: users that replay the same turn find its "
            "prompts cached and its answers remembered from the user that started it earlier; give at least as "
            "many turns as users")
    methods, configured = _bench_methods(args)
    targets = _endpoint_targets(args.endpoint, args.endpoint_command)
    drafters = _drafters_by_method(args.drafter)
    # what can be checked before any server starts is (a model's servers take minutes to start and profile)
    names = [t.name for t in targets] + methods + [name for name, _ in configured]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise CliError(f"two targets are named {twice[0]!r}: each --endpoint, --method and --speculative-config "
                       "needs its own name (one would be measured under both)")
    if args.baseline is not None and args.baseline not in names:
        raise CliError(f"--baseline {args.baseline!r} is not one of the targets ({', '.join(names)})")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CliError(f"--out {args.out}: {error.strerror}") from None
    # a `kill` must stop the servers started below too (the finally clause), or they keep loading the CPU
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.model and (methods or configured) and args.max_seq_len is None:
        args.max_seq_len = workload_context(turns, args.model, max(args.k or 0, 15))
        log(f"context per request: {args.max_seq_len} tokens (the workload's longest prompt + answer + K + 1)")
    try:
        _start_servers(args, targets, methods, configured, drafters)
        config = _bench_config(args, users, warm, targets)
        try:
            table = asyncio.run(run_bench(targets, turns, config))
        except KeyboardInterrupt:
            raise CliError(f"interrupted; the partial report is in {args.out}") from None
        print(table)
        log(f"report: {args.out / 'report.md'}, raw: {args.out / 'report.json'}")
    finally:
        stop_servers(targets)


def _parse_warm(text: str) -> tuple[str, ...]:
    from specstand.bench.run import WARM_STATES

    warm = tuple(dict.fromkeys(w.strip() for w in text.split(",") if w.strip()))
    if not warm or any(w not in WARM_STATES for w in warm):
        raise CliError(f"--warm takes {' or '.join(WARM_STATES)} (comma-separated), not {text!r}")
    return warm


def _bench_methods(args: argparse.Namespace) -> tuple[list[str], list[tuple[str, str]]]:
    """The methods to serve and the --speculative-config targets (name, JSON), checked against what was
    given to serve them (--model) or to measure instead (--endpoint)."""
    from specstand.bench.run import FIXED, bench_method

    methods = list(dict.fromkeys(bench_method(m) for value in args.method for m in value.split(",") if m))
    if args.fixed:  # "suffix,suffix@fixed --fixed" names suffix@fixed once
        fixed = [f"{m}{FIXED}" for m in methods if m != "none" and not m.endswith(FIXED)]
        methods = list(dict.fromkeys(methods + fixed))
    configured = []
    for text in args.speculative_config:  # two configurations that differ past method and K get #2, #3, ...
        name = _config_target_name(text)
        taken = sum(1 for earlier, _ in configured if earlier.split("#")[0] == name)
        configured.append((f"{name}#{taken + 1}" if taken else name, text))
    if configured and not args.model:
        raise CliError("--speculative-config needs --model")
    for method in methods:
        if method.removesuffix(FIXED) not in method_names() or method == f"none{FIXED}":
            raise CliError(f"unknown method {method!r} (choose from {', '.join(method_names())}, each drafted one "
                           f"optionally with {FIXED})")
    if methods and not args.model:
        raise CliError("--method needs --model")
    if not methods and not args.endpoint:
        raise CliError("give --endpoint NAME=URL or --model M --method X")
    return methods, configured


def _endpoint_targets(endpoints: list[str], commands: list[str]) -> list[Target]:
    from specstand.bench.run import Target

    targets = []
    for spec in endpoints:
        name, sep, url = spec.partition("=")
        if not sep or not url.startswith("http"):
            raise CliError(f"--endpoint takes NAME=URL, not {spec!r}")
        targets.append(Target(name, url))
    named = {t.name: t for t in targets}
    for spec in commands:
        name, sep, command = spec.partition("=")
        if not sep or not command.strip():
            raise CliError(f"--endpoint-command takes NAME=COMMAND, not {spec!r}")
        if name not in named:
            raise CliError(f"--endpoint-command names {name!r}, which no --endpoint gives")
        named[name].command = command
    return targets


def _start_servers(args: argparse.Namespace, targets: list[Target], methods: list[str],
                   configured: list[tuple[str, str]], drafters: dict[str, Path]) -> None:
    """Waits for the endpoints in `targets`, then starts a server per method and per configuration, each
    added to `targets` as soon as it runs (so that a failure stops those already started). One server at
    a time: each profiles its passes at start (adaptive verification, the predicted speedup), which
    another server loading beside it would distort."""
    from specstand.bench.run import FIXED, start_endpoint, start_server, wait_ready

    for target in targets:
        if target.command:
            start_endpoint(target)
        else:
            wait_ready(target)
    for method in methods:
        targets.append(start_server(method, args.model, args.k, args.max_batch, args.dtype, args.max_seq_len,
                                    drafters.get(method.removesuffix(FIXED))))
        wait_ready(targets[-1])
    for name, text in configured:
        targets.append(start_server(name, args.model, None, args.max_batch, args.dtype, args.max_seq_len,
                                    speculative_config=text))
        wait_ready(targets[-1])


def _bench_config(args: argparse.Namespace, users: list[int], warm: tuple[str, ...],
                  targets: list[Target]) -> BenchConfig:
    from specstand.bench.run import BenchConfig

    return BenchConfig(str(args.workload), users, args.repeats, args.out, args.baseline or targets[0].name,
                       {"model": args.model, "dtype": args.dtype, "max_batch": args.max_batch,
                        "max_seq_len": args.max_seq_len}, api_key=args.api_key, warm=warm,
                       stagger_s=args.stagger)


def _exit_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _drafters_by_method(folders: list[Path]) -> dict[str, Path]:
    from specstand.drafters.trained import read_spec

    found = {}
    for folder in folders:
        spec = read_spec(folder)
        if spec.method in found:
            raise CliError(f"two --drafter folders for {spec.method}: {found[spec.method]} and {folder}")
        found[spec.method] = folder
    return found


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {"workload": cmd_workload, "record": cmd_record,
                                                              "bench": cmd_bench}
