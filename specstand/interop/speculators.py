"""Export to and import from the `speculators` checkpoint format (what vLLM's --speculative-config loads),
and import of z-lab's DFlash checkpoints.

speculators: `config.json` (a transformers config + speculators_model_type, speculators_config with the
proposal method and the verifier, transformer_layer_config, the aux layer ids, DFlash's block size and
mask token, the draft vocabulary size) and `model.safetensors` with speculators' tensor names; the draft
vocabulary is stored as `d2t` (offsets: target id - draft id) and `t2d` (bool mask over the target vocab).

Layer numbering: ours is Hugging Face's hidden_states index (0 = embeddings, i = output of layer i).
EAGLE-3's `eagle_aux_hidden_state_layer_ids` use the same index (vLLM takes the input of layer i);
DFlash's `aux_hidden_state_layer_ids` / z-lab's `target_layer_ids` name the layer whose OUTPUT is read,
i.e. our index - 1 (the off-by-one vLLM once had to fix).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specstand.drafters.dspark import draft_rows_of
from specstand.drafters.nn import DrafterSpec
from specstand.drafters.registry import is_block_method
from specstand.drafters.trained import WEIGHTS, DrafterLoadError, read_drafter, save_tensors
from specstand.files import write_atomic, write_text_atomic
from specstand.models import LoadedModel

SPECULATORS_VERSION = "0.3.0"
ARCHITECTURES = {"eagle3": "Eagle3Speculator", "dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator",
                 "dflash2": "DFlash2Speculator"}
# tables ours index by draft id (+ one shared row for other tokens) and speculators by verifier id
BY_PREVIOUS_TOKEN = ("markov_head.markov_w1.weight", "candidate_selector.predecessor_codebook")
BY_CANDIDATE = ("candidate_selector.successor_codebook",)


# where the presets' models are published: what a vLLM user names as the verifier
PUBLISHED_AS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def _portable_card(trained: dict) -> dict:
    """The model card's figures with the training data's target named as portable_name names it."""
    data = trained.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("model"), str):
        return trained
    return {**trained, "data": {**data, "model": portable_name(data["model"])}}


def portable_name(name_or_path: str) -> str:
    """A verifier name that means the same on another machine: a preset's hub id, a hub id as it is, a
    local folder by its last component only (an export never carries a path of this machine)."""
    if name_or_path in PUBLISHED_AS:
        return PUBLISHED_AS[name_or_path]
    path = Path(name_or_path)
    return path.name if path.is_absolute() or path.exists() else name_or_path


def check_spec(spec: DrafterSpec, source: Path, draft_ids: torch.Tensor) -> None:
    """Range checks of an imported config: a bad value is named here, not met later as a shape error."""
    positive = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_layers",
                "target_vocab_size", "draft_vocab_size")
    for name in positive:
        value = getattr(spec, name)
        if not isinstance(value, int) or value <= 0 or value > 1 << 22:
            raise DrafterLoadError(f"{source}: {name}={value!r} is not a sensible positive size")
    if spec.num_heads % spec.num_kv_heads:
        raise DrafterLoadError(f"{source}: num_heads {spec.num_heads} is not a multiple of num_kv_heads "
                               f"{spec.num_kv_heads}")
    if not spec.tap_layers or any(not isinstance(t, int) or not 0 <= t <= 1024 for t in spec.tap_layers):
        raise DrafterLoadError(f"{source}: the target layers read ({spec.tap_layers}) must be layer numbers >= 0")
    if is_block_method(spec.method) and not 2 <= spec.block_size <= 64:
        raise DrafterLoadError(f"{source}: block_size={spec.block_size} (a block has 2..64 positions)")
    if spec.method == "dspark" and not 1 <= spec.markov_rank <= 4096:
        raise DrafterLoadError(f"{source}: markov_rank={spec.markov_rank} (DSpark needs 1..4096)")
    if spec.method == "dflash2" and not (1 <= spec.conv_kernel_size <= 8 and spec.conv_group_size >= 1
                                         and spec.hidden_size % spec.conv_group_size == 0
                                         and 1 <= spec.selector_rank <= 4096
                                         and 2 <= spec.selector_top_k <= spec.draft_vocab_size):
        raise DrafterLoadError(f"{source}: conv_kernel_size={spec.conv_kernel_size}, conv_group_size="
                               f"{spec.conv_group_size}, selector_rank={spec.selector_rank}, selector_top_k="
                               f"{spec.selector_top_k} make no DFlash 2 drafter of hidden size {spec.hidden_size}")
    if not 0 <= spec.mask_token_id < spec.target_vocab_size:
        raise DrafterLoadError(f"{source}: mask_token_id={spec.mask_token_id} is outside the vocabulary")
    if not (math.isfinite(spec.rms_eps) and spec.rms_eps > 0 and math.isfinite(spec.rope_theta)
            and spec.rope_theta > 0):
        raise DrafterLoadError(f"{source}: rms_norm_eps and rope_theta must be positive numbers")
    if len(draft_ids) != spec.draft_vocab_size or (len(draft_ids) and not (
            int(draft_ids.min()) >= 0 and int(draft_ids.max()) < spec.target_vocab_size)):
        raise DrafterLoadError(f"{source}: d2t does not map {spec.draft_vocab_size} draft ids into the target's "
                               f"{spec.target_vocab_size}")
    if len(torch.unique(draft_ids)) != len(draft_ids):
        raise DrafterLoadError(f"{source}: d2t maps two draft ids to one target id")


def _write_atomic(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    write_atomic(folder / WEIGHTS, lambda tmp: save_file(contiguous, str(tmp), metadata={"format": "pt"}))
    write_text_atomic(folder / "config.json", json.dumps(config, indent=2) + "\n")


def _layer_config(spec: DrafterSpec) -> dict:
    return {
        "model_type": "qwen3" if spec.qk_norm else "llama", "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "num_hidden_layers": spec.num_layers,
        "rms_norm_eps": spec.rms_eps, "rope_theta": spec.rope_theta, "vocab_size": spec.target_vocab_size,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }


def export_speculators(drafter: Path, target: LoadedModel, out: Path) -> None:
    spec, tensors = read_drafter(drafter)
    if spec.method not in ARCHITECTURES:
        raise DrafterLoadError(f"speculators/vLLM have no format for a standalone {spec.method} head "
                               f"(export eagle3, dflash, dspark or dflash2 drafters)")
    draft_ids = tensors.pop("d2t")
    renamed = {("layers.0.hidden_norm.weight" if k == "hidden_norm.weight" and spec.method == "eagle3" else k): v
               for k, v in tensors.items()}
    prev_rows = draft_rows_of(draft_ids, spec.target_vocab_size)
    for name in BY_PREVIOUS_TOKEN:
        if name in renamed:
            renamed[name] = renamed[name][prev_rows]
    for name in BY_CANDIDATE:
        if name in renamed:
            renamed[name] = torch.zeros(spec.target_vocab_size, renamed[name].shape[1],
                                        dtype=renamed[name].dtype).index_copy_(0, draft_ids, renamed[name])
    if "lm_head.weight" not in renamed:  # block drafters read the target's head rows of the draft vocabulary
        renamed["lm_head.weight"] = target.decoder.weights.lm_head[draft_ids].to(torch.bfloat16)
    renamed["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(spec.target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    renamed["t2d"] = t2d
    k = spec.block_drafts or 5
    config = {
        "architectures": [ARCHITECTURES[spec.method]],
        "speculators_model_type": spec.method,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": spec.method,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": portable_name(target.name), "architectures": [spec.target_architecture]},
        },
        "transformer_layer_config": _layer_config(spec),
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.hidden_size,
        # what a round trip needs beyond the fields above
        "specstand_spec": json.loads(replace(spec, target=portable_name(spec.target),
                                             trained=_portable_card(spec.trained)).to_json()),
    }
    if spec.method == "eagle3":
        config |= {"norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": spec.tap_layers}
    else:
        config |= {"aux_hidden_state_layer_ids": [t - 1 for t in spec.tap_layers], "block_size": spec.block_size,
                   "mask_token_id": spec.mask_token_id, "sample_from_anchor": spec.sample_from_anchor}
    if spec.method == "dspark":
        config |= {"markov_rank": spec.markov_rank, "markov_head_type": "vanilla",
                   "enable_confidence_head": spec.enable_confidence_head,
                   "confidence_head_with_markov": spec.confidence_head_with_markov}
    if spec.method == "dflash2":
        fields = {"block_size": spec.block_size, "conv_kernel_size": spec.conv_kernel_size,
                  "conv_group_size": spec.conv_group_size, "selector_rank": spec.selector_rank,
                  "selector_top_k": spec.selector_top_k, "mask_token_id": spec.mask_token_id}
        # flat for speculators, nested as vLLM/SGLang read DFlash-family drafters
        config |= fields | {"dflash_config": fields | {"target_layer_ids": [t - 1 for t in spec.tap_layers]}}
    _write_atomic(out, config, renamed)


def _read(source: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_path, weights_path = Path(source) / "config.json", Path(source) / WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise DrafterLoadError(f"{source} needs config.json and {WEIGHTS}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise DrafterLoadError(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise DrafterLoadError(f"{config_path} holds a {type(config).__name__}, not a JSON object")
    with safe_open(str(weights_path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    return config, tensors


@contextmanager
def _config_fields(source: Path) -> Iterator[None]:
    """A config missing a field, or holding one of the wrong kind, is a DrafterLoadError naming it."""
    try:
        yield
    except DrafterLoadError:
        raise
    except KeyError as error:
        raise DrafterLoadError(f"{source}/config.json has no {error.args[0]!r}") from None
    except (TypeError, AttributeError, ValueError) as error:
        raise DrafterLoadError(f"{source}/config.json is not a drafter config this reads: {error}") from None


def _spec_from_layer_config(method: str, layer: dict, target: str, taps: list[int], draft_vocab: int,
                            block_size: int, mask_token_id: int) -> DrafterSpec:
    return DrafterSpec(
        method=method, target=target, target_architecture="", target_vocab_size=layer["vocab_size"],
        hidden_size=layer["hidden_size"], num_heads=layer["num_attention_heads"],
        num_kv_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        intermediate_size=layer["intermediate_size"], num_layers=layer["num_hidden_layers"],
        rms_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=layer.get("rope_theta", 10000.0), tap_layers=taps,
        draft_vocab_size=draft_vocab, block_size=block_size, mask_token_id=mask_token_id,
        train_steps=0, qk_norm=layer.get("model_type") == "qwen3",
    )


def _speculators_spec(config: dict, method: str) -> DrafterSpec:
    """The drafter's spec from a speculators config: ours as written, or from its layer config."""
    verifier = config.get("speculators_config", {}).get("verifier", {})
    if "specstand_spec" in config:
        spec = DrafterSpec(**config["specstand_spec"])
    else:
        nested = config.get("dflash_config") or {}
        fields = nested | {k: v for k, v in config.items() if k != "dflash_config"}
        taps = (config.get("eagle_aux_hidden_state_layer_ids") if method == "eagle3"
                else [i + 1 for i in fields.get("aux_hidden_state_layer_ids", fields.get("target_layer_ids", []))])
        spec = _spec_from_layer_config(method, config["transformer_layer_config"], verifier.get("name_or_path", ""),
                                       taps or [], config["draft_vocab_size"], fields.get("block_size", 0),
                                       fields.get("mask_token_id", 0))
        spec.target_architecture = (verifier.get("architectures") or [""])[0]
        if method == "dspark":
            spec.markov_rank = int(fields.get("markov_rank", 0))
            spec.enable_confidence_head = bool(fields.get("enable_confidence_head", False))
            spec.confidence_head_with_markov = bool(fields.get("confidence_head_with_markov", True))
        if method == "dflash2":
            for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                setattr(spec, name, int(fields.get(name, 0)))
    # the checkpoint's own word on its block layout (DSpark's default: the anchor row drafts first); read
    # wrong, every draft is one slot off and acceptance falls to about nothing
    spec.sample_from_anchor = bool(config.get("sample_from_anchor", method == "dspark"))
    return spec


