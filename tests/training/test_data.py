"""train-data: answers from the engine (a drafter changes none), a killed run resumes to exactly the rows
of an uninterrupted one, sampled answers included."""

from __future__ import annotations

import json

import pytest

from specstand.cli import main
from specstand.drafters import make_drafter
from specstand.training.data import (
    PARTIAL,
    PartialRows,
    TrainRow,
    generate_rows,
    heldout_turn,
    load_datasets,
    load_rows,
    recorded_model,
    save_rows,
    subset_turn,
)
from specstand.verification import SamplingParams
from specstand.workloads import save_workload
from tests.conftest import tiny_turns

CONFIG = {"run": "test"}


GREEDY = SamplingParams()


def _rows(target, folder, sampling=GREEDY, samples=1, drafter=None):
    partial = PartialRows(folder, CONFIG)
    try:
        return generate_rows(target, tiny_turns(8), 0.25, sampling, 3, 512, drafter, 5, samples, partial)
    finally:
        partial.close()


@pytest.mark.parametrize(("sampling", "samples"), [(SamplingParams(), 1), (SamplingParams(0.8, seed=3), 2)])
def test_a_killed_run_resumes_to_the_rows_of_an_uninterrupted_one(tiny_target, tmp_path, monkeypatch, sampling,
                                                                    samples):
    whole = _rows(tiny_target, tmp_path / "whole", sampling, samples)
    assert len(whole) == 8 * samples and len({r.key for r in whole}) == len(whole)
    appended = []
    real_append = PartialRows.append

    def killed_after_five(self, row):
        if len(appended) == 5:
            raise KeyboardInterrupt  # the run dies with five answers on disk
        appended.append(row)
        real_append(self, row)

    monkeypatch.setattr(PartialRows, "append", killed_after_five)
    with pytest.raises(KeyboardInterrupt):
        _rows(tiny_target, tmp_path / "killed", sampling, samples)
    monkeypatch.setattr(PartialRows, "append", real_append)
    with (tmp_path / "killed" / PARTIAL).open("a") as f:
        f.write('{"turn_id": "t1", "call_')  # and its last write was torn
    reopened = PartialRows(tmp_path / "killed", CONFIG)
    assert len(reopened.rows) == 5  # the torn line dropped, the five whole ones kept
    reopened.close()
    resumed = _rows(tiny_target, tmp_path / "killed", sampling, samples)
    assert resumed == whole


def test_a_drafter_changes_no_answer(tiny_target, tmp_path):
    plain = _rows(tiny_target, tmp_path / "plain")
    drafted = _rows(tiny_target, tmp_path / "drafted", drafter=make_drafter("suffix"))
    assert drafted == plain


def test_schema_drafting_reads_each_calls_tools(tiny_target, tmp_path):
    turns = tiny_turns(2)
    tools = [{"type": "function", "function": {"name": "w5", "parameters": {"type": "object"}}}]
    turns[1].calls[0].tools = tools
    drafter, offered = make_drafter("schema", tokenizer=tiny_target.tokenizer), []
    begin = drafter.begin

    def recording_begin(seq) -> None:
        offered.append(seq.tools)
        begin(seq)

    drafter.begin = recording_begin
    plain = generate_rows(tiny_target, turns, 0.0, GREEDY, 2, 512)
    assert generate_rows(tiny_target, turns, 0.0, GREEDY, 2, 512, drafter, 5) == plain
    assert offered == [None, tools]


