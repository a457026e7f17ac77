import json
from dataclasses import replace

import pytest

from specstand.bench.replay import CallRecord, TurnRecord
from specstand.bench.report import render_markdown, write_report
from specstand.bench.summary import RunResult, drafting, mean_acceptance_curve, percentile, summarize
from specstand.workloads import Call, Turn


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0], 0.9) == 1.9
    assert percentile([], 0.5) is None


def test_acceptance_per_position_counts_a_position_a_run_never_reached_as_zero():
    # a server exports only the positions it counted: this run's drafts never got an acceptance at position 1
    m = {"vllm:spec_decode_num_drafts_total": 4, "vllm:spec_decode_num_accepted_tokens_per_pos_total[0]": 2,
         "vllm:spec_decode_num_accepted_tokens_per_pos_total[2]": 1}
    assert drafting(m)["acceptance_per_position"] == [0.5, 0.0, 0.25]
    # one run reached position 3 with 0.4; the other's list ends at 2: its 0 there counts in the mean
    assert mean_acceptance_curve([[0.8, 0.6, 0.4], [0.6, 0.2]]) == pytest.approx([0.7, 0.4, 0.2])
    assert mean_acceptance_curve([]) == []


def _run(target, users, repeat, turn_time, texts, metrics=None):
    turns = []
    for i, text in enumerate(texts):
        calls = [CallRecord(f"t{i}", "a", "s", 0.0, turn_time, text, 4, "length" if text == "cut" else "stop")]
        turns.append(TurnRecord(f"t{i}", 0, 0.0, turn_time, calls))
    return RunResult(target, users, repeat, turn_time * len(texts), turns, metrics or {})


def test_table_marks_differences_inside_the_spread(tmp_path):
    workload = [Turn(f"t{i}", [Call(id="a", prompt="p", expect_json=True)]) for i in range(2)]
    metrics = {"specstand:target_passes_total": 10, "specstand:emitted_tokens_total": 25,
               "vllm:spec_decode_num_drafts_total": 8, "vllm:spec_decode_num_accepted_tokens_total": 10,
               "vllm:spec_decode_num_accepted_tokens_per_pos_total[0]": 6,
               "vllm:spec_decode_num_accepted_tokens_per_pos_total[1]": 4}
    runs = [
        _run("none", 1, 0, 1.00, ['{"a": 1}', "oops"]), _run("none", 1, 1, 1.10, ['{"a": 1}', "oops"]),
        _run("fast", 1, 0, 0.50, ['{"a": 1}', "oops"], metrics),
        _run("fast", 1, 1, 0.52, ['{"a": 1}', "oops"], metrics),
        _run("same", 1, 0, 1.05, ['{"a": 1}', "different"]), _run("same", 1, 1, 1.20, ['{"a": 1}', "oops"]),
    ]
    summary = summarize(runs, workload, "none")
    fast = summary["fast"][1][0]
    # tau over all passes (25 tokens / 10 passes) and vLLM's per-draft figure (1 + 10 accepted / 8 drafts)
    # differ here, so a report that swapped them would fail
    assert fast["tau"] == 2.5 and fast["tau_per_draft_vllm"] == 2.25
    assert fast["acceptance_per_position"] == [0.75, 0.5]
    assert fast["broken_json"] == 0.5 and fast["identical"] == 1.0
    assert summary["same"][1][0]["identical"] == 0.5
    table = render_markdown(summary, ["none", "fast", "same"], [1], "none", {"fast": 5})
    row = next(line for line in table.splitlines() if line.startswith("| turn p50, U=1"))
    cells = [c.strip() for c in row.split("|")[2:-1]]
    assert cells[0].startswith("1.05") and not cells[0].endswith("≈")
    assert cells[1].startswith("0.51") and not cells[1].endswith("≈")  # faster, outside the spread
    assert cells[2].endswith("≈")  # inside the baseline's spread
    assert "| broken JSON (finished answers) | 50.0% | 50.0% | 50.0% |" in table
    cut = summarize([_run("none", 1, 0, 1.0, ['{"a": 1}', "cut"])], workload, "none")["none"][1][0]
    assert cut["broken_json"] == 0.0 and cut["truncated_json"] == 0.5
    machine = {"cpu": "Some CPU", "cpus": 2, "flags": ["avx2", "fma"], "kernel_path": "avx2", "read_gbs_start": 31.2,
               "read_gbs_end": 29.8}
    config = {"workload": "w", "repeats": 2, "machine": machine}
    write_report(tmp_path, config, runs, workload, ["none", "fast", "same"], [1], "none", {}, complete=True)
    assert ("Machine: Some CPU, 2 cpus; flags avx2 fma; kernel path of specstand's targets here: avx2; read bandwidth "
            "31.2 GB/s at the start, 29.8 at the end.") in (tmp_path / "report.md").read_text()
    assert "With 2 repeats the [min–max] spread may understate" in (tmp_path / "report.md").read_text()
    raw = json.loads((tmp_path / "report.json").read_text())
    assert raw["complete"] and len(raw["runs"]) == 6
    assert RunResult.from_dict(raw["runs"][2]).turns[0].calls[0].text == '{"a": 1}'
    assert (tmp_path / "acceptance_per_position.png").stat().st_size > 0
    # one user count: bars per method, not a line over one point
    assert (tmp_path / "turn_p50.png").stat().st_size > 0 and not (tmp_path / "turn_p50_vs_users.png").exists()
    two = [*runs, _run("none", 4, 0, 2.0, ['{"a": 1}', "oops"]), _run("fast", 4, 0, 1.0, ['{"a": 1}', "oops"])]
    write_report(tmp_path / "two", {"workload": "w", "repeats": 1}, two, workload, ["none", "fast"], [1, 4], "none",
                 {}, complete=True)
    assert (tmp_path / "two" / "turn_p50_vs_users.png").stat().st_size > 0
    write_report(tmp_path / "four", {"workload": "w", "repeats": 4}, runs, workload, ["none", "fast"], [1], "none", {},
                 complete=True)
    assert "may understate" not in (tmp_path / "four" / "report.md").read_text()  # enough repeats: no caution


