"""Trained drafters: `specstand train-data`, `train`, `eval-drafter`, and `export`/`import` in other formats."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specstand.cli.common import DTYPE_CHOICES, DTYPE_HELP, CliError, finite_float, log
from specstand.drafters.registry import training_free_methods

if TYPE_CHECKING:
    from specstand.training.data import PartialRows, TrainRow
    from specstand.workloads import Turn

RECORDED_MODEL_HELP = "the target (default: the one the data or drafter were made with; smollm2-135m for new data)"
# train's numeric options: name, type, default, help
TRAIN_OPTIONS = [
    ("steps", int, 500, "optimizer steps"),
    ("lr", finite_float, 1e-3, "peak learning rate (linear warm-up, then linear decay)"),
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
    ("selector-alpha", finite_float, 1.0, "dflash2: weight of the ranker's loss beside the unary one"),
]


def add_parsers(commands: argparse._SubParsersAction) -> None:
    _add_train_data_parser(commands)
    _add_train_parser(commands)
    _add_eval_parser(commands)
    _add_format_parsers(commands)


def _add_train_data_parser(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("train-data", help="the target answers a workload's calls: drafter training rows")
    data.add_argument("--model", default=None,
                      help="the target (default: the one a resumed --out was started with, else smollm2-135m)")
    data.add_argument("--workload", type=Path, action="append", required=True, help="workload JSONL (repeatable)")
    data.add_argument("--out", type=Path, required=True, help="folder of the rows (a partial run there resumes)")
    data.add_argument("--heldout", type=finite_float, default=0.15, help="share of turns held out for evaluation")
    data.add_argument("--limit-calls", type=int, default=None, help="answer at most this many calls")
    data.add_argument("--temperature", type=finite_float, default=0.0, help="0: greedy answers")
    data.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    data.add_argument("--samples", type=int, default=1, help="answers per call (needs --temperature > 0)")
    data.add_argument("--method", default="suffix", choices=training_free_methods(),
                      help="training-free drafter that speeds answering up (lossless: the answers do not change)")
    data.add_argument("--k", type=int, default=5, help="draft tokens verified per pass")
    data.add_argument("--endpoint", default=None, metavar="URL",
                      help="take the answers from this OpenAI-compatible server (vLLM, SGLang, specstand) instead")
    data.add_argument("--max-batch", type=int, default=4, help="calls answered together")
    data.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    data.add_argument("--max-seq-len", type=int, default=2048, help="context (cache capacity) per call")


def _add_train_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train", help="online distillation of a drafter from the frozen target")
    train.add_argument("--method", required=True,
                       help="eagle3, mtp, dflash, dspark or dflash2; several (a,b) share one pass of the target "
                            "over the data")
    train.add_argument("--model", default=None, help=RECORDED_MODEL_HELP)
    train.add_argument("--data", type=Path, action="append", required=True,
                       help="a `train-data` folder (repeatable: their rows are trained on together)")
    train.add_argument("--data-fraction", type=finite_float, default=1.0,
                       help="train on this share of the training turns (stable and nested, for data-size curves)")
    train.add_argument("--out", type=Path, required=True,
                       help="checkpoint folder, resumed when it holds one (several methods: OUT/<method>)")
    train.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    for name, kind, default, text in TRAIN_OPTIONS:
        train.add_argument(f"--{name}", type=kind, default=default, help=text)
    train.add_argument("--position-weighting", choices=["dpace", "exp"], default="",
                       help="block methods' loss weight per draft position (default: dspark exp(-k/4), others D-PACE)")
    train.add_argument("--no-confidence-head", action="store_true", help="dspark without its confidence head")


def _add_eval_parser(commands: argparse._SubParsersAction) -> None:
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


def _add_format_parsers(commands: argparse._SubParsersAction) -> None:
    """`export` and `import`: a trained drafter to and from other formats."""
    export = commands.add_parser("export", help="write a trained drafter in another format")
    export.add_argument("--format", choices=["speculators"], default="speculators", help="the format to write")
    export.add_argument("--model", default=None,
                        help="the target (for its head rows): the one it was trained for, the default")
    export.add_argument("drafter", type=Path, help="the trained drafter's folder")
    export.add_argument("out", type=Path, help="folder to write")

    imp = commands.add_parser("import", help="read a drafter written in another format")
    imp.add_argument("--format", choices=["speculators", "dflash-zlab"], default="speculators",
                     help="the format to read")
    imp.add_argument("--model", default=None, help="the target it drafts for; default: the verifier it names")
    imp.add_argument("source", type=Path, help="the drafter's folder in that format")
    imp.add_argument("out", type=Path, help="folder of the specstand drafter to write")


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
    from specstand.training.data import EndpointError, generate_rows
    from specstand.verification import SamplingParams

    _check_train_data_args(args)
    args.model = _recorded_target(args.model, _data_models([args.out]))  # a resumed run keeps its target
    turns = _turns_to_answer(args.workload, args.limit_calls)
    model = load_model(args.model, args.dtype, args.max_seq_len, log=log)
    sampling = SamplingParams(args.temperature, seed=args.seed)
    partial = _partial_rows(args, turns, model.max_positions)
    drafter = make_drafter(args.method, tokenizer=model.tokenizer)
    started = time.perf_counter()
    try:
        rows = generate_rows(model, turns, args.heldout, sampling, args.max_batch, model.max_positions, drafter,
                             args.k, args.samples, partial, args.endpoint)
    except (EndpointError, httpx.HTTPError) as error:
        raise CliError(f"the endpoint failed ({error}); the answers so far are kept: rerun to resume") from None
    finally:
        partial.close()
    _save_train_data(args, turns, rows, partial, started)


def _check_train_data_args(args: argparse.Namespace) -> None:
    if not 0 <= args.heldout < 1:
        raise CliError("--heldout must be in [0, 1)")
    if args.samples < 1 or (args.samples > 1 and args.temperature == 0):
        raise CliError("--samples must be >= 1, and above 1 only with --temperature > 0")
    if args.k < 1:
        raise CliError("--k must be >= 1")


def _turns_to_answer(workloads: list[Path], limit_calls: int | None) -> list[Turn]:
    """The workloads' turns, as many whole ones as fit in `limit_calls`, so the split by turn stays clean."""
    from specstand.workloads import load_workload

    turns, seen = [], {}
    for path in workloads:
        for turn in load_workload(path):
            if turn.turn_id in seen:  # its rows would be answered twice, and a resumed run would keep one
                raise CliError(f"turn {turn.turn_id!r} is in {seen[turn.turn_id]} and in {path}: "
                               "turn ids must be unique across --workload files")
            seen[turn.turn_id] = path
            turns.append(turn)
    if limit_calls is not None:
        kept, count = [], 0
        for turn in turns:
            if count + len(turn.calls) > limit_calls:
                break
            kept.append(turn)
            count += len(turn.calls)
        turns = kept
    if not turns:
        raise CliError("no call to answer (raise --limit-calls)")
    return turns


