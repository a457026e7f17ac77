"""The CLI on a tiny local model: real output, and one readable line + non-zero exit on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specstand.cli import main
from tests.conftest import KERNEL_PATHS


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json_with_every_method(capsys, tiny_model_dir):
    outputs = {}
    for method, flags in (("none", []), ("ngram", []), ("suffix", []), ("suffix", ["--adaptive"]), ("schema", [])):
        code, out, _ = _run(capsys, "generate", "--model", str(tiny_model_dir), "--method", method,
                            "--prompt", "w3 w4 w5 w3 w4 w5 w3 w4", "--max-tokens", "12", "--json", *flags)
        assert code == 0
        result = json.loads(out)
        assert {"text", "token_ids", "stats", "tokens_per_second"} <= result.keys()
        assert result["stats"]["tau"] >= 1.0 and result["stats"]["target_passes"] >= 1
        assert result["adaptive"] == bool(flags)
        outputs[method + "".join(flags)] = result["token_ids"]
    assert outputs["ngram"] == outputs["none"] == outputs["suffix"] == outputs["suffix--adaptive"] == outputs["schema"]


@pytest.mark.skipif(not KERNEL_PATHS, reason="q8_0 runs on the kernels, which do not build here")
def test_generate_on_q8_0_weights_is_exact_and_lossless(capsys, tiny_model_dir):
    answers = []
    for method in ("none", "suffix"):
        code, out, _ = _run(capsys, "generate", "--model", str(tiny_model_dir), "--dtype", "q8_0", "--method",
                            method, "--prompt", "w3 w4 w5 w3 w4 w5 w3 w4", "--max-tokens", "12", "--json")
        assert code == 0
        result = json.loads(out)
        assert result["exact"] is True
        answers.append(result["token_ids"])
    assert answers[0] == answers[1]


def test_q8_0_without_the_kernels_is_one_line(capsys, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SPECSTAND_KERNEL_PATH", "python")
    code, out, err = _run(capsys, "generate", "--model", str(tiny_model_dir), "--dtype", "q8_0", "--prompt", "w1")
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "compiled kernels" in err


def test_messages_file_uses_the_chat_template(capsys, tiny_model_dir, tmp_path):
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": "w7 w8 w9"}]))
    code, out, _ = _run(capsys, "generate", "--model", str(tiny_model_dir), "--messages-file", str(messages),
                        "--max-tokens", "4", "--json", "--temperature", "0.8", "--seed", "3")
    assert code == 0
    assert json.loads(out)["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "magic"], "unknown method"),
        (["--k", "-1"], "--k must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens must be > 0"),
        (["--prompt", "  "], "prompt is empty"),
        (["--prompt", " ".join(["w5"] * 3000)], "exceed the context"),
    ],
)
def test_bad_arguments_give_one_line(capsys, tiny_model_dir, extra, message):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "w1 w2", *extra]
    code, out, err = _run(capsys, *argv)
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_unknown_model_and_bad_messages_files(capsys, tiny_model_dir, tmp_path):
    code, _, err = _run(capsys, "generate", "--model", "no-such-model", "--prompt", "hi")
    assert code != 0 and "unknown model" in err and len(err.strip().splitlines()) == 1
    broken = tmp_path / "broken.json"
    broken.write_text("[{not json")
    wrong_shape = tmp_path / "wrong.json"
    wrong_shape.write_text(json.dumps([{"role": "user"}]))
    for path, message in ((tmp_path / "missing.json", "cannot read"), (broken, "not valid JSON"),
                          (wrong_shape, "needs string 'role' and 'content'")):
        code, _, err = _run(capsys, "generate", "--model", str(tiny_model_dir), "--messages-file", str(path))
        assert code != 0 and message in err and len(err.strip().splitlines()) == 1


def test_console_entry_point_has_no_traceback(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "specstand.cli", "generate", "--model", str(tiny_model_dir), "--prompt", "w1",
         "--max-tokens", "-5"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode != 0
    assert done.stderr.strip() == "specstand: error: --max-tokens must be > 0"


def test_workload_import_skips_turns(capsys, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"q{i}"]})
                                   for i in range(5)))
    out = tmp_path / "w.jsonl"
    code, _, _ = _run(capsys, "workload", "import", "spec-bench", "--spec-bench-file", str(questions),
                      "--out", str(out), "--skip", "3", "--limit", "1")
    assert code == 0
    assert [json.loads(line)["turn_id"] for line in out.read_text().splitlines()] == ["spec-bench-3"]
    code, _, err = _run(capsys, "workload", "import", "spec-bench", "--spec-bench-file", str(questions),
                        "--out", str(out), "--skip", "-1")
    assert code != 0 and err.strip() == "specstand: error: --skip must be >= 0"


def test_vllm_speculative_config_stands_for_method_k_and_ngram_sizes(capsys, tiny_model_dir):
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    code, out, _ = _run(capsys, "generate", "--model", str(tiny_model_dir), "--speculative-config", config,
                        "--prompt", "w3 w4 w5 w3 w4 w5 w3 w4", "--max-tokens", "12", "--json")
    assert code == 0
    stats = json.loads(out)["stats"]
    assert stats["passes_with_draft"] > 0 and 0 < len(stats["drafted_per_position"]) <= 3  # K from the config
    code, out, _ = _run(capsys, "generate", "--model", str(tiny_model_dir), "--speculative-config",
                        '{"method": "schema", "num_speculative_tokens": 4}', "--prompt", "w3 w4", "--max-tokens", "4",
                        "--json")
    assert code == 0 and json.loads(out)["method"] == "schema"
    for bad, message in [
        ("{not json", "not valid JSON"),
        ('{"method": "medusa"}', "method 'medusa'"),
        ('{"method": "ngram", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size not supported"),
        ('{"method": "suffix", "prompt_lookup_max": 4}', "belong to method ngram"),
        ('{"method": "ngram", "num_speculative_tokens": "five"}', "must be an integer"),
    ]:
        code, _, err = _run(capsys, "generate", "--model", str(tiny_model_dir), "--speculative-config", bad,
                            "--prompt", "w3")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _run(capsys, "generate", "--model", str(tiny_model_dir), "--speculative-config", config,
                        "--method", "suffix", "--prompt", "w3")
    assert code == 2 and "not both" in err
