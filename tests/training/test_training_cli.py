"""The training commands end to end on the tiny model: train-data -> train -> eval-drafter -> export ->
import -> generate with the drafter; and one readable line on bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specstand.cli import main
from specstand.workloads import save_workload
from tests.conftest import KERNEL_PATHS, tiny_turns


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_train_evaluate_export_import_and_generate(capsys, tiny_model_dir, tmp_path):
    workload = tmp_path / "w.jsonl"
    save_workload([replace(turn, source="tinybench") for turn in tiny_turns(12)], workload)
    data, drafters = tmp_path / "data", tmp_path / "drafters"
    model = ("--model", str(tiny_model_dir), "--dtype", "fp32")
    assert _run(capsys, "train-data", *model, "--workload", str(workload), "--out", str(data),
                "--heldout", "0.3")[0] == 0
    assert (data / "heldout.jsonl").is_file() and json.loads((data / "meta.json").read_text())["rows"] == 12
    code, _, err = _run(capsys, "train", "--method", "dflash,eagle3", *model, "--data", str(data),
                        "--out", str(drafters), "--steps", "4", "--pack-tokens", "256", "--draft-vocab", "64")
    assert code == 0, err
    code, out, err = _run(capsys, "eval-drafter", *model, "--drafter", str(drafters / "dflash"), "--data", str(data),
                          "--k", "2,3", "--write-card", "--json", str(tmp_path / "eval.json"))
    assert code == 0, err
    figures = json.loads((tmp_path / "eval.json").read_text())["figures"]
    assert [f["k"] for f in figures] == [2, 3] and all(f["identical"] for f in figures)
    for f in figures:  # each position's acceptance inside its 95% interval
        assert all(lo <= a <= hi for a, (lo, hi) in zip(f["acceptance_per_position"], f["acceptance_interval"],
                                                        strict=True))
    card = (drafters / "dflash" / "README.md").read_text()
    assert "| 3 |" in out and "Held-out calls" in card
    assert "answers to 12 calls of tinybench (" in card  # the turns' source, not the workload file's name
    # DSpark trained with its own options; its evaluation prints the confidence head's calibration
    code, _, err = _run(capsys, "train", "--method", "dspark", *model, "--data", str(data), "--out",
                        str(drafters / "dspark"), "--steps", "4", "--pack-tokens", "256", "--draft-vocab", "64",
                        "--markov-rank", "16", "--block-size", "4")
    assert code == 0, err
    code, out, err = _run(capsys, "eval-drafter", *model, "--drafter", str(drafters / "dspark"), "--data", str(data),
                          "--k", "4", "--json", str(tmp_path / "dspark.json"))
    assert code == 0, err
    (figure,) = json.loads((tmp_path / "dspark.json").read_text())["figures"]
    assert figure["identical"] and figure["calibration"] and all(0 < p < 1 for p, _ in figure["calibration"])
    assert "predicted vs observed acceptance per position" in err + out
    assert _run(capsys, "export", "--model", str(tiny_model_dir), str(drafters / "eagle3"), str(tmp_path / "x"))[0] == 0
    assert _run(capsys, "import", str(tmp_path / "x"), str(tmp_path / "back"))[0] == 0
    code, out, _ = _run(capsys, "generate", *model, "--method", "eagle3", "--drafter", str(tmp_path / "back"),
                        "--prompt", "w3 w4 w5 w3 w4", "--max-tokens", "8", "--json")
    plain = _run(capsys, "generate", *model, "--prompt", "w3 w4 w5 w3 w4", "--max-tokens", "8", "--json")[1]
    assert code == 0 and json.loads(out)["token_ids"] == json.loads(plain)["token_ids"]


def test_training_commands_fail_in_one_line(capsys, tiny_model_dir, tmp_path):
    cases = [
        ("train", "--method", "medusa", "--model", str(tiny_model_dir), "--data", str(tmp_path), "--out", "o"),
        ("train", "--method", "dflash", "--model", str(tiny_model_dir), "--data", str(tmp_path), "--out", "o"),
        ("eval-drafter", "--model", str(tiny_model_dir), "--drafter", str(tmp_path), "--data", str(tmp_path)),
        ("generate", "--model", str(tiny_model_dir), "--method", "dflash", "--prompt", "w3"),
        ("export", str(tmp_path), str(tmp_path / "x")),
    ]
    for argv in cases:
        code, _, err = _run(capsys, *argv)
        assert code != 0, argv
        assert len(err.strip().splitlines()) == 1 and err.startswith("specstand: error: "), (argv, err)


@pytest.mark.skipif(not KERNEL_PATHS, reason="q8_0 runs on the kernels, which do not build here")
def test_q8_0_target_answers_trains_and_evaluates(capsys, tiny_model_dir, tmp_path):
    """Data, training and evaluation on a Q8_0 target: its own answers, its own hidden states, and the
    trained drafter's answers identical to plain decoding on it."""
    workload = tmp_path / "w.jsonl"
    save_workload(tiny_turns(8), workload)
    model = ("--model", str(tiny_model_dir), "--dtype", "q8_0")
    assert _run(capsys, "train-data", *model, "--workload", str(workload), "--out", str(tmp_path / "data"),
                "--heldout", "0.3")[0] == 0
    code, _, err = _run(capsys, "train-data", *model, "--workload", str(workload), "--out", str(tmp_path / "all"),
                        "--heldout", "0")
    assert code == 0 and "no turn was held out (8 turns at --heldout 0.0)" in err  # not a path to an empty file
    code, _, err = _run(capsys, "train", "--method", "eagle3", *model, "--data", str(tmp_path / "data"), "--out",
                        str(tmp_path / "eagle3"), "--steps", "2", "--pack-tokens", "256", "--draft-vocab", "64")
    assert code == 0, err
    code, _, err = _run(capsys, "eval-drafter", *model, "--drafter", str(tmp_path / "eagle3"), "--data",
                        str(tmp_path / "data"), "--k", "3", "--json", str(tmp_path / "eval.json"))
    assert code == 0, err
    assert all(f["identical"] for f in json.loads((tmp_path / "eval.json").read_text())["figures"])


