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
