"""The flags that pick a target and its drafting (generate, serve), and vLLM's --speculative-config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specstand.cli.common import AUTO_DTYPE_HELP, DTYPE_CHOICES, CliError
from specstand.drafters import method_names, trained_drafter_path
from specstand.drafters.registry import method_help, trained_methods, vllm_methods


def parse_dtype(text: str) -> str:
    from specstand.models.loading import ModelError, resolve_dtype

    try:
        return resolve_dtype(text)
    except ModelError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_target_args(parser: argparse.ArgumentParser, vllm_spellings: bool = False) -> None:
    """The target's flags; with `vllm_spellings` (serve) vLLM's names and dtype spellings are taken too."""
    parser.add_argument("--model", default="smollm2-135m", help="preset name, model folder or hub id")
    parser.add_argument("--method", default="none", help=f"none (plain decoding) or {method_help()}")
    parser.add_argument("--k", type=int, default=None,
                        help="most draft tokens verified per pass (default 5; DFlash: block size - 1)")
    parser.add_argument("--drafter", type=Path, default=None, help="trained drafter folder (default: shipped one)")
    if vllm_spellings:
        parser.add_argument("--dtype", default="auto", type=parse_dtype,
                            help=AUTO_DTYPE_HELP + "; or vLLM's bfloat16, float32")
    else:
        parser.add_argument("--dtype", default="auto", choices=[*DTYPE_CHOICES, "auto"], help=AUTO_DTYPE_HELP)
    parser.add_argument("--max-seq-len", *(["--max-model-len"] if vllm_spellings else []), dest="max_seq_len",
                        type=int, default=2048, help="context (cache capacity) per request")
    parser.add_argument("--speculative-config", default=None,
                        help="vLLM's JSON instead of --method/--k/--drafter: method (ngram, suffix, schema, eagle3, "
                             "dflash, mtp), model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
                             "adaptive")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                        help="verify only the draft tokens expected to pay for their rows (load-aware, lossless; "
                             "the default); --no-adaptive verifies every draft at fixed K")


def apply_speculative_config(args: argparse.Namespace) -> None:
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
    method, known_methods = config.get("method"), vllm_methods()
    if method not in known_methods:
        raise CliError(f"--speculative-config: method {method!r} is not one of {', '.join(known_methods)}")
    args.method = known_methods[method]
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


def check_target_args(args: argparse.Namespace) -> None:
    apply_speculative_config(args)
    if args.method not in method_names():
        raise CliError(f"unknown method {args.method!r} (choose from {', '.join(method_names())})")
    if args.k is not None and args.k < 0:
        raise CliError("--k must be >= 0")
    if args.drafter is not None and not args.drafter.is_dir():
        raise CliError(f"--drafter {args.drafter} is not a folder")
    if args.method in trained_methods():
        trained_drafter_path(args.method, args.model, args.drafter)  # said before the model loads
