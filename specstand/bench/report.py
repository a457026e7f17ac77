"""Aggregate replay runs into the report: report.json (raw), report.md (the table), PNG plots.

One table per warm state, methods as columns (as the stand the project grew from laid it out): rows K, turn
p50 and mean per U (median over repeats with its [min-max] spread) and their speedups over the baseline,
turns/s, tau over all passes and vLLM's per-draft tau, drafting shares, broken JSON, identical answers, and
where each run's time went (engine phases, prompt tokens computed and reused, waits for a slot). A method
whose spread overlaps the baseline's is marked "≈": the difference is inside the noise. The numbers of each
run come from summary.py.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from specstand.bench.summary import PHASES, RunResult, mean_acceptance_curve, spread_of, summarize, values_of
from specstand.files import write_atomic, write_text_atomic
from specstand.workloads import Turn

# below this many repeats a [min-max] spread has missed host drift between server processes: on 2-core
# hosts, 2-repeat differences of x0.78-0.92 read x1.00 with 4-5 repeats (benchmarks/results/stand/README.md)
CALLING_REPEATS = 4


def _fmt_pct(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):.1f}%" if values else "–"


def _turn_time_rows(summary: dict, targets: list[str], baseline: str, u: int, key: str, label: str) -> list[str]:
    """Two rows at U=u: each target's time (median over repeats [min-max]) and its speedup over the
    baseline; ≈ where the two ranges overlap."""
    base = spread_of(values_of(summary.get(baseline, {}).get(u, []), key))
    cells, speedups = [], []
    for t in targets:
        spread = spread_of(values_of(summary.get(t, {}).get(u, []), key))
        if spread is None:
            cells.append("–")
            speedups.append("–")
            continue
        equal = t != baseline and base is not None and spread[1] <= base[2] and base[1] <= spread[2]
        cells.append(f"{spread[0]:.2f} [{spread[1]:.2f}–{spread[2]:.2f}]{' ≈' if equal else ''}")
        speedups.append(f"x{base[0] / spread[0]:.2f}{' ≈' if equal else ''}" if base else "–")
    return [f"| {label}, U={u} (s) | " + " | ".join(cells) + " |",
            f"| speedup vs {baseline} ({label}), U={u} | " + " | ".join(speedups) + " |"]


def render_markdown(summary: dict, targets: list[str], users: list[int], baseline: str, k_by_target: dict) -> str:
    top = max(users)
    header = "| | " + " | ".join(targets) + " |\n|---|" + "---|" * len(targets) + "\n"
    rows = ["| K | " + " | ".join(str(k_by_target.get(t, "–")) for t in targets) + " |"]
    for u in users:
        rows += _turn_time_rows(summary, targets, baseline, u, "turn_p50_s", "turn p50")
        rows += _turn_time_rows(summary, targets, baseline, u, "turn_mean_s", "turn mean")
    for label, key, users_for in (
        (f"turns/s, U={top}", "turns_per_s", [top]),
        (f"turn p90, U={users[0]} (s)", "turn_p90_s", [users[0]]),
        (f"call p50, U={top} (s)", "call_p50_s", [top]),
        (f"output tokens/s, U={top}", "output_tokens_per_s", [top]),
    ):
        cells = []
        for t in targets:
            spread = spread_of([v for u in users_for for v in values_of(summary.get(t, {}).get(u, []), key)])
            cells.append(f"{spread[0]:.2f}" if spread else "–")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, key, fmt in (
        ("tau (all passes)", "tau", "{:.2f}"),
        ("tau per draft (vLLM: 1+accepted/drafts)", "tau_per_draft_vllm", "{:.2f}"),
        ("predicted decode speedup: tau x T(1) / (pass + draft)", "predicted_speedup", "x{:.2f}"),
    ):
        cells = []
        for t in targets:
            values = [v for u in users for v in values_of(summary.get(t, {}).get(u, []), key)]
            cells.append(fmt.format(statistics.median(values)) if values else "–")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, key in (("passes that verified a draft", "drafted_passes"),
                       ("drafter runs (per pass)", "drafter_runs"), ("probes that did not pay (per pass)", "probes"),
                       ("broken JSON (finished answers)", "broken_json"),
                       ("JSON answers cut by max_tokens", "truncated_json"), (f"identical to {baseline}", "identical")):
        shares = [[v for u in users for v in values_of(summary.get(t, {}).get(u, []), key)] for t in targets]
        rows.append(f"| {label} | " + " | ".join(_fmt_pct(values) for values in shares) + " |")
    rows += _drafting_by_run_rows(summary, targets, users)
    failed = [sum(s["failed_calls"] for u in users for s in summary.get(t, {}).get(u, [])) for t in targets]
    rows.append("| failed calls | " + " | ".join(str(f) for f in failed) + " |")
    for u in users:
        rows += _breakdown_rows(summary, targets, u)
    return header + "\n".join(rows) + "\n"


def _drafting_by_run_rows(summary: dict, targets: list[str], users: list[int]) -> list[str]:
    """Each run's share of passes that verified a draft, in the order the runs ran, where any target drafted: a
    server keeps adaptive verification's estimates across runs, so repeats that drafted unalike show here."""
    rows = []
    for u in users:
        shares = [values_of(summary.get(t, {}).get(u, []), "drafted_passes") for t in targets]
        if any(v > 0 for runs in shares for v in runs):
            rows.append(f"| passes that verified a draft, run by run, U={u} | " + " | ".join(
                " / ".join(f"{100 * v:.0f}%" for v in runs) if runs else "–" for runs in shares) + " |")
    return rows


