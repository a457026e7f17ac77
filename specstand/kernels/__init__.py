"""Compiled CPU kernels: a batch-invariant bf16 linear and the decode/verify forward built on it.

Built on first use with torch.utils.cpp_extension (gcc + ninja) into a cache folder keyed by the sources,
the torch version and the compiler, then loaded from there. The instruction path is chosen from what this
CPU has (`best_path`), or forced with SPECSTAND_KERNEL_PATH=amx|avx512bf16|avx2|scalar|python; `python` (or a
machine without a compiler) keeps the readable Python forward.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from specstand.files import locked, specstand_home

SOURCES = ("linear.cpp", "linear_q8_0.cpp", "attention.cpp", "decoder.cpp")
HEADERS = ("common.h", "linear.h", "tiles.h", "attention.h")
PATHS = {"scalar": 0, "avx2": 1, "avx512bf16": 2, "amx": 3}  # the C++ Isa values, worst first
PATH_ENV = "SPECSTAND_KERNEL_PATH"


class KernelsUnavailable(RuntimeError):
    """The compiled kernels cannot run here; the message says why."""


class KernelPathError(ValueError):
    """SPECSTAND_KERNEL_PATH names a path that does not exist or that this CPU cannot run: an error, not a quiet
    fall back to the Python forward (several times slower) that a forced path was meant to rule out."""


def _cache_dir(digest: str) -> Path:
    return specstand_home() / "kernels" / digest


def load() -> ModuleType:
    """The compiled extension (built once per source version, then loaded from the cache). A build that failed
    is not tried again in this process: it would fail the same way, and a load asks several times."""
    built = _built()
    if isinstance(built, KernelsUnavailable):
        raise KernelsUnavailable(str(built))
    return built


@cache
def _built() -> ModuleType | KernelsUnavailable:
    try:
        return _build()
    except KernelsUnavailable as error:
        return error


def _build() -> ModuleType:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelsUnavailable("no C++ compiler on PATH (install gcc/g++); using the Python forward")
    from torch.utils import cpp_extension

    folder = Path(__file__).parent / "csrc"
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((folder / name).read_bytes())
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    # another compiler (CXX) or version builds anew rather than loading what the last one built
    digest.update(subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.encode())
    key = digest.hexdigest()[:16]
    build = _cache_dir(key)
    build.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build):
            return cpp_extension.load(
                name=f"specstand_kernels_{key}",
                sources=[str(folder / name) for name in SOURCES],
                # -ffp-contract=off: no FMA the source did not ask for, so lane ops round the same everywhere
                extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as error:
        last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise KernelsUnavailable(f"the kernels did not build ({last}); using the Python forward") from None


# torch's lock file older than this was left by a builder that died (a build here takes 30-60 s on 2 cores)
STALE_BUILD_LOCK_SECONDS = 180


@contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """An flock on the build folder while the extension builds or loads. torch's own lock there is a file that a
    builder removes when it finishes: one killed mid-build (a server stopped while it started) leaves it behind,
    and every later start would wait on it forever. The kernel releases an flock when its holder dies, so a
    process holding this one is the only specstand builder alive; a lock file it still finds belongs to a dead
    builder, or to a specstand from before this flock (another tree sharing the cache) whose build is running:
    it waits until the file is STALE_BUILD_LOCK_SECONDS old, then drops it."""
    with locked(build / "specstand.lock"):
        left = build / "lock"
        while True:
            try:
                age = time.time() - left.stat().st_mtime
            except FileNotFoundError:
                break
            if age >= STALE_BUILD_LOCK_SECONDS:
                left.unlink(missing_ok=True)
                break
            time.sleep(1.0)
        yield


def available_paths() -> list[str]:
    """The instruction paths this CPU can run, worst first."""
    module = load()
    return [name for name, value in PATHS.items() if module.cpu_has(value)]


def best_path() -> str:
    """The path to use: SPECSTAND_KERNEL_PATH if set (KernelPathError where it is no path or one this CPU cannot
    run), else the best this CPU has."""
    forced = os.environ.get(PATH_ENV)
    if forced:
        if forced == "python":
            raise KernelsUnavailable(f"{PATH_ENV}=python: using the Python forward")
        if forced not in PATHS:
            raise KernelPathError(f"{PATH_ENV}={forced} is not one of python, {', '.join(PATHS)}")
        if forced not in available_paths():
            raise KernelPathError(f"{PATH_ENV}={forced}: this CPU cannot run that path (it runs "
                                  f"{', '.join(available_paths())})")
        return forced
    return available_paths()[-1]


def chosen_path() -> tuple[str, str]:
    """The path a model is loaded with, chosen once there and passed down to everything it builds:
    (best_path(), "") where the kernels build and the CPU runs a path, else ("python", the reason)."""
    try:
        return best_path(), ""
    except KernelsUnavailable as reason:
        return "python", str(reason)


def _cpuinfo(field: str) -> str | None:
    """The first `field` line of /proc/cpuinfo, or None where it cannot be read (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(field)), "")