def _partial_rows(args: argparse.Namespace, turns: list[Turn], max_seq_len: int) -> PartialRows:
    """The answers a previous run of the same settings left in --out (none for a new run)."""
    from specstand.training.data import PartialRows

    # what decides the rows: a resumed run must have the same, or its partial rows would mix two runs
    calls = hashlib.sha256(json.dumps([[t.turn_id, c.id] for t in turns for c in t.calls]).encode()).hexdigest()
    config = {"model": args.model, "dtype": args.dtype, "calls": calls, "temperature": args.temperature,
              "seed": args.seed, "samples": args.samples, "heldout_share": args.heldout,
              "max_seq_len": max_seq_len}
    try:
        partial = PartialRows(args.out, config)
    except ValueError as error:
        raise CliError(str(error)) from None
    if partial.rows:
        log(f"resuming: {len(partial.rows)} answers already in {partial.path}")
    return partial


def _save_train_data(args: argparse.Namespace, turns: list[Turn], rows: list[TrainRow], partial: PartialRows,
                     started: float) -> None:
    """The rows and their metadata, in place of the partial ones, and the held-out turns as a workload."""
    from specstand.training.data import HELDOUT_WORKLOAD, heldout_turn, save_rows
    from specstand.workloads import save_workload

    meta = {"model": args.model, "dtype": args.dtype, "workloads": [str(p) for p in args.workload],
            "sources": sorted({turn.source for turn in turns if turn.source}),
            "temperature": args.temperature, "samples": args.samples, "heldout_share": args.heldout,
            "drafter": args.method, "endpoint": args.endpoint, "seconds": round(time.perf_counter() - started)}
    save_rows(args.out, rows, meta)
    partial.path.unlink()
    heldout = [t for t in turns if heldout_turn(t.turn_id, args.heldout)]
    save_workload(heldout, args.out / HELDOUT_WORKLOAD)
    log(f"wrote {len(rows)} rows ({sum(r.split == 'heldout' for r in rows)} held out) to {args.out}; "
        + (f"the held-out turns, to bench on: {args.out / HELDOUT_WORKLOAD}" if heldout else
           f"no turn was held out ({len(turns)} turns at --heldout {args.heldout}): eval-drafter and the held-out "
           "bench need more turns or a larger --heldout"))


def cmd_train(args: argparse.Namespace) -> None:
    from specstand.models import load_model
    from specstand.training import distributed
    from specstand.training.config import TrainConfig
    from specstand.training.features import TargetFeatures
    from specstand.training.trainer import tap_layers_for, train

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
    model = load_model(args.model, args.dtype, configs[0].max_len, log=log)
    taps = [t for c in configs for t in tap_layers_for(c, model.decoder.shape.num_layers)]
    features = TargetFeatures(model.decoder, taps, min(configs[0].max_len, model.max_positions))
    world = distributed.start()  # a world of one unless launched by torchrun
    try:
        for config in configs:
            train(config, model, log=log, features=features, world=world)
            if world.main:
                log(f"{config.method} drafter written to {config.out}")
    finally:
        distributed.stop(world)


def cmd_eval_drafter(args: argparse.Namespace) -> None:
    from specstand.drafters.trained import read_spec
    from specstand.files import write_text_atomic
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
    model = load_model(args.model, args.dtype, 2048, log=log)
    figures = evaluate_drafter(model, args.drafter, heldout, ks, model.max_positions, log=log)
    if args.json:
        write_text_atomic(args.json, json.dumps({"drafter": str(args.drafter), "method": spec.method,
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
    args.model = _recorded_target(args.model, [(spec.target, str(args.drafter))])
    model = load_model(args.model, "bf16", 2048, log=log)
    export_speculators(args.drafter, model, args.out)
    log(f"wrote {args.out / 'config.json'} and {args.out / 'model.safetensors'} (speculators {spec.method})")


def cmd_import(args: argparse.Namespace) -> None:
    from specstand.interop.speculators import import_dflash_zlab, import_speculators

    reader = import_speculators if args.format == "speculators" else import_dflash_zlab
    spec = reader(args.source, args.out, args.model)
    log(f"wrote a specstand {spec.method} drafter for {spec.target} to {args.out}")


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "train-data": cmd_train_data, "train": cmd_train, "eval-drafter": cmd_eval_drafter, "export": cmd_export,
    "import": cmd_import,
}
