"""What each replay run says in numbers: turn times, tau, drafting, answers judged against the baseline's, and
where the run's time went (from the server's /metrics deltas). report.py turns these into tables and plots.

Answers are judged (broken JSON, broken tool calls, identical or not) by answers.py.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from specstand.bench.answers import answer_is_broken, answer_is_judged, answer_key
from specstand.bench.replay import CallRecord, TurnRecord
from specstand.server.metrics import PHASES
from specstand.workloads import Call, Turn


@dataclass
class RunResult:
    target: str
    users: int
    repeat: int
    wall_s: float
    turns: list[TurnRecord]
    metrics_delta: dict[str, float] = field(default_factory=dict)
    warm: str = "none"  # what the server held cached when the run began (bench.run.WARM_STATES)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunResult:
        turns = [TurnRecord(t["turn_id"], t["user"], t["start"], t["end"], [CallRecord(**c) for c in t["calls"]])
                 for t in data["turns"]]
        return cls(data["target"], data["users"], data["repeat"], data["wall_s"], turns, data["metrics_delta"],
                   data.get("warm", "none"))


def time_breakdown(m: dict[str, float]) -> dict:
    """What a run's metrics say of where its time went: the engine's seconds by phase (specstand), prompt
    tokens computed and reused (vLLM's prefix-cache counters, which specstand exports too), and the mean
    time a call waited for a slot. Absent figures are None (a server that does not export them)."""
    phases = {p: m.get(f"specstand:engine_seconds_total[phase={p}]") for p in PHASES}
    prompt = m.get("vllm:prompt_tokens_total")
    hits = m.get("vllm:prefix_cache_hits_total")
    queued = m.get("vllm:request_queue_time_seconds_count")
    engine_s = {p: v or 0.0 for p, v in phases.items()} if any(v is not None for v in phases.values()) else None
    return {
        "engine_s": engine_s,
        "decode_share": _decode_share(engine_s),
        "prompt_tokens_computed": prompt - hits if prompt is not None and hits is not None else None,
        "prompt_tokens_reused": hits,
        "prompt_tokens_from_store": m.get("specstand:prefix_store_hits_total"),
        "queue_s_per_call": m["vllm:request_queue_time_seconds_sum"] / queued if queued else None,
    }


def _decode_share(engine_s: dict[str, float] | None) -> float | None:
    """Decode/verify passes' share of the engine's busy time (idle left out): with a share s, a run whose
    decode/verify passes took no time at all would be 1 / (1 - s) times faster. On plain decoding's run that is
    the most any drafter can gain at that load; prompts, which no drafter shortens, take the rest."""
    if not engine_s:
        return None
    busy = sum(seconds for phase, seconds in engine_s.items() if phase != "idle")
    return engine_s.get("decode", 0.0) / busy if busy > 0 else None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_summary(run: RunResult, calls: dict[tuple[str, str], Call], baseline_answers: dict[tuple[str, str], tuple]
                ) -> dict:
    """`baseline_answers`: the baseline's answer_key per (turn, call)."""
    turn_times = [t.duration for t in run.turns if not t.failed]
    records = [c for t in run.turns for c in t.calls]
    ok = [c for c in records if not c.error]
    expected_json = [c for c in ok if answer_is_judged(c, calls[(c.turn_id, c.call_id)])]
    # an answer cut by max_tokens says nothing about the engine: count it apart from broken JSON
    truncated = [c for c in expected_json if c.finish_reason == "length"]
    finished = [c for c in expected_json if c.finish_reason != "length"]
    broken = sum(answer_is_broken(c, calls[(c.turn_id, c.call_id)]) for c in finished)
    compared = [c for c in ok if (c.turn_id, c.call_id) in baseline_answers]
    identical = sum(answer_key(c) == baseline_answers[(c.turn_id, c.call_id)] for c in compared)
    m = run.metrics_delta
    return {
        "turn_p50_s": percentile(turn_times, 0.5),
        # beside the p50: agent turns come in sizes (2 calls, 3 calls ...), and with a few turns the median
        # can fall in the gap between two sizes, where a small shift moves it a lot
        "turn_mean_s": statistics.mean(turn_times) if turn_times else None,
        "turn_p90_s": percentile(turn_times, 0.9),
        "turns_per_s": len(turn_times) / run.wall_s if run.wall_s else 0.0,
        "call_p50_s": percentile([c.latency for c in ok], 0.5),
        "output_tokens_per_s": sum(c.completion_tokens for c in ok) / run.wall_s if run.wall_s else 0.0,
        **drafting(m),
        "broken_json": broken / len(finished) if finished else None,
        "truncated_json": len(truncated) / len(expected_json) if expected_json else None,
        "identical": identical / len(compared) if compared else None,
        "failed_calls": len(records) - len(ok),
        "calls": len(records),
        **time_breakdown(m),
    }


def drafting(m: dict[str, float]) -> dict:
    """What a run's metrics say of its drafting: tau over all passes and vLLM's per draft; how often the method
    drafted (passes that verified a draft, steps its drafter ran, and of those the probes adaptive verification
    found slower than plain decoding, each per target pass); the decode speedup its own figures predict; and
    acceptance per draft position. None (or []) where the server does not export them."""
    passes = m.get("specstand:target_passes_total", 0.0)
    drafts = m.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = m.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    accepted_at = {int(k.split("[")[1][:-1]): v for k, v in m.items()
                   if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total[")}
    per_position = [accepted_at.get(i, 0.0) for i in range(max(accepted_at, default=-1) + 1)]
    return {
        "tau": m.get("specstand:emitted_tokens_total", 0.0) / passes if passes else None,
        "tau_per_draft_vllm": 1 + accepted / drafts if drafts else None,
        "drafted_passes": drafts / passes if passes else None,
        "drafter_runs": m.get("specstand:drafter_runs_total", 0.0) / passes if passes else None,
        "probes": m.get("specstand:probes_total", 0.0) / passes if passes else None,
        "predicted_speedup": _predicted_speedup(m),
        "acceptance_per_position": [v / drafts for v in per_position] if drafts else [],
    }


def mean_acceptance_curve(curves: list[list[float]]) -> list[float]:
    """Runs' acceptance per position, averaged: a position a run's list does not reach counts as 0 there (no
    draft of that run was accepted that deep; a server exports only the positions it has counted), not as
    missing, which would average the deep positions over the runs that did best."""
    depth = max((len(c) for c in curves), default=0)
    return [statistics.mean(c[i] if i < len(c) else 0.0 for c in curves) for i in range(depth)]


def _predicted_speedup(m: dict[str, float]) -> float | None:
    """Decode speedup over plain decoding that the run's own figures predict: tau x T(1 row) / (mean pass
    cost + draft time per pass), passes with a draft costing a full verify (K + 1 rows, profiled by the
    server at start) and the others one row. None where the server does not report these (not specstand)."""
    passes = m.get("specstand:target_passes_total", 0.0)
    profiled = {int(k.split("[rows=")[1][:-1]): v for k, v in m.items()
                if k.startswith("specstand:pass_seconds_profiled[rows=")}
    if not passes or not profiled:
        return None
    step, verify = profiled[min(profiled)], profiled[max(profiled)]
    drafted = m.get("vllm:spec_decode_num_drafts_total", 0.0)
    mean_pass = (drafted * verify + (passes - drafted) * step) / passes
    tau = m.get("specstand:emitted_tokens_total", 0.0) / passes
    return tau * step / (mean_pass + m.get("specstand:draft_seconds_total", 0.0) / passes)


def summarize(runs: list[RunResult], turns: list[Turn], baseline: str) -> dict:
    """Per target and U: the list of per-repeat summaries."""
    calls = {(t.turn_id, c.id): c for t in turns for c in t.calls}
    base_runs = sorted((r for r in runs if r.target == baseline), key=lambda r: (r.repeat, r.users))
    baseline_answers = {}
    if base_runs:
        baseline_answers = {(c.turn_id, c.call_id): answer_key(c) for t in base_runs[0].turns for c in t.calls
                            if not c.error}
    out: dict[str, dict[int, list[dict]]] = {}
    for run in runs:
        out.setdefault(run.target, {}).setdefault(run.users, []).append(run_summary(run, calls, baseline_answers))
    return out


def values_of(summaries: list[dict], key: str) -> list[float]:
    """`key` of every run summary that has it."""
    return [s[key] for s in summaries if s.get(key) is not None]


def spread_of(values: list[float]) -> tuple[float, float, float] | None:
    """Median, min and max."""
    return (statistics.median(values), min(values), max(values)) if values else None