def import_speculators(source: Path, out: Path, target: str | None = None) -> DrafterSpec:
    config, tensors = _read(source)
    method = config.get("speculators_model_type")
    if method not in ARCHITECTURES:
        raise DrafterLoadError(f"{source}: speculators_model_type {method!r} is not one of {', '.join(ARCHITECTURES)}")
    with _config_fields(source):
        spec = _speculators_spec(config, method)
    if target:
        spec = replace(spec, target=target)
    offsets = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    ours = {("hidden_norm.weight" if k == "layers.0.hidden_norm.weight" else k): v for k, v in tensors.items()
            if k != "embed_tokens.weight"}
    if is_block_method(method):
        ours.pop("lm_head.weight", None)  # ours reads the target's head rows
    draft_ids = torch.arange(spec.target_vocab_size) if offsets is None else offsets + torch.arange(len(offsets))
    check_spec(spec, source, draft_ids)
    others = torch.ones(spec.target_vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, False)
    for name in BY_PREVIOUS_TOKEN:  # the draft ids' rows, then the row every other token shares
        if name in ours:
            other = ours[name][others][:1] if others.any() else torch.zeros_like(ours[name][:1])
            ours[name] = torch.cat([ours[name][draft_ids], other])
    for name in BY_CANDIDATE:
        if name in ours:
            ours[name] = ours[name][draft_ids]
    save_tensors(spec, {**ours, "d2t": draft_ids}, out)
    return spec


def import_dflash_zlab(source: Path, out: Path, target: str | None = None) -> DrafterSpec:
    """z-lab's DFlash drafters: a Qwen3-style layer config with `dflash_config` {target_layer_ids,
    mask_token_id} and `block_size`; full target vocabulary, no embedding or head of their own."""
    config, tensors = _read(source)
    dflash = config.get("dflash_config")
    if not dflash or "target_layer_ids" not in dflash:
        raise DrafterLoadError(f"{source}: no dflash_config.target_layer_ids, not a z-lab DFlash checkpoint")
    layer = {**config, "model_type": "qwen3" if any(".q_norm." in k for k in tensors) else "llama"}
    with _config_fields(source):
        spec = _spec_from_layer_config("dflash", layer, target or config.get("_name_or_path", ""),
                                       [i + 1 for i in dflash["target_layer_ids"]], config["vocab_size"],
                                       config.get("block_size", 16), dflash.get("mask_token_id", 0))
    ours = {k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    check_spec(spec, source, torch.arange(spec.target_vocab_size))
    save_tensors(spec, {**ours, "d2t": torch.arange(spec.target_vocab_size)}, out)
    return spec