def test_each_runs_drafting_is_listed_in_the_order_the_runs_ran():
    """A server keeps adaptive verification's estimates across runs: a first run that drafted less than the
    others shows in its own cell, not only in the median."""
    workload = [Turn("t0", [Call(id="a", prompt="p")])]

    def drafted(drafts: int) -> dict:
        return {"specstand:target_passes_total": 10, "specstand:emitted_tokens_total": 10 + drafts,
                "vllm:spec_decode_num_drafts_total": drafts}

    runs = [_run("none", 1, 0, 1.0, ["x"]), _run("none", 1, 1, 1.0, ["x"]),
            _run("suffix", 1, 0, 1.0, ["x"], drafted(3)), _run("suffix", 1, 1, 1.0, ["x"], drafted(7))]
    table = render_markdown(summarize(runs, workload, "none"), ["none", "suffix"], [1], "none", {})
    assert "| passes that verified a draft, run by run, U=1 | – | 30% / 70% |" in table
    quiet = [_run("none", 1, 0, 1.0, ["x"], drafted(0)), _run("peer", 1, 0, 1.0, ["x"])]
    assert "run by run" not in render_markdown(summarize(quiet, workload, "none"), ["none", "peer"], [1], "none", {})


def test_predicted_speedup_from_acceptance_and_profiled_costs():
    workload = [Turn("t0", [Call(id="a", prompt="p")])]
    # 10 passes, 8 with a draft (verify 0.012 s), 2 without (step 0.010 s), 0.01 s drafting in all, tau 2.5:
    # 2.5 x 0.010 / ((8 x 0.012 + 2 x 0.010) / 10 + 0.001) = 0.025 / 0.0126
    metrics = {"specstand:target_passes_total": 10, "specstand:emitted_tokens_total": 25,
               "vllm:spec_decode_num_drafts_total": 8, "specstand:draft_seconds_total": 0.01,
               "specstand:pass_seconds_profiled[rows=1]": 0.010, "specstand:pass_seconds_profiled[rows=6]": 0.012}
    summary = summarize([_run("fast", 1, 0, 1.0, ["x"], metrics), _run("peer", 1, 0, 1.0, ["x"])], workload, "fast")
    assert abs(summary["fast"][1][0]["predicted_speedup"] - 0.025 / 0.0126) < 1e-9
    assert summary["peer"][1][0]["predicted_speedup"] is None  # a server that does not report them
    table = render_markdown(summary, ["fast", "peer"], [1], "fast", {})
    assert "| predicted decode speedup: tau x T(1) / (pass + draft) | x1.98 | – |" in table


def test_the_mean_turn_time_is_reported_beside_the_median():
    # three short turns (1 s) and three long ones (3 s); the other method halves every turn
    workload = [Turn(f"t{i}", [Call(id="a", prompt="p")]) for i in range(6)]

    def run(target, scale):
        turns = [TurnRecord(f"t{i}", 0, 0.0, scale * (1.0 if i < 3 else 3.0),
                            [CallRecord(f"t{i}", "a", "s", 0.0, 1.0, "x", 4, "stop")]) for i in range(6)]
        return RunResult(target, 2, 0, 6.0 * scale, turns, {})

    summary = summarize([run("none", 1.0), run("fast", 0.5)], workload, "none")
    assert summary["none"][2][0]["turn_mean_s"] == 2.0 and summary["fast"][2][0]["turn_mean_s"] == 1.0
    table = render_markdown(summary, ["none", "fast"], [2], "none", {})
    assert "| speedup vs none (turn mean), U=2 | x1.00 | x2.00 |" in table
    assert "| turn mean, U=2 (s) | 2.00 [2.00–2.00] | 1.00 [1.00–1.00] |" in table


