"""`--dtype auto` follows the measured costs, keeps them per machine, and leaves unpublished models bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specstand import kernels
from specstand.models import dtype_choice
from tests.conftest import KERNEL_PATHS


@pytest.mark.parametrize(("costs", "expected"), [
    ({"bf16": 0.010, "q8_0": 0.006}, "q8_0"),
    ({"bf16": 0.004, "q8_0": 0.006}, "bf16"),
    ({"bf16": 0.010, "q8_0": 0.0096}, "bf16"),  # within the margin the unquantized weights stay
])
def test_the_cheaper_measured_format_is_chosen(costs, expected):
    choice = dtype_choice.choose(costs, "avx2")
    assert choice.dtype == expected
    assert f"dtype auto: {expected}" in choice.reason and "no bf16 dot products" in choice.reason
    assert "no bf16 dot products" not in dtype_choice.choose(costs, "avx512bf16").reason


def test_a_model_without_published_blocks_stays_bf16(monkeypatch):
    monkeypatch.setattr(dtype_choice, "measure", lambda *a, **k: pytest.fail("nothing to measure"))
    choice = dtype_choice.auto_dtype((64, 32), False, "avx2")
    assert choice.dtype == "bf16" and "no bf16 dot products (avx2 path)" in choice.reason


def test_costs_are_measured_once_per_machine_and_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTAND_HOME", str(tmp_path))
    calls = []

    def fake(n, k, path):
        calls.append((n, k, path))
        return {"bf16": 2.0, "q8_0": 1.0} if n == 64 else {"bf16": 1.0, "q8_0": 2.0}

    monkeypatch.setattr(dtype_choice, "measure", fake)
    assert dtype_choice.auto_dtype((64, 32), True, "avx2").dtype == "q8_0"
    assert dtype_choice.auto_dtype((64, 32), True, "avx2").dtype == "q8_0"
    assert dtype_choice.auto_dtype((96, 32), True, "avx2").dtype == "bf16"
    assert calls == [(64, 32, "avx2"), (96, 32, "avx2")]
    kept = json.loads((tmp_path / "dtype_costs.json").read_text())
    assert len(kept) == 2 and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("kept", ["null", "[]", '{"K": ["bf16", "q8_0"]}', '{"K": {"bf16": null, "q8_0": 1}}'])
def test_a_kept_file_of_another_shape_is_measured_anew(kept, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTAND_HOME", str(tmp_path))
    key = f"{kernels.cpu_model()}|avx2|64x32"
    (tmp_path / "dtype_costs.json").write_text(kept.replace("K", key))
    monkeypatch.setattr(dtype_choice, "measure", lambda n, k, path: {"bf16": 2.0, "q8_0": 1.0})
    assert dtype_choice.auto_dtype((64, 32), True, "avx2").dtype == "q8_0"
    assert json.loads((tmp_path / "dtype_costs.json").read_text())[key] == {"bf16": 2.0, "q8_0": 1.0}


def test_processes_measuring_at_once_keep_each_others_costs(tmp_path):
    """Servers started together: each measures its own shape; the file ends with both (before, the last writer's
    file replaced the first's, and the next start measured again)."""
    script = (
        "import sys, time\n"
        "from specstand.models import dtype_choice\n"
        "def slow(n, k, path):\n"
        "    time.sleep(0.5)\n"
        "    return {'bf16': 1.0, 'q8_0': float(n)}\n"
        "dtype_choice.measure = slow\n"
        "dtype_choice.measured_costs(int(sys.argv[1]), 32, 'avx2')\n"
    )
    env = {**os.environ, "SPECSTAND_HOME": str(tmp_path)}
    runs = [subprocess.Popen([sys.executable, "-c", script, str(n)], env=env) for n in (64, 96)]
    assert [run.wait(timeout=120) for run in runs] == [0, 0]
    kept = json.loads((tmp_path / "dtype_costs.json").read_text())
    assert sorted(costs["q8_0"] for costs in kept.values()) == [64.0, 96.0]


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_measure_times_both_formats_through_the_kernels(path):
    costs = dtype_choice.measure(48, 64, path, repeats=1)
    assert set(costs) == {"bf16", "q8_0"} and all(seconds > 0 for seconds in costs.values())


def test_load_model_says_what_auto_chose(tiny_model_dir):
    from specstand.models.loading import load_model

    said = []
    model = load_model(str(tiny_model_dir), "auto", 128, log=said.append)
    assert any(line.startswith("dtype auto: bf16 (the model publishes no Q8_0 blocks to run as they are")
               for line in said)
    assert model.decoder.dtype == dtype_choice.torch.bfloat16


@pytest.mark.parametrize(("config", "widest"), [
    ({"intermediate_size": 96, "hidden_size": 32}, (192, 32)),
    ({"text_config": {"intermediate_size": 96, "hidden_size": 32}}, (192, 32)),
    ({"text_config": None, "intermediate_size": 96, "hidden_size": 32}, (192, 32)),
    ({"hidden_size": 32}, None),
    ([1], None),
])
def test_the_widest_linear_is_read_from_the_config(config, widest, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert dtype_choice.widest_linear(tmp_path) == widest
