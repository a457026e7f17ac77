"""`specstand train` under torchrun: two ranks on CPU (gloo) train as one process does, write the same
files, and a run resumes with another number of ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from specstand.cli import main
from specstand.training.trainer import TRAIN_LOG, TRAIN_PLOT

# the loss of two ranks (each the mean over its half of a pack's rows, then averaged) against one
# process's mean over the whole pack, step by step over a short run from the same start
LOSS_TOLERANCE = 0.05  # relative (measured: within 1% over 6 steps)


def _args(model_dir: Path, data: Path, out: Path, steps: int) -> list[str]:
    return ["train", "--method", "dflash", "--model", str(model_dir), "--dtype", "fp32", "--data", str(data),
            "--out", str(out), "--steps", str(steps), "--save-every", "2", "--pack-tokens", "512",
            "--draft-vocab", "64", "--block-size", "4"]


def _torchrun(ranks: int, args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), "-m", "specstand.cli", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / TRAIN_LOG).read_text().splitlines()]


def test_two_ranks_train_like_one_and_resume_with_one(tiny_model_dir, tiny_data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(_args(tiny_model_dir, tiny_data, one, 6)) == 0
    _torchrun(2, _args(tiny_model_dir, tiny_data, two, 4))
    assert len(_losses(two)) == 4
    assert main(_args(tiny_model_dir, tiny_data, two, 6)) == 0  # resumed from step 4 by one process
    a, b = _losses(one), _losses(two)
    assert len(a) == len(b) == 6
    assert all(abs(x - y) <= LOSS_TOLERANCE * abs(x) for x, y in zip(a, b, strict=True)), (a, b)
    weights_one, weights_two = (load_file(str(path / "model.safetensors")) for path in (one, two))
    assert {k: v.shape for k, v in weights_one.items()} == {k: v.shape for k, v in weights_two.items()}
    assert (one / "config.json").read_text() != "" and (two / TRAIN_PLOT).is_file()
