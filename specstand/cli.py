"""The `specstand` command line. Every failure ends in one readable line and a non-zero exit code."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from specstand.drafters import METHODS
from specstand.engine import GenerationResult

DTYPE_CHOICES = ["bf16", "fp32", "q8_0"]  # models/loading.py DTYPES
DTYPE_HELP = "weights: bf16, fp32, or q8_0 (bf16 model, linears as Q8_0 blocks: about half the bytes a pass reads)"
TOOL_CALL_PARSERS = ["hermes", "json"]  # server/tool_calls.py PARSERS
API_KEY_ENV = "SPECSTAND_API_KEY"
DEBUG_ENV = "SPECSTAND_DEBUG"  # set to 1: a failure prints its full traceback instead of one line
RECORDED_MODEL_HELP = "the target (default: the one the data or drafter were made with; smollm2-135m for new data)"
# train's numeric options: name, type, default, help
TRAIN_OPTIONS = [
    ("steps", int, 500, "optimizer steps"),
    ("lr", float, 1e-3, "peak learning rate (linear warm-up, then linear decay)"),
    ("pack-tokens", int, 2048, "tokens per training pack"),
    ("save-every", int, 50, "write a checkpoint every this many steps"),
    ("seed", int, 0, "seed of initialisation and data order"),
    ("layers", int, 0, "drafter layers (0: the method's default)"),
    ("intermediate-size", int, 0, "drafter MLP width (0: the target's, capped at 1536)"),
    ("draft-vocab", int, 8192, "tokens the drafter predicts (the target's most frequent in the data)"),
    ("num-taps", int, 5, "block methods: target layers read, spread over depth"),
    ("block-size", int, 8, "block methods: tokens per block"),
    ("anchors", int, 64, "block methods: blocks trained per pack"),
    ("train-steps", int, 3, "eagle3/mtp: unrolled training-time-test steps"),
    ("markov-rank", int, 256, "dspark: rank of its Markov head"),
    ("conv-kernel-size", int, 2, "dflash2: kernel size of its convolution"),
    ("selector-rank", int, 256, "dflash2: rank of its ranker"),
    ("selector-top-k", int, 16, "dflash2: candidates its ranker orders"),
    ("selector-alpha", float, 1.0, "dflash2: weight of the ranker's loss beside the unary one"),
]
KEEP_ALIVE_S = 75  # serve: seconds an idle HTTP connection stays open


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise CliError(message)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specstand", description="Lossless speculative decoding for LLM agents.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    models = commands.add_parser("models", help="list or fetch the model presets")
    models_cmd = models.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    models_cmd.add_parser("list", help="show the presets and whether they are cached")
    fetch = models_cmd.add_parser("fetch", help="download and convert a preset once")
    fetch.add_argument("name", help="the preset (see `specstand models list`)")

    commands.add_parser("doctor", help="CPU features, the kernel path chosen, peak compute and memory bandwidth")

    gen = commands.add_parser("generate", help="decode one prompt and print the answer and its stats")
    _model_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this share of probability")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    gen.add_argument("--max-tokens", type=int, default=256, help="most answer tokens")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="plain text prompt (no chat template)")
    source.add_argument("--messages-file", type=Path, help="OpenAI chat messages JSON; chat template applied")
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    serve = commands.add_parser("serve", help="OpenAI-compatible server with continuous batching (vLLM's flags)")
    serve.add_argument("model_name", nargs="?", default=None, metavar="MODEL",
                       help="preset name, model folder or hub id (as --model, which it replaces)")
    _model_args(serve, vllm_spellings=True)
    serve.set_defaults(model=None)  # so that MODEL and --model can be told apart
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, default=8,
                       help="requests decoded together")
    serve.add_argument("--max-queue", type=int, default=64, help="requests in flight before 429")
    serve.add_argument("--served-model-name", default="", help="the model's name in the API (default: --model)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="answers to requests offering tools come back as tool_calls where they hold calls")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="how answers write calls: hermes (<tool_call> tags) or json (a JSON object, bare, "
                            "fenced or tagged); default: the preset's (json)")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                       help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV})")
    serve.add_argument("--request-timeout", type=float, default=600.0, help="server-side deadline per request (s)")
    serve.add_argument("--max-prompt-chars", type=int, default=1_000_000, help="longer prompts get a 400")
    serve.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get a 413")

    workload = commands.add_parser("workload", help="import public agent workloads")
    workload_cmd = workload.add_subparsers(dest="workload_command", required=True, parser_class=_Parser)
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
                     help="spec-bench: its question.jsonl (default: shared/data/spec_bench/question.jsonl)")
    imp.add_argument("--plain", action="store_true",
                     help="spec-bench: plain-text prompts, for base models without a chat template")
    imp.add_argument("--per-category", type=int, default=None, help="spec-bench: at most this many per category")

    record = commands.add_parser("record", help="pass-through proxy that records an agent's calls as a workload")
    record.add_argument("--upstream", required=True, help="the OpenAI-compatible server the agent uses")
    record.add_argument("--host", default="127.0.0.1", help="address the proxy listens on")
    record.add_argument("--port", type=int, default=8100, help="port the proxy listens on")
    record.add_argument("--out", type=Path, required=True, help="workload file; finished turns are appended")
    record.add_argument("--turn-idle", type=float, default=30.0,
                        help="a turn with no call for this many seconds is finished and written")

    bench = commands.add_parser("bench", help="replay a workload under load and write the report")
    bench.add_argument("--workload", type=Path, required=True, help="workload file (JSON Lines) to replay")
    bench.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                       help="an OpenAI-compatible server to measure (repeatable)")
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
    bench.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    bench.add_argument("--max-seq-len", type=int, default=None,
                       help="context of each specstand server (default: the workload's longest call needs)")
    bench.add_argument("--max-batch", type=int, default=8, help="requests each specstand server decodes together")
    bench.add_argument("--users", default="1,4", help="comma-separated concurrent user counts")
    bench.add_argument("--repeats", type=int, default=3, help="runs of every target at every user count")
    bench.add_argument("--limit-turns", type=int, default=None, help="replay only the workload's first N turns")
    bench.add_argument("--baseline", default=None, help="target the others are compared with (default: first)")
    bench.add_argument("--drafter", action="append", type=Path, default=[],
                       help="trained drafter folder for its method (repeatable; default: the shipped one)")
    bench.add_argument("--out", type=Path, required=True, help="folder of the report (report.md, report.json, plots)")
    bench.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                       help=f"sent as `Authorization: Bearer KEY` to every target (default: ${API_KEY_ENV})")
    _training_parsers(commands)
    return parser


def _training_parsers(commands) -> None:
    data = commands.add_parser("train-data", help="the target answers a workload's calls: drafter training rows")
    data.add_argument("--model", default=None,
                      help="the target (default: the one a resumed --out was started with, else smollm2-135m)")
    data.add_argument("--workload", type=Path, action="append", required=True, help="workload JSONL (repeatable)")
    data.add_argument("--out", type=Path, required=True, help="folder of the rows (a partial run there resumes)")
    data.add_argument("--heldout", type=float, default=0.15, help="share of turns held out for evaluation")
    data.add_argument("--limit-calls", type=int, default=None, help="answer at most this many calls")
    data.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    data.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    data.add_argument("--samples", type=int, default=1, help="answers per call (needs --temperature > 0)")
    data.add_argument("--method", default="suffix", choices=["none", "ngram", "suffix", "schema"],
                      help="training-free drafter that speeds answering up (lossless: the answers do not change)")
    data.add_argument("--k", type=int, default=5, help="draft tokens verified per pass")
    data.add_argument("--endpoint", default=None, metavar="URL",
                      help="take the answers from this OpenAI-compatible server (vLLM, SGLang, specstand) instead")
    data.add_argument("--max-batch", type=int, default=4, help="calls answered together")
    data.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    data.add_argument("--max-seq-len", type=int, default=2048, help="context (cache capacity) per call")

    train = commands.add_parser("train", help="online distillation of a drafter from the frozen target")
    train.add_argument("--method", required=True,
                       help="eagle3, mtp, dflash, dspark or dflash2; several (a,b) share one pass of the target "
                            "over the data")
    train.add_argument("--model", default=None, help=RECORDED_MODEL_HELP)
    train.add_argument("--data", type=Path, action="append", required=True,
                       help="a `train-data` folder (repeatable: their rows are trained on together)")
    train.add_argument("--data-fraction", type=float, default=1.0,
                       help="train on this share of the training turns (stable and nested, for data-size curves)")
    train.add_argument("--out", type=Path, required=True,
                       help="checkpoint folder, resumed when it holds one (several methods: OUT/<method>)")
    train.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    for name, kind, default, text in TRAIN_OPTIONS:
        train.add_argument(f"--{name}", type=kind, default=default, help=text)
    train.add_argument("--position-weighting", choices=["dpace", "exp"], default="",
                       help="block methods' loss weight per draft position (default: dspark exp(-k/4), others D-PACE)")
    train.add_argument("--no-confidence-head", action="store_true", help="dspark without its confidence head")

    evaluate = commands.add_parser("eval-drafter", help="acceptance, tau and predicted speedup on held-out calls")
    evaluate.add_argument("--model", default=None, help=RECORDED_MODEL_HELP)
    evaluate.add_argument("--drafter", type=Path, required=True, help="the trained drafter's folder")
    evaluate.add_argument("--data", type=Path, action="append", required=True,
                          help="a `train-data` folder whose held-out rows are evaluated (repeatable)")
    evaluate.add_argument("--k", default=None, help="comma-separated draft lengths (default: 1,2,4 and the most)")
    evaluate.add_argument("--limit", type=int, default=None, help="at most this many held-out calls")
    evaluate.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    evaluate.add_argument("--json", type=Path, default=None, help="also write the figures here")
    evaluate.add_argument("--write-card", action="store_true", help="write the drafter's README.md model card")

    export = commands.add_parser("export", help="write a trained drafter in another format")
    export.add_argument("--format", choices=["speculators"], default="speculators", help="the format to write")
    export.add_argument("--model", default=None, help="the target (for its head rows); default: the drafter's")
    export.add_argument("drafter", type=Path, help="the trained drafter's folder")
    export.add_argument("out", type=Path, help="folder to write")

    imp = commands.add_parser("import", help="read a drafter written in another format")
    imp.add_argument("--format", choices=["speculators", "dflash-zlab"], default="speculators",
                     help="the format to read")
    imp.add_argument("--model", default=None, help="the target it drafts for; default: the verifier it names")
    imp.add_argument("source", type=Path, help="the drafter's folder in that format")
    imp.add_argument("out", type=Path, help="folder of the specstand drafter to write")


def _dtype(text: str) -> str:
    from specstand.models.loading import ModelError, resolve_dtype

    try:
        return resolve_dtype(text)
    except ModelError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _model_args(parser: argparse.ArgumentParser, vllm_spellings: bool = False) -> None:
    """The target's flags; with `vllm_spellings` (serve) vLLM's names and dtype spellings are taken too."""
    parser.add_argument("--model", default="smollm2-135m", help="preset name, model folder or hub id")
    parser.add_argument("--method", default="none", help=f"one of {', '.join(METHODS)}")
    parser.add_argument("--k", type=int, default=None,
                        help="most draft tokens verified per pass (default 5; DFlash: block size - 1)")
    parser.add_argument("--drafter", type=Path, default=None, help="trained drafter folder (default: shipped one)")
    if vllm_spellings:
        parser.add_argument("--dtype", default="bf16", type=_dtype,
                            help=DTYPE_HELP + "; or vLLM's bfloat16, float32, auto (bf16)")
    else:
        parser.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    parser.add_argument("--max-seq-len", *(["--max-model-len"] if vllm_spellings else []), dest="max_seq_len",
                        type=int, default=2048, help="context (cache capacity) per request")
    parser.add_argument("--speculative-config", default=None,
                        help="vLLM's JSON instead of --method/--k/--drafter: method (ngram, suffix, schema, eagle3, "
                             "dflash, mtp), model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
                             "adaptive")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                        help="verify only the draft tokens expected to pay for their rows (load-aware, lossless; "
                             "the default); --no-adaptive verifies every draft at fixed K")


def read_messages(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise CliError(f"cannot read messages file {path}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CliError(f"messages file {path} is not valid JSON: {error}") from None
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not data:
        raise CliError(f"messages file {path} must hold a non-empty list of messages")
    for i, message in enumerate(data):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise CliError(f"messages file {path}: message {i} needs string 'role' and 'content'")
    return data


def cmd_models(args: argparse.Namespace) -> None:
    from specstand.models.presets import PRESETS, fetch, is_fetched, preset_dir

    if args.models_command == "list":
        for name in PRESETS:
            state = f"cached in {preset_dir(name)}" if is_fetched(name) else "not fetched"
            print(f"{name:24s} {state}")
        return
    if args.name not in PRESETS:
        raise CliError(f"unknown model preset {args.name!r} (presets: {', '.join(PRESETS)})")
    print(fetch(args.name, log=_log))


def cmd_doctor(args: argparse.Namespace) -> None:
    from specstand import kernels

    for line in kernels.describe():
        print(line)


def cmd_generate(args: argparse.Namespace) -> None:
    from specstand.drafters import default_k, make_drafter
    from specstand.engine import Engine, EngineConfig, Request
    from specstand.models import load_model
    from specstand.verification import SamplingParams

    _check_model_args(args)
    if args.max_tokens <= 0:
        raise CliError("--max-tokens must be > 0")
    if args.prompt is not None and not args.prompt.strip():
        raise CliError("the prompt is empty")
    messages = read_messages(args.messages_file) if args.messages_file else None
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)

    model = load_model(args.model, args.dtype, args.max_seq_len, log=_log)
    prompt_ids = model.encode_messages(messages) if messages else model.encode_prompt(args.prompt)
    drafter = make_drafter(args.method, model.decoder, args.model, args.drafter, args.ngram, model.tokenizer)
    args.k = default_k(drafter, args.k)
    config = EngineConfig(num_speculative_tokens=args.k, max_seq_len=model.max_positions, adaptive=args.adaptive)
    engine = Engine(model.decoder, drafter, config)
    if not engine.exact:
        _log(f"{args.model}: not exact here (pass shapes round differently): drafts may change greedy answers")
    request = Request(prompt_ids, args.max_tokens, sampling, model.stop_token_ids)
    engine.add_request(request)  # validates the length before any work
    started = time.perf_counter()
    result = _run_one(engine)
    elapsed = time.perf_counter() - started
    output = {
        "model": args.model,
        "method": args.method,
        "k": args.k,
        "adaptive": args.adaptive,
        "exact": engine.exact,
        "text": model.decode(result.output_ids),
        "token_ids": result.output_ids,
        "prompt_tokens": len(prompt_ids),
        "finish_reason": result.finish_reason,
        "elapsed_s": round(elapsed, 4),
        "tokens_per_second": round(len(result.output_ids) / elapsed, 2),
        "stats": result.stats.to_dict(),
    }
    if args.json:
        print(json.dumps(output))
        return
    print(output["text"])
    stats = result.stats
    _log(
        f"[{args.method}] {len(result.output_ids)} tokens in {elapsed:.2f}s ({output['tokens_per_second']} tok/s), "
        f"tau {stats.tau:.2f} over all {stats.target_passes} passes "
        f"(vLLM-style 1+accepted/drafts: {stats.tau_per_draft:.2f} over {stats.passes_with_draft} drafted passes)"
    )


# vLLM's speculative methods -> ours
VLLM_METHODS = {"ngram": "ngram", "suffix": "suffix", "eagle3": "eagle3", "dflash": "dflash", "mtp": "mtp",
                "deepseek_mtp": "mtp", "dspark": "dspark", "dflash2": "dflash2", "schema": "schema"}


def _apply_speculative_config(args: argparse.Namespace) -> None:
    """Fill --method/--k/--drafter (and the n-gram sizes) from a vLLM --speculative-config."""
    args.ngram = None
    if args.speculative_config is None:
        return
    if args.method != "none" or args.k is not None or args.drafter is not None:
        raise CliError("give either --speculative-config or --method/--k/--drafter, not both")
    try:
        config = json.loads(args.speculative_config)
    except json.JSONDecodeError as error:
        raise CliError(f"--speculative-config is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise CliError("--speculative-config must be a JSON object")
    known = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise CliError(f"--speculative-config: {', '.join(unknown)} not supported (known: {', '.join(sorted(known))})")
    method = config.get("method")
    if method not in VLLM_METHODS:
        raise CliError(f"--speculative-config: method {method!r} is not one of {', '.join(VLLM_METHODS)}")
    args.method = VLLM_METHODS[method]
    k = config.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool)):
        raise CliError("--speculative-config: num_speculative_tokens must be an integer")
    args.k = k
    adaptive = config.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise CliError("--speculative-config: adaptive must be true or false")
    args.adaptive = args.adaptive and adaptive
    if config.get("model") is not None:
        args.drafter = Path(str(config["model"]))
    if "prompt_lookup_min" in config or "prompt_lookup_max" in config:
        if args.method != "ngram":
            raise CliError("--speculative-config: prompt_lookup_min/max belong to method ngram")
        from specstand.drafters import NgramConfig

        low, high = config.get("prompt_lookup_min", 1), config.get("prompt_lookup_max", 5)
        try:
            args.ngram = NgramConfig(int(low), int(high))
        except (TypeError, ValueError) as error:
            raise CliError(f"--speculative-config: {error}") from None


def _check_model_args(args: argparse.Namespace) -> None:
    _apply_speculative_config(args)
    if args.method not in METHODS:
        raise CliError(f"unknown method {args.method!r} (choose from {', '.join(METHODS)})")
    if args.k is not None and args.k < 0:
        raise CliError("--k must be >= 0")
    if args.drafter is not None and not args.drafter.is_dir():
        raise CliError(f"--drafter {args.drafter} is not a folder")


def _serve_target(args: argparse.Namespace) -> None:
    """`serve MODEL` (vLLM's spelling) or `serve --model MODEL`, not two different ones."""
    from specstand.models.presets import DEFAULT_MODEL

    if args.model_name and args.model and args.model_name != args.model:
        raise CliError(f"two models given: {args.model_name} and --model {args.model}")
    args.model = args.model_name or args.model or DEFAULT_MODEL


def _tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser answers are read with, or None when auto tool choice is off."""
    from specstand.models.presets import default_tool_call_parser

    if not args.enable_auto_tool_choice:
        if args.tool_call_parser:
            _log("--tool-call-parser takes effect with --enable-auto-tool-choice: answers stay content")
        return None
    return args.tool_call_parser or default_tool_call_parser(args.model)


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from specstand.models import load_model
    from specstand.server import ServerConfig, ServerLimits, build_server

    _serve_target(args)
    _check_model_args(args)
    if args.max_batch < 1 or args.max_queue < 1:
        raise CliError("--max-batch and --max-queue must be >= 1")
    if args.request_timeout <= 0 or args.max_prompt_chars <= 0 or args.max_body_bytes <= 0:
        raise CliError("--request-timeout, --max-prompt-chars and --max-body-bytes must be > 0")
    if not 0 <= args.port < 2**16:
        raise CliError(f"--port must be in [0, 65535], not {args.port}")
    parser = _tool_call_parser(args)
    # the server's failures go to stderr with their tracebacks (uvicorn keeps its own handlers)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = load_model(args.model, args.dtype, args.max_seq_len, log=_log)
    limits = ServerLimits(args.max_body_bytes, args.max_prompt_chars, args.request_timeout)
    config = ServerConfig(args.method, args.k, args.max_batch, args.max_queue, args.served_model_name,
                          args.model, args.drafter, args.ngram, limits, args.adaptive,
                          tool_call_parser=parser, api_key=args.api_key)
    app, worker = build_server(model, config)
    adaptive = ", adaptive verification" if args.adaptive else ", fixed K"
    if not worker.engine.exact:
        _log(f"{args.model}: not exact here (pass shapes round differently): drafts may change greedy answers")
    tools = f", tool calls read as {parser}" if parser else ""
    key = ", API key required" if args.api_key else ""
    _log(f"serving {args.model} with method {args.method} (K={worker.engine.config.num_speculative_tokens}"
         f"{adaptive}{tools}{key}) on http://{args.host}:{args.port}")
    try:
        # keep-alive well past the 5 s an httpx client (the openai SDK's) keeps an idle connection: a server
        # that closes first can close one just as the client sends a call on it
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        worker.stop()


def cmd_workload(args: argparse.Namespace) -> None:
    from specstand.workloads import save_workload
    from specstand.workloads.importers import SPEC_BENCH, import_spec_bench, import_tool_calls, nestful_wheel

    if args.limit is not None and args.limit < 1:
        raise CliError("--limit must be >= 1")
    if args.skip < 0:
        raise CliError("--skip must be >= 0")
    wanted = None if args.limit is None else args.skip + args.limit
    if args.source == "spec-bench":
        turns = import_spec_bench(args.spec_bench_file or SPEC_BENCH, wanted, args.max_prompt_chars,
                                  args.max_tokens or 256, args.plain, args.per_category)
    else:
        turns = import_tool_calls(args.source, nestful_wheel(log=_log), wanted, args.max_result_chars,
                                  args.max_prompt_chars, args.max_tokens or 128)
    turns = turns[args.skip:]
    if not turns:
        raise CliError("no turn fits the limits; raise --max-prompt-chars")
    save_workload(turns, args.out)
    calls = sum(len(t.calls) for t in turns)
    _log(f"wrote {len(turns)} turns ({calls} calls) to {args.out}")


def cmd_record(args: argparse.Namespace) -> None:
    import uvicorn

    from specstand.recorder.proxy import create_recorder

    if not args.upstream.startswith("http"):
        raise CliError(f"--upstream must be an http(s) URL, not {args.upstream!r}")
    _log(f"recording calls to {args.upstream} via http://{args.host}:{args.port} into {args.out}")
    if args.turn_idle <= 0:
        raise CliError("--turn-idle must be > 0")
    uvicorn.run(create_recorder(args.upstream, args.out, args.turn_idle), host=args.host, port=args.port,
                log_level="warning")


def _config_target_name(text: str) -> str:
    """A bench target's name for a --speculative-config: its method and K, checked as `serve` will."""
    from specstand.bench.run import FIXED

    probe = argparse.Namespace(speculative_config=text, method="none", k=None, drafter=None, adaptive=True)
    _apply_speculative_config(probe)
    return f"{probe.method}-cfg" + (f"-k{probe.k}" if probe.k is not None else "") + ("" if probe.adaptive else FIXED)


def _parse_users(text: str) -> list[int]:
    try:
        users = [int(u) for u in text.split(",") if u.strip()]
    except ValueError:
        raise CliError(f"--users must be comma-separated integers, not {text!r}") from None
    if not users or min(users) < 1:
        raise CliError("--users needs counts >= 1")
    return users


def cmd_bench(args: argparse.Namespace) -> None:
    import asyncio

    from specstand.bench.run import (
        FIXED,
        BenchConfig,
        Target,
        bench_method,
        run_bench,
        start_server,
        stop_servers,
        wait_ready,
        workload_context,
    )
    from specstand.workloads import load_workload

    users = _parse_users(args.users)
    if args.repeats < 1:
        raise CliError("--repeats must be >= 1")
    turns = load_workload(args.workload)[: args.limit_turns]
    methods = list(dict.fromkeys(bench_method(m) for value in args.method for m in value.split(",") if m))
    if args.fixed:
        methods += [f"{m}{FIXED}" for m in methods if m != "none" and not m.endswith(FIXED)]
    configured = [(_config_target_name(text), text) for text in args.speculative_config]
    if configured and not args.model:
        raise CliError("--speculative-config needs --model")
    for method in methods:
        if method.removesuffix(FIXED) not in METHODS or method == f"none{FIXED}":
            raise CliError(f"unknown method {method!r} (choose from {', '.join(METHODS)}, each drafted one "
                           f"optionally with {FIXED})")
    if methods and not args.model:
        raise CliError("--method needs --model")
    if not methods and not args.endpoint:
        raise CliError("give --endpoint NAME=URL or --model M --method X")
    targets: list[Target] = []
    for spec in args.endpoint:
        name, sep, url = spec.partition("=")
        if not sep or not url.startswith("http"):
            raise CliError(f"--endpoint takes NAME=URL, not {spec!r}")
        targets.append(Target(name, url))
    drafters = _drafters_by_method(args.drafter)
    if args.model and (methods or configured) and args.max_seq_len is None:
        args.max_seq_len = workload_context(turns, args.model, max(args.k or 0, 15))
        _log(f"context per request: {args.max_seq_len} tokens (the workload's longest prompt + answer + K + 1)")
    try:
        for target in targets:
            wait_ready(target)
        # one server at a time: each profiles its passes at start (adaptive verification, the predicted
        # speedup), which another server loading beside it would distort
        for method in methods:
            targets.append(start_server(method, args.model, args.k, args.max_batch, args.dtype, args.max_seq_len,
                                        drafters.get(method.removesuffix(FIXED))))
            wait_ready(targets[-1])
        for name, text in configured:
            targets.append(start_server(name, args.model, None, args.max_batch, args.dtype, args.max_seq_len,
                                        speculative_config=text))
            wait_ready(targets[-1])
        baseline = args.baseline or targets[0].name
        if baseline not in [t.name for t in targets]:
            raise CliError(f"--baseline {baseline!r} is not one of the targets")
        config = BenchConfig(str(args.workload), users, args.repeats, args.out, baseline,
                             {"model": args.model, "dtype": args.dtype, "max_batch": args.max_batch,
                              "max_seq_len": args.max_seq_len}, api_key=args.api_key)
        try:
            table = asyncio.run(run_bench(targets, turns, config))
        except KeyboardInterrupt:
            raise CliError(f"interrupted; the partial report is in {args.out}") from None
        print(table)
        _log(f"report: {args.out / 'report.md'}, raw: {args.out / 'report.json'}")
    finally:
        stop_servers(targets)


def _recorded_target(explicit: str | None, recorded: list[tuple[str, str]]) -> str:
    """The target of a training command: the model its data and drafter were made with (`recorded`: (model,
    where it is written)); an explicit --model must name that one. Without any record: --model, or the
    default model."""
    from specstand.models.loading import same_model
    from specstand.models.presets import DEFAULT_MODEL

    if not recorded:
        return explicit or DEFAULT_MODEL
    model, where = recorded[0]
    for other, other_where in recorded[1:]:
        if not same_model(other, model):
            raise CliError(f"{where} was made with {model} but {other_where} with {other}")
    if explicit is not None and not same_model(explicit, model):
        raise CliError(f"--model {explicit} is not {model}, the model {where} was made with")
    return explicit or model


def _data_models(folders: list[Path]) -> list[tuple[str, str]]:
    from specstand.training.data import recorded_model

    found = [recorded_model(folder) for folder in folders]
    return [(model, str(path)) for model, path in filter(None, found)]


def cmd_train_data(args: argparse.Namespace) -> None:
    import httpx

    from specstand.drafters import make_drafter
    from specstand.models import load_model
    from specstand.training.data import (
        HELDOUT_WORKLOAD,
        EndpointError,
        PartialRows,
        generate_rows,
        heldout_turn,
        save_rows,
    )
    from specstand.verification import SamplingParams
    from specstand.workloads import load_workload, save_workload

    if not 0 <= args.heldout < 1:
        raise CliError("--heldout must be in [0, 1)")
    if args.samples < 1 or (args.samples > 1 and args.temperature == 0):
        raise CliError("--samples must be >= 1, and above 1 only with --temperature > 0")
    if args.k < 1:
        raise CliError("--k must be >= 1")
    args.model = _recorded_target(args.model, _data_models([args.out]))  # a resumed run keeps its target
    turns = [turn for path in args.workload for turn in load_workload(path)]
    if args.limit_calls is not None:
        kept, count = [], 0
        for turn in turns:  # whole turns only, so the split by turn stays clean
            if count + len(turn.calls) > args.limit_calls:
                break
            kept.append(turn)
            count += len(turn.calls)
        turns = kept
    if not turns:
        raise CliError("no call to answer (raise --limit-calls)")
    model = load_model(args.model, args.dtype, args.max_seq_len, log=_log)
    sampling = SamplingParams(args.temperature, seed=args.seed)
    # what decides the rows: a resumed run must have the same, or its partial rows would mix two runs
    calls = hashlib.sha256(json.dumps([[t.turn_id, c.id] for t in turns for c in t.calls]).encode()).hexdigest()
    config = {"model": args.model, "dtype": args.dtype, "calls": calls, "temperature": args.temperature,
              "seed": args.seed, "samples": args.samples, "heldout_share": args.heldout,
              "max_seq_len": model.max_positions}
    try:
        partial = PartialRows(args.out, config)
    except ValueError as error:
        raise CliError(str(error)) from None
    if partial.rows:
        _log(f"resuming: {len(partial.rows)} answers already in {partial.path}")
    drafter = make_drafter(args.method, tokenizer=model.tokenizer)
    started = time.perf_counter()
    try:
        rows = generate_rows(model, turns, args.heldout, sampling, args.max_batch, model.max_positions, drafter,
                             args.k, args.samples, partial, args.endpoint)
    except (EndpointError, httpx.HTTPError) as error:
        raise CliError(f"the endpoint failed ({error}); the answers so far are kept: rerun to resume") from None
    finally:
        partial.close()
    meta = {"model": args.model, "dtype": args.dtype, "workloads": [str(p) for p in args.workload],
            "sources": sorted({turn.source for turn in turns if turn.source}),
            "temperature": args.temperature, "samples": args.samples, "heldout_share": args.heldout,
            "drafter": args.method, "endpoint": args.endpoint, "seconds": round(time.perf_counter() - started)}
    save_rows(args.out, rows, meta)
    partial.path.unlink()
    save_workload([t for t in turns if heldout_turn(t.turn_id, args.heldout)], args.out / HELDOUT_WORKLOAD)
    _log(f"wrote {len(rows)} rows ({sum(r.split == 'heldout' for r in rows)} held out) to {args.out}; "
         f"the held-out turns, to bench on: {args.out / HELDOUT_WORKLOAD}")


def cmd_train(args: argparse.Namespace) -> None:
    from specstand.models import load_model
    from specstand.training import distributed
    from specstand.training.features import TargetFeatures
    from specstand.training.trainer import TrainConfig, tap_layers_for, train

    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    if not methods:
        raise CliError("--method names no method (e.g. --method dflash or --method dflash,eagle3)")
    if len(set(methods)) != len(methods):
        raise CliError(f"--method names a method twice: {args.method}")
    args.model = _recorded_target(args.model, _data_models(args.data))
    configs = [TrainConfig(
        method=method, data=[str(d) for d in args.data], data_fraction=args.data_fraction,
        out=str(args.out / method if len(methods) > 1 else args.out),
        steps=args.steps, lr=args.lr, pack_tokens=args.pack_tokens, save_every=args.save_every, seed=args.seed,
        num_layers=args.layers, intermediate_size=args.intermediate_size, draft_vocab_size=args.draft_vocab,
        num_taps=args.num_taps, block_size=args.block_size, anchors=args.anchors, train_steps=args.train_steps,
        position_weighting=args.position_weighting, markov_rank=args.markov_rank,
        confidence_head=not args.no_confidence_head, conv_kernel_size=args.conv_kernel_size,
        selector_rank=args.selector_rank, selector_top_k=args.selector_top_k, selector_alpha=args.selector_alpha,
    ) for method in methods]
    model = load_model(args.model, args.dtype, configs[0].max_len, log=_log)
    taps = [t for c in configs for t in tap_layers_for(c, model.decoder.shape.num_layers)]
    features = TargetFeatures(model.decoder, taps, min(configs[0].max_len, model.max_positions))
    world = distributed.start()  # a world of one unless launched by torchrun
    try:
        for config in configs:
            train(config, model, log=_log, features=features, world=world)
            if world.main:
                _log(f"{config.method} drafter written to {config.out}")
    finally:
        distributed.stop(world)


def cmd_eval_drafter(args: argparse.Namespace) -> None:
    from specstand.drafters.trained import read_spec
    from specstand.models import load_model
    from specstand.training.data import load_datasets
    from specstand.training.evaluate import as_dicts, evaluate_drafter, write_card

    spec = read_spec(args.drafter)
    args.model = _recorded_target(args.model, [(spec.target, str(args.drafter)), *_data_models(args.data)])
    most = spec.block_drafts or 5
    try:
        ks = sorted({int(k) for k in args.k.split(",")}) if args.k else sorted({1, 2, 4, most})
    except ValueError:
        raise CliError(f"--k takes comma-separated integers, not {args.k!r}") from None
    if min(ks) < 1:
        raise CliError("--k values must be >= 1")
    _, rows = load_datasets(args.data)
    heldout = [r for r in rows if r.split == "heldout"][: args.limit]
    if not heldout:
        raise CliError(f"{', '.join(map(str, args.data))}: no held-out rows")
    model = load_model(args.model, args.dtype, 2048, log=_log)
    figures = evaluate_drafter(model, args.drafter, heldout, ks, model.max_positions, log=_log)
    if args.json:
        args.json.write_text(json.dumps({"drafter": str(args.drafter), "method": spec.method,
                                         "figures": as_dicts(figures)}, indent=1) + "\n")
    if args.write_card:
        write_card(args.drafter, figures, "specstand " + " ".join(sys.argv[1:]))
    print("| K | tau | tau (vLLM) | acceptance per position | verify ms | draft ms | predicted | measured |")
    print("|---|---|---|---|---|---|---|---|")
    for f in figures:
        print(f"| {f.k} | {f.tau} | {f.tau_per_draft} | {' '.join(str(a) for a in f.acceptance_per_position)} | "
              f"{f.verify_ms} | {f.draft_ms} | x{f.predicted_speedup} | x{f.measured_speedup} |")


def cmd_export(args: argparse.Namespace) -> None:
    from specstand.drafters.trained import read_spec
    from specstand.interop.speculators import export_speculators
    from specstand.models import load_model

    spec = read_spec(args.drafter)
    model = load_model(args.model or spec.target, "bf16", 2048, log=_log)
    export_speculators(args.drafter, model, args.out)
    _log(f"wrote {args.out / 'config.json'} and {args.out / 'model.safetensors'} (speculators {spec.method})")


def cmd_import(args: argparse.Namespace) -> None:
    from specstand.interop.speculators import import_dflash_zlab, import_speculators

    reader = import_speculators if args.format == "speculators" else import_dflash_zlab
    spec = reader(args.source, args.out, args.model)
    _log(f"wrote a specstand {spec.method} drafter for {spec.target} to {args.out}")


def _drafters_by_method(folders: list[Path]) -> dict[str, Path]:
    from specstand.drafters.trained import read_spec

    found = {}
    for folder in folders:
        spec = read_spec(folder)
        if spec.method in found:
            raise CliError(f"two --drafter folders for {spec.method}: {found[spec.method]} and {folder}")
        found[spec.method] = folder
    return found


def _run_one(engine) -> GenerationResult:
    """Step the engine until its one request finishes."""
    while True:
        for event in engine.step():
            if event.finished is not None:
                return event.finished


COMMANDS = {"models": cmd_models, "doctor": cmd_doctor, "generate": cmd_generate, "serve": cmd_serve,
            "workload": cmd_workload, "record": cmd_record, "bench": cmd_bench, "train-data": cmd_train_data,
            "train": cmd_train, "eval-drafter": cmd_eval_drafter, "export": cmd_export, "import": cmd_import}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        COMMANDS[args.command](args)
    except CliError as error:
        _print_failure(str(error))
        return 2
    except (ValueError, RuntimeError, OSError) as error:
        _print_failure(str(error).splitlines()[0] if str(error) else type(error).__name__)
        return 1
    except KeyboardInterrupt:
        print("specstand: interrupted", file=sys.stderr)
        return 130
    return 0


def _print_failure(message: str) -> None:
    """One line; the whole traceback first where SPECSTAND_DEBUG=1."""
    if os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exc()
    print(f"specstand: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