def _tool_run(target: str, tool_calls: list[list[dict] | None], text: str = "") -> RunResult:
    turns = [TurnRecord(f"t{i}", 0, 0.0, 1.0, [CallRecord(f"t{i}", "a", "s", 0.0, 1.0, text, 4, "tool_calls", "",
                                                         calls)])
             for i, calls in enumerate(tool_calls)]
    return RunResult(target, 1, 0, 1.0, turns, {})


def test_tool_calls_are_judged_and_compared():
    tools = [{"type": "function", "function": {"name": "find", "parameters": {}}}]
    workload = [Turn(f"t{i}", [Call(id="a", messages=[{"role": "user", "content": "q"}], tools=tools)])
                for i in range(4)]
    good = [{"name": "find", "arguments": '{"city": "Oslo", "n": 2}'}]
    answers = [good, [{"name": "find", "arguments": '{"city": '}], [{"name": "book", "arguments": "{}"}],
               [{"name": "find", "arguments": "[1]"}]]
    summary = summarize([_tool_run("none", answers)], workload, "none")["none"][1][0]
    assert summary["broken_json"] == 0.75 and summary["identical"] == 1.0
    # the same call with its arguments in another key order is identical; another argument value is not
    reordered = [[{"name": "find", "arguments": '{"n": 2, "city": "Oslo"}'}], *answers[1:]]
    changed = [[{"name": "find", "arguments": '{"city": "Bergen", "n": 2}'}], *answers[1:]]
    for other, identical in ((reordered, 1.0), (changed, 0.75)):
        runs = [_tool_run("none", answers), _tool_run("x", other)]
        assert summarize(runs, workload, "none")["x"][1][0]["identical"] == identical
    # the same calls with different text beside them differ; a plain answer without JSON expected is not judged
    runs = [_tool_run("none", answers), _tool_run("x", answers, text="Sure.")]
    assert summarize(runs, workload, "none")["x"][1][0]["identical"] == 0.0
    plain = summarize([_tool_run("none", [None] * 4, text="hello")], workload, "none")["none"][1][0]
    assert plain["broken_json"] is None
    # where the call required a tool call (tool_choice "required" or a named function), a plain answer is broken
    for choice in ("required", {"type": "function", "function": {"name": "find"}}):
        required = [Turn(t.turn_id, [replace(t.calls[0], tool_choice=choice)]) for t in workload]
        judged = summarize([_tool_run("none", [good, None, None, good], text="hello")], required, "none")
        assert judged["none"][1][0]["broken_json"] == 0.5
    # a dict that allows tools without requiring one (OpenAI's allowed_tools, mode auto) leaves text unjudged
    allowed = [Turn(t.turn_id, [replace(t.calls[0], tool_choice={"type": "allowed_tools", "mode": "auto"})])
               for t in workload]
    assert summarize([_tool_run("none", [None] * 4, text="hi")], allowed, "none")["none"][1][0]["broken_json"] is None


def test_the_breakdown_says_how_much_decoding_could_give_at_most():
    """Plain decoding's warm 1-user run in the avx2 demo: 5.3 s of prompt passes, 3.2 s of decode passes, 0.2 s of
    other work (idle left out): decoding is 37% of the engine's time, so a run without it would be x1.58 faster."""
    workload = [Turn("t0", [Call(id="a", prompt="p")])]
    phases = {"prompt": 5.3, "decode": 3.2, "draft": 0.0, "other": 0.2, "idle": 4.0}
    metrics = {f"specstand:engine_seconds_total[phase={phase}]": seconds for phase, seconds in phases.items()}
    summary = summarize([_run("none", 1, 0, 1.0, ["x"], metrics), _run("peer", 1, 0, 1.0, ["x"])], workload, "none")
    assert abs(summary["none"][1][0]["decode_share"] - 3.2 / 8.7) < 1e-12
    assert summary["peer"][1][0]["decode_share"] is None  # a server without the engine's phases
    table = render_markdown(summary, ["none", "peer"], [1], "none", {})
    row = "| decode/verify passes' share of engine time (x: the run if they took none), U=1 | 37% (x1.58) | – |"
    assert row in table
