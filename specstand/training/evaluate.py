"""`specstand eval-drafter`: the figures the engine reports online, on held-out calls, before deploying.

The held-out calls run through the engine itself (greedy, one request at a time) at each K, so acceptance
per position and tau (over ALL target passes) are exactly what serving would see on those calls. Costs
are measured on this machine: one plain target step, one verify pass of K+1 rows, and the drafter's own
time per proposal; the predicted speedup is seed 000's claim 3, tau * T_step / (T_verify(K+1) + T_draft),
printed next to the measured one (wall time of the plain engine over the drafted one, same calls). A
drafter with a confidence head (DSpark) also gets its calibration: per draft position, the mean predicted
acceptance beside the observed one (positions judged only, i.e. every earlier one accepted).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specstand.drafters import Draft, Drafter, SequenceView, make_drafter
from specstand.drafters.trained import read_drafter, read_spec
from specstand.engine import DecodeStats, Engine, EngineConfig, Request
from specstand.engine.adaptive import sigmoid
from specstand.files import write_text_atomic
from specstand.models import LoadedModel
from specstand.runner import PassInput, TargetRunner
from specstand.training.data import TrainRow


@dataclass
class KEvaluation:
    k: int
    calls: int
    tokens: int
    tau: float  # emitted tokens per target pass, all passes
    tau_per_draft: float  # vLLM's figure
    acceptance_per_position: list[float]
    step_ms: float  # one plain target pass (1 row)
    verify_ms: float  # one target pass of K+1 rows
    draft_ms: float  # the drafter, per proposal
    predicted_speedup: float
    measured_speedup: float
    identical: bool  # every answer equals plain greedy decoding
    calibration: list[tuple[float, float]] | None = None  # per position: (predicted, observed) acceptance
    # per position: the 95% Wilson interval of its acceptance (drafts that reached it are the trials)
    acceptance_interval: list[tuple[float, float]] | None = None


def wilson_interval(accepted: int, drafted: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (honest at small counts and near 0 or 1)."""
    if drafted == 0:
        return 0.0, 1.0
    p = accepted / drafted
    scale = 1 + z * z / drafted
    center = (p + z * z / (2 * drafted)) / scale
    half = z * math.sqrt(p * (1 - p) / drafted + z * z / (4 * drafted * drafted)) / scale
    return max(0.0, center - half), min(1.0, center + half)


class _TimedDrafter(Drafter):
    """Wraps a drafter to time its own work (propose and the hidden-state bookkeeping in extend)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.tap_layers = inner.tap_layers
        self.seconds = 0.0
        self.proposals = 0
        self._drafts: dict[int, Draft] = {}  # request -> its last calibrated draft, until its outcome comes
        self.judged: list[tuple[int, float, bool]] = []  # (position, predicted, accepted)

    def begin(self, seq: SequenceView) -> None:
        self.inner.begin(seq)

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        started = time.perf_counter()
        draft = self.inner.propose(seq, max_tokens)
        self.seconds += time.perf_counter() - started
        self.proposals += 1
        if draft.calibrated and draft.tokens:
            self._drafts[seq.request_id] = draft
        return draft

    def extend(self, seq: SequenceView, new_tokens: list[int], hidden=None) -> None:
        draft = self._drafts.pop(seq.request_id, None)
        if draft is not None:  # greedy: the accepted drafts, then the target's own token
            accepted = len(new_tokens) - 1
            for i in range(min(len(draft.tokens), accepted + 1)):
                self.judged.append((i, float(sigmoid(draft.confidence[i])), i < accepted))
        started = time.perf_counter()
        self.inner.extend(seq, new_tokens, hidden)
        if seq.output_ids != new_tokens:  # the prompt's rows are prefill work, not per-step work
            self.seconds += time.perf_counter() - started

    def end(self, seq: SequenceView) -> None:
        self.inner.end(seq)


@torch.inference_mode()
def pass_ms(model: LoadedModel, rows: int, context: int, repeats: int = 7) -> float:
    """Median time of one target pass of `rows` rows at position `context` (bf16 decode weights)."""
    runner = TargetRunner(model.decoder, 1, context + 64)
    runner.cache.allocate(0)
    times = []
    for _ in range(repeats):
        runner.cache.set_length_for_timing(0, context)
        started = time.perf_counter()
        runner.run([PassInput(0, [1] * rows)], rows)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def _run(model: LoadedModel, drafter: Drafter | None, k: int, requests: list[Request], max_len: int):
    engine = Engine(model.decoder, drafter, EngineConfig(k, max_len, 1))
    started = time.perf_counter()
    results = [engine.generate([r])[0] for r in requests]
    return results, time.perf_counter() - started


def evaluate_drafter(model: LoadedModel, drafter_path: Path, rows: list[TrainRow], ks: list[int],
                     max_len: int, log=print) -> list[KEvaluation]:
    spec = read_spec(drafter_path)
    requests = [Request(r.prompt_ids, max(len(r.response_ids), 1), stop_token_ids=model.stop_token_ids)
                for r in rows if len(r.prompt_ids) + len(r.response_ids) + max(ks) + 8 < max_len]
    if not requests:
        raise ValueError("no held-out call fits the context")
    plain, plain_s = _run(model, None, 0, requests, max_len)
    context = int(statistics.median(len(r.prompt_ids) for r in requests))
    step_ms = pass_ms(model, 1, context)
    log(f"plain: {sum(len(p.output_ids) for p in plain)} tokens in {plain_s:.1f}s; one step {step_ms:.1f} ms")
    figures = []
    for k in ks:
        timed = _TimedDrafter(make_drafter(spec.method, model.decoder, drafter_path=drafter_path))
        results, seconds = _run(model, timed, k, requests, max_len)
        stats = DecodeStats()
        for result in results:
            stats.merge(result.stats)
        verify_ms = pass_ms(model, k + 1, context)
        draft_ms = timed.seconds / max(timed.proposals, 1) * 1000
        figure = KEvaluation(
            k=k, calls=len(results), tokens=stats.emitted_tokens, tau=round(stats.tau, 3),
            tau_per_draft=round(stats.tau_per_draft, 3),
            acceptance_per_position=[round(a, 3) for a in stats.acceptance_per_position],
            step_ms=round(step_ms, 2), verify_ms=round(verify_ms, 2), draft_ms=round(draft_ms, 2),
            predicted_speedup=round(stats.tau * step_ms / (verify_ms + draft_ms), 3),
            measured_speedup=round(plain_s / seconds, 3),
            identical=all(a.output_ids == b.output_ids for a, b in zip(results, plain, strict=True)),
            calibration=calibration(timed.judged) or None,
            acceptance_interval=[tuple(round(x, 3) for x in wilson_interval(a, d)) for a, d in
                                 zip(stats.accepted_per_position, stats.drafted_per_position, strict=True)],
        )
        intervals = " ".join(f"{a}[{lo}-{hi}]" for a, (lo, hi) in
                             zip(figure.acceptance_per_position, figure.acceptance_interval, strict=True))
        log(f"K={k}: tau {figure.tau} (vLLM-style {figure.tau_per_draft}), acceptance per position with its 95% "
            f"interval {intervals}, verify {verify_ms:.1f} ms, draft {draft_ms:.1f} ms, "
            f"predicted x{figure.predicted_speedup}, measured x{figure.measured_speedup}, identical {figure.identical}")
        if figure.calibration:
            log(f"K={k}: confidence head, predicted vs observed acceptance per position: "
                + ", ".join(f"{p:.2f}/{o:.2f}" for p, o in figure.calibration))
        figures.append(figure)
    return figures


def calibration(judged: list[tuple[int, float, bool]]) -> list[tuple[float, float]]:
    """(mean predicted, observed) acceptance per draft position from (position, predicted, accepted)."""
    out = []
    for position in range(max((j[0] for j in judged), default=-1) + 1):
        at = [(p, a) for i, p, a in judged if i == position]
        out.append((round(statistics.fmean(p for p, _ in at), 3), round(statistics.fmean(a for _, a in at), 3)))
    return out


def as_dicts(figures: list[KEvaluation]) -> list[dict]:
    return [asdict(f) for f in figures]


def _data_sources(data: dict) -> str:
    """Where the answered calls came from (complexfuncbench, nestful, ...): the turns' own sources, or, for
    data written before they were recorded (or of turns that name none), the workload files' names."""
    return ", ".join(data.get("sources") or [Path(w).stem for w in data.get("workloads", [])])


