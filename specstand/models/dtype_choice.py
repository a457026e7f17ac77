"""`--dtype auto`: the weight format whose passes cost least on this CPU, measured at start.

The choice is between bf16 and Q8_0 blocks as a preset's GGUF publishes them (the published model itself,
read at about half the bytes of bf16); a model without published blocks stays bf16, since quantizing it
would change its answers. The cost of a format is the time of the model's widest linear at the row counts
decoding and verifying use (1 and 8 rows), through the kernels of this CPU's path. The measurement is kept
per CPU, path and shape in the cache folder, so a machine makes the same choice every start.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specstand import kernels
from specstand.kernels import q8_0

PASS_ROWS = (1, 8)  # a decode step and a verify of a few drafted tokens
FORMATS = ("bf16", "q8_0")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    reason: str  # one line: what was measured, and why this format


def _path_note(path: str) -> str:
    return "" if path in ("amx", "avx512bf16") else f"; this CPU has no bf16 dot products ({path} path)"


def choose(costs: dict[str, float], path: str) -> DtypeChoice:
    """The format of least cost (seconds for one linear at each of PASS_ROWS, summed); bf16 on a tie."""
    best = min(costs, key=lambda name: (costs[name], name != "bf16"))
    measured = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in sorted(costs.items()))
    return DtypeChoice(best, f"dtype auto: {best} (the widest linear at {' and '.join(map(str, PASS_ROWS))} rows: "
                             f"{measured}{_path_note(path)})")


def measure(n: int, k: int, path: str, repeats: int = 5) -> dict[str, float]:
    """Seconds of an [n, k] linear at each of PASS_ROWS, summed, per format (random weights: the kernels'
    time does not depend on the values)."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    module = kernels.load()
    packed = {"bf16": module.Linear(weight, kernels.PATHS[path]),
              "q8_0": module.Linear(*q8_0.quantize(weight), kernels.PATHS[path])}
    costs = {}
    for name, linear in packed.items():
        total = 0.0
        for rows in PASS_ROWS:
            x = torch.randn(rows, k)
            linear.forward(x)  # warm: the weights come into cache as they will in a pass
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                linear.forward(x)
                times.append(time.perf_counter() - started)
            total += statistics.median(times)
        costs[name] = total
    return costs


def _cache_file() -> Path:
    root = Path(os.environ.get("SPECSTAND_CACHE", Path.home() / ".cache" / "specstand"))
    return root / "dtype_costs.json"


def measured_costs(n: int, k: int, path: str) -> dict[str, float]:
    """measure(), once per CPU, path, thread count and shape: later starts read the kept figures."""
    key = f"{kernels.cpu_model()}|{path}|{torch.get_num_threads()}|{n}x{k}"
    file = _cache_file()
    try:
        kept = json.loads(file.read_text())
    except (OSError, ValueError):
        kept = {}
    if key in kept and set(kept[key]) == set(FORMATS):
        return kept[key]
    costs = measure(n, k, path)
    kept[key] = costs
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: never half a file
    partial.write_text(json.dumps(kept, indent=1))
    partial.replace(file)
    return costs


def auto_dtype(widest_linear: tuple[int, int] | None, published_blocks: bool) -> DtypeChoice:
    """What `--dtype auto` loads: bf16 unless the model publishes Q8_0 blocks and they measure cheaper here."""
    try:
        path = kernels.best_path()
        kernels.load()
    except kernels.KernelsUnavailable as reason:
        return DtypeChoice("bf16", f"dtype auto: bf16 (q8_0 needs the compiled kernels: {reason})")
    if not published_blocks:
        return DtypeChoice("bf16", "dtype auto: bf16 (the model publishes no Q8_0 blocks to run as they are"
                                   f"{_path_note(path)})")
    if widest_linear is None:
        return DtypeChoice("bf16", "dtype auto: bf16 (no linear shape to measure)")
    return choose(measured_costs(*widest_linear, path), path)
