"""`specstand generate` (one prompt) and `specstand serve` (the OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from specstand.cli.common import API_KEY_ENV, CliError, finite_float, log
from specstand.cli.target import add_target_args, check_target_args
from specstand.engine import GenerationResult

TOOL_CALL_PARSERS = ["hermes", "json"]  # server/tool_calls.py PARSERS
KEEP_ALIVE_S = 75  # serve: seconds an idle HTTP connection stays open
GENERATE_QUIET_WAIT_S = 10.0  # generate: the most a one-off call waits for quiet CPUs to time its passes


def add_parsers(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="decode one prompt and print the answer and its stats")
    add_target_args(gen)
    gen.add_argument("--temperature", type=finite_float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling: keep this share of probability")
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
    add_target_args(serve, vllm_spellings=True)
    serve.set_defaults(model=None)  # so that MODEL and --model can be told apart
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, default=8,
                       help="requests decoded together")
    serve.add_argument("--max-queue", type=int, default=64, help="requests in flight before 429")
    serve.add_argument("--prefix-cache-gb", type=finite_float, default=None,
                       help="host memory for finished requests' K/V, reused by later prompts with the same head "
                            "(an agent's system prompt and tools) after their slot is taken; 0: slots only "
                            "(default: a quarter of the free memory, at most 4)")
    serve.add_argument("--served-model-name", default="", help="the model's name in the API (default: --model)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="answers to requests offering tools come back as tool_calls where they hold calls")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="how answers write calls: hermes (<tool_call> tags) or json (a JSON object, bare, "
                            "fenced or tagged); default: the preset's (json)")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                       help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV})")
    serve.add_argument("--request-timeout", type=finite_float, default=600.0,
                       help="server-side deadline per request (s)")
    serve.add_argument("--max-prompt-chars", type=int, default=1_000_000, help="longer prompts get a 400")
    serve.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get a 413")


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


def cmd_generate(args: argparse.Namespace) -> None:
    from specstand.drafters import default_k, make_drafter
    from specstand.engine import Engine, EngineConfig, Request
    from specstand.models import load_model
    from specstand.verification import SamplingParams

    check_target_args(args)
    if args.max_tokens <= 0:
        raise CliError("--max-tokens must be > 0")
    if args.prompt is not None and not args.prompt.strip():
        raise CliError("the prompt is empty")
    messages = read_messages(args.messages_file) if args.messages_file else None
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)

    model = load_model(args.model, args.dtype, args.max_seq_len, log=log)
    prompt_ids = model.encode_messages(messages) if messages else model.encode_prompt(args.prompt)
    drafter = make_drafter(args.method, model.decoder, args.model, args.drafter, args.ngram, model.tokenizer)
    args.k = default_k(drafter, args.k)
    config = EngineConfig(num_speculative_tokens=args.k, max_seq_len=model.max_positions, adaptive=args.adaptive,
                          profile_wait_s=GENERATE_QUIET_WAIT_S)
    engine = Engine(model.decoder, drafter, config)
    if not engine.exact:
        log(f"{args.model}: not exact here (pass shapes round differently): drafts may change greedy answers")
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
    log(
        f"[{args.method}] {len(result.output_ids)} tokens in {elapsed:.2f}s ({output['tokens_per_second']} tok/s), "
        f"tau {stats.tau:.2f} over all {stats.target_passes} passes "
        f"(vLLM-style 1+accepted/drafts: {stats.tau_per_draft:.2f} over {stats.passes_with_draft} drafted passes)"
    )


def _run_one(engine) -> GenerationResult:
    """Step the engine until its one request finishes."""
    while True:
        for event in engine.step():
            if event.finished is not None:
                return event.finished


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
            log("--tool-call-parser takes effect with --enable-auto-tool-choice: answers stay content")
        return None
    return args.tool_call_parser or default_tool_call_parser(args.model)


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from specstand.models import load_model
    from specstand.server import ServerConfig, ServerLimits, build_server

    _serve_target(args)
    check_target_args(args)
    if args.max_batch < 1 or args.max_queue < 1:
        raise CliError("--max-batch and --max-queue must be >= 1")
    if args.prefix_cache_gb is not None and args.prefix_cache_gb < 0:
        raise CliError("--prefix-cache-gb must be >= 0")
    if args.request_timeout <= 0 or args.max_prompt_chars <= 0 or args.max_body_bytes <= 0:
        raise CliError("--request-timeout, --max-prompt-chars and --max-body-bytes must be > 0")
    if not 0 <= args.port < 2**16:
        raise CliError(f"--port must be in [0, 65535], not {args.port}")
    parser = _tool_call_parser(args)
    listening = _listening_socket(args.host, args.port)  # before the model loads: a taken port fails at once
    port = listening.getsockname()[1]
    # the server's failures go to stderr with their tracebacks (uvicorn keeps its own handlers)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = ServerLimits(args.max_body_bytes, args.max_prompt_chars, args.request_timeout)
    store = None if args.prefix_cache_gb is None else int(args.prefix_cache_gb * 2**30)
    config = ServerConfig(args.method, args.k, args.max_batch, args.max_queue, args.served_model_name,
                          args.model, args.drafter, args.ngram, limits, args.adaptive,
                          tool_call_parser=parser, api_key=args.api_key,
                          prefix_store_bytes=store)
    app, worker = build_server(lambda: load_model(args.model, args.dtype, args.max_seq_len, log=log), config)
    drafting = "no drafts"
    if args.method != "none":
        verification = "adaptive verification" if args.adaptive else "fixed K"
        drafting = f"K={worker.engine.config.num_speculative_tokens}, {verification}"
    if not worker.engine.exact:
        log(f"{args.model}: not exact here (pass shapes round differently): drafts may change greedy answers")
    tools = f", tool calls read as {parser}" if parser else ""
    key = ", API key required" if args.api_key else ""
    log(f"serving {args.model} with method {args.method} ({drafting}{tools}{key}{_store_words(worker.engine)}) "
        f"on http://{args.host}:{port}")
    # What start-up built (torch, the model, the server) lives as long as the process: kept out of the cyclic
    # collector's full collections, which scanned it all on the engine thread (0.1-0.2 s pauses, several a
    # minute, measured at 4 users on SmolLM2)
    gc.freeze()
    try:
        # keep-alive well past the 5 s an httpx client (the openai SDK's) keeps an idle connection: a server
        # that closes first can close one just as the client sends a call on it
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S))
        server.run(sockets=[listening])
    finally:
        worker.stop()


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (port 0: a free one), or a CliError that says why not."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listening = socket.socket(family, socket.SOCK_STREAM)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
        listening.listen(2048)
    except OSError as error:
        raise CliError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return listening


def _store_words(engine) -> str:
    cache = engine.prefix_cache
    if cache.store is not None:
        return f", prefix store {cache.store.budget_bytes / 2**30:.1f} GiB"
    return f", no prefix store ({cache.store_off_reason})" if cache.store_off_reason else ""


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {"generate": cmd_generate, "serve": cmd_serve}