def write_card(folder: Path, figures: list[KEvaluation], command: str) -> None:
    """The drafter's model card (README.md next to its weights): shapes, data, training, held-out figures."""
    spec, tensors = read_drafter(folder)
    trained = dict(spec.trained)
    data = trained.pop("data", {})
    size_mb = (folder / "model.safetensors").stat().st_size / 1e6
    lines = [
        f"# {spec.method} drafter for {spec.target}",
        "",
        f"- Shapes: {spec.num_layers} layer(s), hidden {spec.hidden_size}, heads {spec.num_heads}/{spec.num_kv_heads}"
        f" (q/kv), MLP {spec.intermediate_size}, draft vocabulary {spec.draft_vocab_size} of {spec.target_vocab_size}"
        f", target layers read {spec.tap_layers} (HF hidden_states index)"
        + (f", block {spec.block_size}" if spec.block_size else f", {spec.train_steps} training-time-test steps")
        + (f", Markov rank {spec.markov_rank}, confidence head {'on' if spec.enable_confidence_head else 'off'}"
           if spec.method == "dspark" else "")
        + (f", {spec.conv_kernel_size}-tap convolutions, selector rank {spec.selector_rank} over the top "
           f"{spec.selector_top_k}" if spec.method == "dflash2" else ""),
        f"- Weights: {sum(t.numel() for k, t in tensors.items() if k != 'd2t') / 1e6:.1f} M parameters, bf16,"
        f" {size_mb:.1f} MB (the target's embedding and head are borrowed, not stored)",
        f"- Data: the target's own {data.get('temperature', 0) and 'sampled' or 'greedy'} answers to"
        f" {data.get('rows', '?')} calls of {_data_sources(data)}"
        f" ({data.get('response_tokens', '?')} response tokens; {data.get('heldout_rows', '?')} calls of held-out"
        f" turns kept apart), target dtype {data.get('dtype', '?')}",
        f"- Training: {trained.get('steps', '?')} steps on {trained.get('train_rows', '?')} rows,"
        f" {trained.get('seconds', '?')} s on this machine's CPU",
        "",
        f"Held-out calls, greedy, through the engine (`{command}`):",
        "",
        "| K | tau (all passes) | tau (vLLM-style) | acceptance per position | predicted speedup | measured |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {f.k} | {f.tau} | {f.tau_per_draft} | {' '.join(str(a) for a in f.acceptance_per_position)} | "
              f"x{f.predicted_speedup} | x{f.measured_speedup} |" for f in figures]
    calibrated = [f for f in figures if f.calibration]
    if calibrated:
        f = calibrated[-1]
        lines += ["", f"Confidence head at K={f.k}, predicted / observed acceptance per position: "
                  + ", ".join(f"{p} / {o}" for p, o in f.calibration)]
    write_text_atomic(folder / "README.md", "\n".join(lines) + "\n")