def _breakdown_rows(summary: dict, targets: list[str], u: int) -> list[str]:
    """Where a run's time went at U=u (medians over repeats): the engine's seconds by phase, the share of its
    decode/verify passes (and what the run would gain without them), prompt tokens computed + reused, and the
    wait for a slot."""
    def cells(value) -> str:
        return " | ".join(value(summary.get(t, {}).get(u, [])) for t in targets)

    def phases(runs: list[dict]) -> str:
        found = [r["engine_s"] for r in runs if r.get("engine_s")]
        if not found:
            return "–"
        return " / ".join(f"{statistics.median(f.get(p) or 0.0 for f in found):.1f}" for p in PHASES)

    def tokens(runs: list[dict]) -> str:
        computed = values_of(runs, "prompt_tokens_computed")
        reused = values_of(runs, "prompt_tokens_reused")
        if not computed:
            return "–"
        stored = values_of(runs, "prompt_tokens_from_store")
        store = f" ({statistics.median(stored):.0f} from the store)" if stored else ""
        return f"{statistics.median(computed):.0f} + {statistics.median(reused):.0f}{store}"

    def ceiling(runs: list[dict]) -> str:
        shares = values_of(runs, "decode_share")
        if not shares:
            return "–"
        share = statistics.median(shares)
        return f"{100 * share:.0f}% (x{1 / (1 - share):.2f})" if share < 1 else f"{100 * share:.0f}%"

    def queue(runs: list[dict]) -> str:
        waits = values_of(runs, "queue_s_per_call")
        return f"{statistics.median(waits):.2f}" if waits else "–"

    return [f"| run seconds: {' / '.join(PHASES)}, U={u} | " + cells(phases) + " |",
            f"| decode/verify passes' share of engine time (x: the run if they took none), U={u} | "
            + cells(ceiling) + " |",
            f"| prompt tokens computed + reused, U={u} | " + cells(tokens) + " |",
            f"| wait for a slot per call (s), U={u} | " + cells(queue) + " |"]


