"""`--dtype auto`: the weight format whose passes cost least on this CPU, measured at start.

The choice is between bf16 and Q8_0 blocks as a preset's GGUF publishes them (the published model itself,
read at about half the bytes of bf16); a model without published blocks stays bf16, since quantizing it
would change its answers. The cost of a format is the CPU time of the model's widest linear at the row counts
decoding and verifying use (1 and 8 rows), through the kernels of this CPU's path. The measurement is kept
per CPU, path and shape in the cache folder, so a machine makes the same choice (and gives the same answers)
every start.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specstand import kernels
from specstand.files import locked, specstand_home, write_text_atomic
from specstand.kernels import q8_0

PASS_ROWS = (1, 8)  # a decode step and a verify of a few drafted tokens
STREAMED_BYTES = 96 << 20  # bf16 copies of the linear taken in turn: more than a last-level cache, as a pass's weights
FORMATS = ("bf16", "q8_0")
MARGIN = 0.95  # Q8_0 must measure this much of bf16's cost or less: within the noise, the unquantized weights stay


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    reason: str  # one line: what was measured, and why this format


def _path_note(path: str) -> str:
    return "" if path in ("amx", "avx512bf16") else f"; this CPU has no bf16 dot products ({path} path)"


def choose(costs: dict[str, float], path: str) -> DtypeChoice:
    """q8_0 where it costs at most MARGIN of bf16 (seconds for one linear at each of PASS_ROWS, summed), else bf16."""
    best = "q8_0" if costs["q8_0"] <= MARGIN * costs["bf16"] else "bf16"
    measured = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in sorted(costs.items()))
    return DtypeChoice(best, f"dtype auto: {best} (the widest linear at {' and '.join(map(str, PASS_ROWS))} rows, "
                             f"one thread: {measured}{_path_note(path)})")


def measure(n: int, k: int, path: str, repeats: int = 9) -> dict[str, float]:
    """CPU seconds of an [n, k] linear at each of PASS_ROWS, summed, per format, on one thread (random weights: the
    kernels' time does not depend on the values). One thread's CPU time, the least of the repeats: what a busy
    host's neighbours do barely moves it, where wall time over two threads waits on whichever was descheduled."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    module = kernels.load()
    copies = max(1, -(-STREAMED_BYTES // (2 * n * k)))  # each call reads its weights from memory, not from cache
    blocks = q8_0.quantize(weight)
    packed = {"bf16": [module.Linear(weight, kernels.PATHS[path]) for _ in range(copies)],
              "q8_0": [module.Linear(*blocks, kernels.PATHS[path]) for _ in range(copies)]}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernels then run on this thread, which thread_time() clocks
    try:
        costs = {}
        for name, linears in packed.items():
            total = 0.0
            for rows in PASS_ROWS:
                x = torch.randn(rows, k)
                times = []
                for i in range(repeats + len(linears)):  # the first round evicts: it is not counted
                    started = time.thread_time()
                    linears[i % len(linears)].forward(x)
                    times.append(time.thread_time() - started)
                total += min(times[len(linears):])
            costs[name] = total
    finally:
        torch.set_num_threads(threads)
    return costs


def _cache_file() -> Path:
    return specstand_home() / "dtype_costs.json"


def measured_costs(n: int, k: int, path: str) -> dict[str, float]:
    """measure(), once per CPU, path and shape: later starts read the kept figures. Processes take turns (servers
    started together): the first measures, the others wait and read its figures, and none loses another's."""
    key = f"{kernels.cpu_model()}|{path}|{n}x{k}"
    file = _cache_file()
    with locked(file.with_name(f".{file.name}.lock")):
        kept = _kept_costs(file)
        if key in kept and set(kept[key]) == set(FORMATS):
            return kept[key]
        costs = measure(n, k, path)
        write_text_atomic(file, json.dumps({**kept, key: costs}, indent=1))
    return costs


def _kept_costs(file: Path) -> dict[str, dict[str, float]]:
    """The file's figures that have the right shape (a file that is not ours, or torn, counts as none)."""
    try:
        kept = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(kept, dict):
        return {}
    return {key: costs for key, costs in kept.items() if isinstance(costs, dict)
            and all(isinstance(cost, int | float) and not isinstance(cost, bool) for cost in costs.values())}


def widest_linear(folder: Path) -> tuple[int, int] | None:
    """(n, k) of a model's fused gate/up linear, from its config.json (None where it names no sizes)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    config = config.get("text_config") or config  # a multimodal model's text part (null where it has none)
    if not {"intermediate_size", "hidden_size"} <= set(config):
        return None
    return 2 * config["intermediate_size"], config["hidden_size"]


def describe(folders: dict[str, Path]) -> list[str]:
    """What `specstand doctor` says `--dtype auto` loads for each model folder (measured as at start)."""
    from specstand.models import gguf_blocks

    path = kernels.chosen_path()[0]
    lines = [f"{name}: {auto_dtype(widest_linear(folder), (folder / gguf_blocks.FILE).is_file(), path).reason}"
             for name, folder in folders.items()]
    return [*lines, f"(the measured costs are kept in {_cache_file()}: delete it to measure again)"]


def auto_dtype(widest_linear: tuple[int, int] | None, published_blocks: bool, path: str) -> DtypeChoice:
    """What `--dtype auto` loads on kernel `path` (kernels.chosen_path): bf16 unless the model publishes Q8_0
    blocks and they measure cheaper here."""
    if path == "python":
        return DtypeChoice("bf16", f"dtype auto: bf16 (q8_0 needs the compiled kernels: {kernels.chosen_path()[1]})")
    if not published_blocks:
        return DtypeChoice("bf16", "dtype auto: bf16 (the model publishes no Q8_0 blocks to run as they are"
                                   f"{_path_note(path)})")
    if widest_linear is None:
        return DtypeChoice("bf16", "dtype auto: bf16 (no linear shape to measure)")
    return choose(measured_costs(*widest_linear, path), path)