def test_resuming_another_configuration_is_refused(tiny_model_dir, tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    save_workload(tiny_turns(4), workload)
    out = tmp_path / "data"
    argv = ["train-data", "--model", str(tiny_model_dir), "--dtype", "fp32", "--workload", str(workload),
            "--out", str(out)]
    PartialRows(out, {"another": "run"}).close()
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "another configuration" in err and len(err.strip().splitlines()) == 1
    (out / PARTIAL).unlink()
    assert main([*argv, "--samples", "2"]) != 0 and "--temperature" in capsys.readouterr().err
    assert main(argv) == 0 and not (out / PARTIAL).exists()
    assert json.loads((out / "meta.json").read_text())["rows"] == 4


def test_answers_from_an_openai_compatible_endpoint_equal_local_ones(tiny_model_dir, tiny_target, tmp_path):
    """specstand's own server as the endpoint (token-id prompts in, token ids out): greedy rows equal the
    rows the engine answers in-process."""
    from tests.server.test_server import LiveServer

    live = LiveServer(tiny_model_dir, dtype="fp32", method="suffix", max_batch=3)
    try:
        turns = tiny_turns(8)
        remote = generate_rows(tiny_target, turns, 0.25, GREEDY, 3, 512, endpoint=live.url)
    finally:
        live.close()
    assert remote == generate_rows(tiny_target, turns, 0.25, GREEDY, 3, 512)



def test_turn_subsets_are_nested_and_apart_from_the_heldout_split():
    ids = [f"turn-{i}" for i in range(4000)]
    quarter, half = ({t for t in ids if subset_turn(t, f)} for f in (0.25, 0.5))
    assert quarter < half and all(subset_turn(t, 1.0) for t in ids)
    assert abs(len(quarter) / len(ids) - 0.25) < 0.03 and abs(len(half) / len(ids) - 0.5) < 0.03
    heldout = {t for t in ids if heldout_turn(t, 0.15)}
    # another salt: the subset holds held-out turns at about their overall share, not all or none of them
    assert abs(len(heldout & half) / len(half) - len(heldout) / len(ids)) < 0.03


def test_several_folders_load_as_one_dataset_of_one_target(tmp_path):
    def folder(name, model, count):
        rows = [TrainRow(f"{name}-{i}", "c", "train", [1, 2], [3] * (i + 1)) for i in range(count)]
        save_rows(tmp_path / name, rows, {"model": model, "dtype": "bf16", "workloads": [f"{name}.jsonl"]})
        return tmp_path / name

    a, b, other = folder("a", "m", 2), folder("b", "m", 3), folder("c", "another", 1)
    meta, rows = load_datasets([a, b])
    assert [r.turn_id for r in rows] == ["a-0", "a-1", "b-0", "b-1", "b-2"]
    assert meta["rows"] == 5 and meta["response_tokens"] == 3 + 6 and meta["workloads"] == ["a.jsonl", "b.jsonl"]
    with pytest.raises(ValueError, match="answers of another"):
        load_datasets([a, other])


def test_folders_that_split_a_turn_differently_are_refused(tmp_path):
    """One folder trains on a turn that another holds out (written with another --heldout): the drafter would
    be evaluated on what it learned."""
    for name, split in (("a", "train"), ("b", "heldout")):
        save_rows(tmp_path / name, [TrainRow("t1", "c", split, [1, 2], [3]), TrainRow(f"{name}-only", "c", split,
                                                                                  [1], [2])],
                  {"model": "m", "dtype": "bf16", "heldout_share": 0.2 if name == "a" else 0.5})
    with pytest.raises(ValueError, match="'t1'.*trained on in one folder and held out in another.*0.2.*0.5"):
        load_datasets([tmp_path / "a", tmp_path / "b"])


def test_a_meta_that_is_not_an_object_is_a_readable_error(tmp_path):
    save_rows(tmp_path, [TrainRow("t", "c", "train", [1], [2])], {"model": "m"})
    (tmp_path / "meta.json").write_text("[1]")
    assert recorded_model(tmp_path) is None
    with pytest.raises(ValueError, match="meta.json: a list, not a JSON object"):
        load_rows(tmp_path)


def test_turn_ids_repeated_across_workloads_are_refused(tiny_model_dir, tmp_path, capsys):
    for name in ("a", "b"):
        save_workload(tiny_turns(2), tmp_path / f"{name}.jsonl")
    code = main(["train-data", "--model", str(tiny_model_dir), "--workload", str(tmp_path / "a.jsonl"),
                 "--workload", str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "must be unique across --workload" in err
    assert not (tmp_path / "data").exists()
