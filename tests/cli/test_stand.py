"""The stand's commands: workload import."""

from __future__ import annotations

import json

from tests.cli import run_cli


def test_workload_import_skips_turns(capsys, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"q{i}"]})
                                   for i in range(5)))
    out = tmp_path / "w.jsonl"
    code, _, _ = run_cli(capsys, "workload", "import", "spec-bench", "--spec-bench-file", str(questions),
                      "--out", str(out), "--skip", "3", "--limit", "1")
    assert code == 0
    assert [json.loads(line)["turn_id"] for line in out.read_text().splitlines()] == ["spec-bench-3"]
    code, _, err = run_cli(capsys, "workload", "import", "spec-bench", "--spec-bench-file", str(questions),
                        "--out", str(out), "--skip", "-1")
    assert code != 0 and err.strip() == "specstand: error: --skip must be >= 0"


def test_workload_import_refuses_what_the_bench_would_refuse(capsys, tmp_path):
    questions = tmp_path / "q.jsonl"
    out = tmp_path / "w.jsonl"

    def imported(*rows, extra=()):
        questions.write_text("\n".join(json.dumps(row) for row in rows))
        return run_cli(capsys, "workload", "import", "spec-bench", "--spec-bench-file", str(questions),
                       "--out", str(out), *extra)

    row = {"question_id": 1, "category": "qa", "turns": ["q1"]}
    for value in ("0", "-5"):  # 0 was written as 256
        code, _, err = imported(row, extra=("--max-tokens", value))
        assert code == 2 and err.strip() == "specstand: error: --max-tokens must be >= 1"
    code, _, err = imported(row, row)  # a repeated question id: a workload no bench loads
    assert code == 1 and "duplicate turn_id 'spec-bench-1'" in err and not out.exists()
    code, _, _ = imported({**row, "category": 7})  # a category that is no string is named as one
    assert code == 0 and json.loads(out.read_text())["calls"][0]["stage"] == "7"


def test_record_refuses_a_port_out_of_range(capsys, tmp_path):
    code, _, err = run_cli(capsys, "record", "--upstream", "http://127.0.0.1:1", "--out", str(tmp_path / "r.jsonl"),
                           "--port", "99999")
    assert code == 2 and err.strip() == "specstand: error: --port must be in [0, 65535], not 99999"
