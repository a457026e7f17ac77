"""Loading a model folder: damaged weights are one readable error, not a traceback."""

from __future__ import annotations

import shutil

import pytest

from specstand.models import ModelError, gguf_blocks
from specstand.models.loading import load_model


def test_damaged_weights_are_a_readable_error(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    with pytest.raises(ModelError, match="weights are damaged"):
        load_model(str(folder), "bf16", 128, log=lambda _: None)


def test_damaged_published_blocks_are_a_readable_error(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / gguf_blocks.FILE).parent.mkdir(parents=True, exist_ok=True)
    (folder / gguf_blocks.FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(ModelError, match="is damaged"):
        load_model(str(folder), "q8_0", 128, log=lambda _: None)
