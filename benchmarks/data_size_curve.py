"""Held-out tau against the amount of training data: each method trained on nested shares of the training
turns (`--fractions`, the same steps each, so a larger share means more distinct rows, not more compute),
one pass of the target over the rows shared by every run, and each drafter evaluated through the engine on
the held-out calls of every `--eval` set (greedy, one call at a time, tau over all target passes).

An `--eval` set the training folders do not include measures generalisation: traffic of another source.

    python benchmarks/data_size_curve.py --model qwen2.5-coder-0.5b --methods dflash \\
        --train out/data12/cfb --eval cfb=out/data12/cfb --eval nestful=out/data12/nestful \\
        --fractions 0.25,0.5,1 --steps 400 --k 7 --limit 12 --work out/curve \\
        --out benchmarks/results/training/data_size_curve_qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from printed import Printed

from specstand import kernels
from specstand.drafters.trained import read_spec
from specstand.models import load_model
from specstand.training.config import TrainConfig
from specstand.training.data import load_datasets
from specstand.training.evaluate import evaluate_drafter
from specstand.training.features import TargetFeatures
from specstand.training.trainer import tap_layers_for, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--methods", default="dflash", help="trained at every fraction")
    parser.add_argument("--full-only", default="", help="methods trained on all the data only (to compare with)")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=FOLDER",
                        help="an already trained drafter evaluated the same way, e.g. a shipped one (repeatable)")
    parser.add_argument("--train", type=Path, action="append", required=True, help="train-data folder (repeatable)")
    parser.add_argument("--eval", action="append", required=True, metavar="NAME=FOLDER",
                        help="held-out rows of this train-data folder (repeatable)")
    parser.add_argument("--fractions", default="0.25,0.5,1")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--limit", type=int, default=12, help="held-out calls per eval set")
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--draft-vocab", type=int, default=6144)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, required=True, help="checkpoints (a rerun resumes them)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say = Printed()
    methods = args.methods.split(",")
    fractions = [float(f) for f in args.fractions.split(",")]
    full_only = [m for m in args.full_only.split(",") if m]
    runs = [(m, f) for f in fractions for m in methods] + [(m, 1.0) for m in full_only]
    evals = {name: Path(folder) for name, _, folder in (e.partition("=") for e in args.eval)}

    model = load_model(args.model, args.dtype, 2048, log=lambda _: None)
    _, rows = load_datasets(args.train)
    say(f"# {args.model} {args.dtype}: {', '.join(methods)} trained {args.steps} steps on {fractions} of the "
        f"training turns of {', '.join(map(str, args.train))} ({sum(r.split == 'train' for r in rows)} rows)"
        + (f"; {', '.join(full_only)} on all of them" if full_only else ""))
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {kernels.best_path()}; "
        f"{args.threads} threads")

    def config(method: str, fraction: float) -> TrainConfig:
        return TrainConfig(method, [str(t) for t in args.train], str(args.work / f"{method}-{fraction:g}"),
                           steps=args.steps, data_fraction=fraction, save_every=100,
                           intermediate_size=args.intermediate_size, draft_vocab_size=args.draft_vocab)

    taps = [t for m, _ in runs for t in tap_layers_for(config(m, 1.0), model.decoder.shape.num_layers)]
    features = TargetFeatures(model.decoder, taps, model.max_positions)
    heldout = {name: [r for r in load_datasets([folder])[1] if r.split == "heldout"][: args.limit]
               for name, folder in evals.items()}
    results: list[dict] = []

    def evaluate(label: str, folder: Path, fraction: float | None, rows_used, trained_s: float) -> None:
        for name, calls in heldout.items():
            (figure,) = evaluate_drafter(model, folder, calls, [args.k], model.max_positions, log=lambda _: None)
            results.append({"drafter": label, "fraction": fraction, "train_rows": rows_used, "eval": name,
                            "calls": figure.calls, "k": args.k, "tau": figure.tau,
                            "acceptance_per_position": figure.acceptance_per_position,
                            "identical": figure.identical, "train_s": round(trained_s, 1)})
            say(f"{label} ({rows_used} rows, {trained_s:.0f} s of training in this run): {name} held-out tau "
                f"{figure.tau} at K={args.k} over {figure.calls} calls, acceptance per position "
                f"{' '.join(str(a) for a in figure.acceptance_per_position)}, identical {figure.identical}")
            _write(args.out, results, say)

    for name, folder in (c.partition("=")[::2] for c in args.compare):
        evaluate(name, Path(folder), None, read_spec(Path(folder)).trained.get("train_rows", "?"), 0.0)
    for method, fraction in runs:
        cfg = config(method, fraction)
        started = time.perf_counter()
        train(cfg, model, log=lambda _: None, features=features)
        rows_used = read_spec(Path(cfg.out)).trained["train_rows"]
        evaluate(f"{method} {fraction:g}", Path(cfg.out), fraction, rows_used, time.perf_counter() - started)
    say()
    say("| drafter | share of training turns | rows | " + " | ".join(f"tau {name}" for name in evals) + " |")
    say("|---|---|---|" + "---|" * len(evals))
    for label in dict.fromkeys(r["drafter"] for r in results):
        at = {r["eval"]: r for r in results if r["drafter"] == label}
        first = next(iter(at.values()))
        say(f"| {label} | {first['fraction'] if first['fraction'] is not None else '-'} | {first['train_rows']} | "
            + " | ".join(str(at[name]["tau"]) for name in evals) + " |")
    _write(args.out, results, say)
    _plot(args.out / "tau_vs_data.png", [r for r in results if r["fraction"] is not None], list(evals), args.k)


def _write(out: Path, results: list[dict], say: Printed) -> None:
    """Both files renamed into place: a crash leaves the last whole version."""
    out.mkdir(parents=True, exist_ok=True)
    (out / ".results.json.tmp").write_text(json.dumps(results, indent=1) + "\n")
    say.write(out / ".results.txt.tmp")
    for name in ("results.json", "results.txt"):
        os.replace(out / f".{name}.tmp", out / name)


def _plot(path: Path, results: list[dict], evals: list[str], k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["drafter"].split()[0] for r in results):
        for name in evals:
            points = sorted((r["train_rows"], r["tau"]) for r in results
                            if r["drafter"].split()[0] == method and r["eval"] == name)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{method}, {name} held-out")
    ax.set(xlabel="training rows (agent calls)", ylabel=f"tau at K={k} (all target passes)", xscale="log",
           title="held-out tau against training data")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
