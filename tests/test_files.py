import os
from pathlib import Path

import pytest

from specstand import files
from specstand.files import write_atomic, write_text_atomic


def test_a_written_file_replaces_the_old_one_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_writer_that_fails_halfway_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("every row\n")

    def torn(tmp: Path) -> None:
        tmp.write_text("half a ro")
        raise KeyboardInterrupt  # a kill mid-write

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, torn)
    assert path.read_text() == "every row\n" and [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def test_the_writer_gets_a_name_with_the_final_suffix(tmp_path):
    """matplotlib's savefig and others choose the format by the suffix of the name they are given."""
    seen = []
    write_atomic(tmp_path / "plot.png", lambda tmp: (seen.append(tmp.suffix), tmp.write_bytes(b"png")))
    assert seen == [".png"] and (tmp_path / "plot.png").read_bytes() == b"png"


def test_sync_tree_flushes_every_file_under_the_folder(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    for name in ("a.bin", "sub/b.json"):
        (tmp_path / name).write_text(name)
    synced = []
    monkeypatch.setattr(files.os, "fsync", lambda fd: synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name))
    files.sync_tree(tmp_path)
    assert sorted(synced) == ["a.bin", "b.json"]