def write_plots(summary: dict, targets: list[str], users: list[int], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in targets:
        curves = [s["acceptance_per_position"] for u in users for s in summary.get(t, {}).get(u, [])
                  if s["acceptance_per_position"]]
        if curves:
            mean = mean_acceptance_curve(curves)
            ax.plot(range(1, len(mean) + 1), mean, marker="o", label=t)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title("Acceptance per position")
    ax.set_ylim(0, 1)
    if ax.lines:
        ax.legend()
    paths.append(_save(fig, out_dir / "acceptance_per_position.png"))
    paths.append(_latency_plot(plt, summary, targets, users, out_dir))
    breakdown = _breakdown_plot(plt, summary, targets, users, out_dir)
    return paths + ([breakdown] if breakdown else [])


def _breakdown_plot(plt, summary: dict, targets: list[str], users: list[int], out_dir: Path) -> Path | None:
    """A stacked bar per target and U: the run's seconds by engine phase (median over repeats); None where
    no target reported them."""
    bars = []
    for u in users:
        for t in targets:
            found = [r["engine_s"] for r in summary.get(t, {}).get(u, []) if r.get("engine_s")]
            if found:
                bars.append((f"{t}\nU={u}", [statistics.median(f.get(p) or 0.0 for f in found) for p in PHASES]))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(bars)), 4))
    bottoms = [0.0] * len(bars)
    for i, phase in enumerate(PHASES):
        heights = [seconds[i] for _, seconds in bars]
        ax.bar([label for label, _ in bars], heights, bottom=bottoms, label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_ylabel("seconds of the run")
    ax.set_title("Where a run's time went (engine thread)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    return _save(fig, out_dir / "time_breakdown.png")


def _latency_plot(plt, summary: dict, targets: list[str], users: list[int], out_dir: Path) -> Path:
    """Turn p50 by method: lines over the user counts, or bars (median, min-max whiskers) for a single one."""
    fig, ax = plt.subplots(figsize=(6, 4))
    if len(users) == 1:
        spreads = [(t, spread_of(values_of(summary.get(t, {}).get(users[0], []), "turn_p50_s"))) for t in targets]
        spreads = [(t, s) for t, s in spreads if s is not None]
        ax.bar([t for t, _ in spreads], [s[0] for _, s in spreads],
               yerr=[[s[0] - s[1] for _, s in spreads], [s[2] - s[0] for _, s in spreads]], capsize=4)
        ax.set_ylabel("turn p50 (s)")
        ax.set_title(f"Turn latency, {users[0]} user{'s' if users[0] > 1 else ''}")
        ax.tick_params(axis="x", labelrotation=30)
        return _save(fig, out_dir / "turn_p50.png")
    for t in targets:
        medians = {u: values_of(summary.get(t, {}).get(u, []), "turn_p50_s") for u in users}
        points = [(u, statistics.median(v)) for u, v in medians.items() if v]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=t)
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("turn p50 (s)")
    ax.set_title("Turn latency under load")
    if ax.lines:
        ax.legend()
    return _save(fig, out_dir / "turn_p50_vs_users.png")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
    return path


# what each warm state means, as the report says it
WARM_WORDS = {
    "system": "each run began with the workload's shared heads (system prompt and tool definitions) cached, as on "
              "a server that has served the same agent before; never the turns' own calls or answers",
    "none": "each run began with nothing cached (cold): every tool definition is computed at a turn's first call",
}


def write_report(out_dir: Path, config: dict, runs: list[RunResult], turns: list[Turn], targets: list[str],
                 users: list[int], baseline: str, k_by_target: dict, complete: bool,
                 warm_states: tuple[str, ...] = ("none",)) -> str:
    """Write report.json, report.md and plots atomically (a table and plots per warm state, the first one's
    plots unsuffixed); returns the markdown tables."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = {warm: summarize([r for r in runs if r.warm == warm], turns, baseline) for warm in warm_states}
    sections = []
    for warm, summary in summaries.items():
        table = render_markdown(summary, targets, users, baseline, k_by_target)
        heading = f"## Warm: {warm}\n\n{WARM_WORDS.get(warm, warm).capitalize()}.\n\n" if len(warm_states) > 1 else ""
        sections.append(heading + table)
    tables = "\n".join(sections)
    raw = {"config": config, "complete": complete, "summary": summaries[warm_states[0]],
           "summary_by_warm": summaries, "runs": [r.to_dict() for r in runs]}
    write_text_atomic(out_dir / "report.json", json.dumps(raw, indent=1))
    status = "" if complete else "\n**Partial report**: the run was interrupted or is still going.\n"
    state = f"\nWarm state: {WARM_WORDS.get(warm_states[0], warm_states[0])}.\n" if len(warm_states) == 1 else ""
    md = (f"# specstand bench\n\nWorkload `{config.get('workload')}`, {len(turns)} turns, users {users}, "
          f"{config.get('repeats')} repeats (runs interleaved). Times are medians over repeats with "
          f"[min–max]; ≈ marks a difference inside the spread. Run seconds by phase are the engine thread's "
          f"(specstand servers): prompt and decode/verify passes, drafting, other engine work, idle.\n"
          f"{_repeats_line(config)}{_machine_line(config.get('machine'))}{_reset_line(config)}"
          f"{_stagger_line(config)}{state}{status}\n{tables}")
    write_text_atomic(out_dir / "report.md", md)
    for index, (warm, summary) in enumerate(summaries.items()):
        if any(r.warm == warm for r in runs):
            write_plots(summary, targets, users, out_dir if index == 0 else out_dir / f"warm_{warm}")
    return tables


def _reset_line(config: dict) -> str:
    """Which targets started every run with nothing cached (reports written before the reset have none)."""
    resets, restarted = config.get("prefix_cache_reset_per_run"), config.get("restarted_per_run") or []
    if not resets:
        return ""
    kept = [name for name, reset in resets.items() if not reset and name not in restarted]
    line = "\nEach run started with the server's prompt cache and drafter memory reset"
    line += f" ({', '.join(restarted)}: the server restarted, having no /reset_prefix_cache route)" if restarted else ""
    line += f", except on {', '.join(kept)} (no /reset_prefix_cache route)." if kept else "."
    if config.get("settled_on_first_turn"):
        line += (" Before the first run each target served the workload's first turn once, not recorded: first-call"
                 " costs stay out, and adaptive verification, whose estimates outlive the reset, starts settled.")
    return line + "\n"


def _repeats_line(config: dict) -> str:
    """A caution where the spread comes from too few runs to bound a difference."""
    repeats = config.get("repeats") or 0
    if repeats >= CALLING_REPEATS:
        return ""
    return (f"\nWith {repeats} repeat{'s' if repeats != 1 else ''} the [min–max] spread may understate how far runs "
            f"of one target differ (separate server processes doing the same work have differed by more); rerun a "
            f"difference without ≈ with --repeats {CALLING_REPEATS} or more before calling it.\n")


def _stagger_line(config: dict) -> str:
    stagger = config.get("stagger_s") or 0
    if not stagger:
        return "\nUsers started their turns together.\n" if "stagger_s" in config else ""
    return (f"\nUser u started {stagger:g} s x u into each run: the load ramped from 1 to U users over the first "
            f"(U - 1) x {stagger:g} s.\n")


def _machine_line(machine: dict | None) -> str:
    """The bench machine as one line of the report (reports written before it was recorded have none)."""
    if not machine:
        return ""
    bandwidth = f"read bandwidth {machine['read_gbs_start']} GB/s at the start"
    if "read_gbs_end" in machine:
        bandwidth += f", {machine['read_gbs_end']} at the end"
    return (f"\nMachine: {machine['cpu']}, {machine['cpus']} cpus; flags {' '.join(machine['flags']) or 'none'}; "
            f"kernel path of specstand's targets here: {machine['kernel_path']}; {bandwidth}.\n")