class _Loaded(Exception):
    """Raised by a stand-in for load_model: which model a command would load, without loading it."""


def _target_of(capsys, monkeypatch, *argv: str) -> tuple[str | None, int, str]:
    import specstand.models

    def load(model, *_, **__):
        raise _Loaded(model)

    monkeypatch.setattr(specstand.models, "load_model", load)
    try:
        code, _, err = _run(capsys, *argv)
    except _Loaded as loaded:
        return str(loaded), 0, ""
    return None, code, err


def test_training_commands_take_the_recorded_target_and_refuse_another(capsys, monkeypatch, tiny_model_dir, tiny_data,
                                                                       trained, tmp_path):
    workload = tmp_path / "w.jsonl"
    save_workload(tiny_turns(2), workload)
    drafter = trained["dflash", 1]
    capsys.readouterr()  # the training's progress bars
    heldout = tmp_path / "heldout"  # the same answers, all held out
    heldout.mkdir()
    (heldout / "meta.json").write_text((tiny_data / "meta.json").read_text())
    rows = [json.loads(line) for line in (tiny_data / "rows.jsonl").read_text().splitlines()]
    (heldout / "rows.jsonl").write_text("".join(json.dumps({**r, "split": "heldout"}) + "\n" for r in rows))
    commands = [("train", "--method", "dflash", "--data", str(tiny_data), "--out", str(tmp_path / "d")),
                ("eval-drafter", "--drafter", str(drafter), "--data", str(heldout)),
                ("export", str(drafter), str(tmp_path / "exported")),
                ("train-data", "--workload", str(workload), "--out", str(tiny_data))]  # resumes: keeps its target
    for argv in commands:
        assert _target_of(capsys, monkeypatch, *argv)[0] == str(tiny_model_dir), argv
        assert _target_of(capsys, monkeypatch, *argv, "--model", str(tiny_model_dir))[0] == str(tiny_model_dir)
        loaded, code, err = _target_of(capsys, monkeypatch, *argv, "--model", "smollm2-135m")
        assert loaded is None and code == 2 and len(err.strip().splitlines()) == 1, argv
        assert "--model smollm2-135m" in err and str(tiny_model_dir) in err
    # new data: --model, or the default model
    fresh = ("train-data", "--workload", str(workload), "--out", str(tmp_path / "new"))
    assert _target_of(capsys, monkeypatch, *fresh)[0] == "smollm2-135m"
    assert _target_of(capsys, monkeypatch, *fresh, "--model", "qwen2.5-coder-0.5b")[0] == "qwen2.5-coder-0.5b"


def test_data_of_two_targets_is_refused(capsys, monkeypatch, tiny_data, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "meta.json").write_text(json.dumps({"model": "smollm2-135m"}))
    loaded, code, err = _target_of(capsys, monkeypatch, "train", "--method", "dflash", "--data", str(tiny_data),
                                   "--data", str(other), "--out", str(tmp_path / "d"))
    assert loaded is None and code == 2 and "smollm2-135m" in err and "was made with" in err