def all_cpu_flags() -> set[str] | None:
    """Every CPU feature flag, or None where /proc/cpuinfo cannot be read."""
    line = _cpuinfo("flags")
    return None if line is None else set(line.split())


def cpu_flags() -> list[str]:
    """The CPU features that choose a kernel path."""
    flags = all_cpu_flags() or set()
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
    return [flag for flag in wanted if flag in flags]


def cpu_model() -> str:
    return _cpuinfo("model name") or "unknown CPU"


def pack(weight: torch.Tensor, path: str):  # -> the extension's Linear
    """A weight [n, k] packed once, as bf16, for the kernel `path`: its forward(x) gives x @ weight.T in fp32."""
    return load().Linear(weight.detach().to(torch.bfloat16), PATHS[path])


def linear(weight: torch.Tensor, x: torch.Tensor, path: str) -> torch.Tensor:
    """x [m, k] @ weight[n, k].T through the kernel `path` (packs the weight on every call: for tests)."""
    return pack(weight, path).forward(x)


def linear_q8_0(q: torch.Tensor, d: torch.Tensor, x: torch.Tensor, path: str) -> torch.Tensor:
    """x [m, k] @ W.T for Q8_0 weights W = d * q (q8_0.py), through the kernel `path` (packs on every call)."""
    return load().Linear(q, d, PATHS[path]).forward(x)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor, scale: float, path: str) -> torch.Tensor:
    """The decode/verify attention kernel of `path` (for tests): q [rows, heads * head_dim] fp32 over bf16
    keys/values [slots, kv_heads, capacity, head_dim]; row r attends over positions 0..positions[r] of its slot."""
    return load().attention(PATHS[path], q, keys, values, slots, positions, scale)


def peak_macs_per_second(path: str, iterations: int = 20_000_000) -> float:
    """Multiply-accumulates per second of one core running the path's instruction from registers."""
    return load().peak_macs_per_second(PATHS[path], iterations)


def peak_macs_per_second_q8_0(path: str, tiles: bool = False, iterations: int = 20_000_000) -> float:
    """The same for the q8_0 kernel of `path` (`tiles`: its AMX-INT8 loop, taken from 16 rows on amx),
    one weight-activation product counted as the kernel computes it (two int8 products on AVX-512)."""
    return load().peak_macs_per_second_q8_0(PATHS[path], tiles, iterations)


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Memory read bandwidth: median GB/s of summing `gib` GiB of fp32 on all of torch's threads. It drifts
    where neighbours share the host: measure it beside every figure that is compared with it."""
    x = torch.ones(int(gib * 256 * 1024 * 1024))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - started)
    return x.numel() * 4 / statistics.median(times) / 1e9


def machine() -> dict:
    """What a benchmark figure of this machine depends on: the CPU, the features that choose a kernel path,
    and the path specstand's targets take here (a report carries it beside its figures)."""
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "flags": cpu_flags(), "kernel_path": chosen_path()[0]}


def describe() -> list[str]:
    """What `specstand doctor` prints: the CPU, its features, the kernel path and the machine's rates."""
    lines = [f"cpu: {cpu_model()} ({os.cpu_count()} cpus, torch uses {torch.get_num_threads()} threads)",
             f"features: {' '.join(cpu_flags()) or 'none of avx2/avx512/amx'}"]
    try:
        paths = available_paths()
        chosen = best_path()
    except KernelsUnavailable as reason:
        lines.append(f"kernel path: python ({reason})")
    else:
        lines.append(f"kernel paths this CPU runs: {', '.join(paths)}; chosen: {chosen}")
        threads = torch.get_num_threads()
        peak = peak_macs_per_second(chosen) * threads
        q8 = peak_macs_per_second_q8_0(chosen) * threads
        tiles = ""
        if chosen == "amx":
            tiles = f" ({peak_macs_per_second_q8_0(chosen, True) * threads / 1e9:.0f} from 16 rows)"
        lines.append(f"peak multiply-accumulate rate ({chosen}, register-only loop): {peak / 1e9:.0f} GMAC/s bf16, "
                     f"{q8 / 1e9:.0f} GMAC/s q8_0{tiles}")
    lines.append(f"read bandwidth (1 GiB fp32 sum): {read_bandwidth_gbs():.1f} GB/s")
    return lines
