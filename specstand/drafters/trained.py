"""Trained drafters on disk: one folder with `model.safetensors` (the drafter's own weights in bf16, its
`d2t` map and, in the metadata, its `DrafterSpec`) and a readable `config.json` copy of the spec. The
target's embedding and head are not saved: they are taken from the target when the drafter is loaded.

Shipped drafters live in the repository under drafters/<model>/<method>/ (see `shipped_drafter`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specstand.drafters.base import Drafter, TrainedParts
from specstand.drafters.chain import ChainModel
from specstand.drafters.dflash import DFlashModel
from specstand.drafters.nn import DrafterSpec, pack_for_inference
from specstand.drafters.registry import REGISTRY
from specstand.drafters.target_parts import TargetParts
from specstand.files import write_atomic, write_text_atomic

SHIPPED_ROOT = Path(__file__).resolve().parents[2] / "drafters"
WEIGHTS = "model.safetensors"


class DrafterLoadError(ValueError):
    pass


def trained_parts(method: str) -> TrainedParts:
    """How the trained `method` is built (DrafterLoadError for a method that is not a trained one)."""
    spec = REGISTRY.get(method)
    if spec is None or spec.trained is None:
        trained = ", ".join(name for name, s in REGISTRY.items() if s.trained is not None)
        raise DrafterLoadError(f"unknown trained method {method!r} (choose from {trained})")
    return spec.trained


def build_model(spec: DrafterSpec, target: TargetParts, draft_to_target: torch.Tensor) -> ChainModel | DFlashModel:
    return trained_parts(spec.method).build(spec, target, draft_to_target)


def drafter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's own tensors (the borrowed target parts excluded)."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("target.")}


def load_own_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> str:
    """Loads the drafter's own tensors (drafter_state's) into `model`; what did not match, "" where all did (a
    tensor it lacks, or one the file lacks: a layer would be left as initialized)."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith("target.")]  # the borrowed target parts are not saved
    return f"missing {missing[:3]}, unexpected {unexpected[:3]}" if missing or unexpected else ""


def save_drafter(model: ChainModel | DFlashModel, folder: Path) -> None:
    save_tensors(model.spec, drafter_state(model), folder)


def save_tensors(spec: DrafterSpec, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Write weights (bf16; d2t stays int64) then config, each to a temporary name renamed into place: a
    crash never leaves a half-written file under the final name."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(torch.int64) if k == "d2t" else v.to(torch.bfloat16)).contiguous() for k, v in state.items()}
    write_atomic(folder / WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"spec": spec.to_json()}))
    write_text_atomic(folder / "config.json", spec.to_json() + "\n")


def _open(folder: Path):
    path = Path(folder) / WEIGHTS
    if not path.is_file():
        raise DrafterLoadError(f"{folder} holds no trained drafter ({WEIGHTS} missing)")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
        raise DrafterLoadError(f"{path} is not a readable safetensors file ({error})") from None


def _spec(f, folder: Path) -> DrafterSpec:
    metadata = f.metadata() or {}
    if "spec" not in metadata:
        raise DrafterLoadError(
            f"{Path(folder) / WEIGHTS} carries no specstand drafter spec (import other formats first)"
        )
    try:
        return DrafterSpec.from_json(metadata["spec"])
    except (ValueError, TypeError) as error:
        raise DrafterLoadError(f"{Path(folder) / WEIGHTS} carries a broken drafter spec ({error})") from None


def read_spec(folder: Path) -> DrafterSpec:
    """The drafter's spec alone (the file's metadata; no tensor is read)."""
    with _open(folder) as f:
        return _spec(f, folder)


def read_drafter(folder: Path) -> tuple[DrafterSpec, dict[str, torch.Tensor]]:
    with _open(folder) as f:
        return _spec(f, folder), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable


def load_drafter_model(folder: Path, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> ChainModel | DFlashModel:
    spec, tensors = read_drafter(folder)
    if lm_head.shape[0] != spec.target_vocab_size or lm_head.shape[1] != spec.hidden_size:
        raise DrafterLoadError(
            f"drafter {folder} was trained for a target with vocab {spec.target_vocab_size} and hidden size "
            f"{spec.hidden_size}, not {lm_head.shape[0]} x {lm_head.shape[1]}"
        )
    model = build_model(spec, TargetParts(embed_tokens, lm_head), tensors["d2t"])
    mismatch = load_own_weights(model, {k: v.float() if k != "d2t" else v for k, v in tensors.items()})
    if mismatch:
        raise DrafterLoadError(f"drafter {folder} does not match its spec: {mismatch}")
    return model.eval()


def load_drafter(folder: Path, embed_tokens: torch.Tensor, lm_head: torch.Tensor, kernel_path: str) -> Drafter:
    """The drafter in `folder` for inference, its linears on the target's `kernel_path` (torch's: "python")."""
    model = load_drafter_model(folder, embed_tokens, lm_head)
    pack_for_inference(model, kernel_path)
    return trained_parts(model.spec.method).wrap(model)


def shipped_drafter(model_name: str, method: str) -> Path | None:
    folder = SHIPPED_ROOT / model_name / method
    return folder if (folder / WEIGHTS).is_file() else None
