"""Resolve `--model` (preset name, local folder or hub id) into a runnable target + tokenizer."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from specstand import kernels
from specstand.kernels import KernelsUnavailable
from specstand.models import gguf_blocks
from specstand.models.chat import render_chat
from specstand.models.dtype_choice import auto_dtype, widest_linear
from specstand.models.presets import PRESETS, fetch, preset_dir
from specstand.runner.compiled import attach_compiled
from specstand.runner.generic import TransformersModel
from specstand.runner.hybrid import FAMILIES, HybridModel
from specstand.runner.transformer import SUPPORTED_ARCHITECTURES, DecoderModel, unsupported_parts

TargetModel = DecoderModel | HybridModel | TransformersModel

# q8_0: the model loads in bf16 and its linears run as Q8_0 blocks (int8 + a scale per 32 weights) through
# the compiled kernels, reading about half the bytes of bf16 per pass
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "q8_0": torch.bfloat16}
DTYPE_SPELLINGS = {"bfloat16": "bf16", "float32": "fp32"}  # vLLM's names -> ours


def resolve_dtype(name: str) -> str:
    """A `--dtype` as given (ours, vLLM's spelling, or `auto`) -> one of DTYPES or `auto` (load_model measures)."""
    name = DTYPE_SPELLINGS.get(name, name)
    if name == "auto":
        return name
    if name not in DTYPES:
        choices = [*DTYPES, *DTYPE_SPELLINGS, "auto"]
        raise ModelError(f"unknown dtype {name!r} (choose from {', '.join(choices)})")
    return name


class ModelError(ValueError):
    pass


@dataclass
class LoadedModel:
    name: str
    path: str
    decoder: TargetModel
    tokenizer: object  # a transformers tokenizer
    stop_token_ids: frozenset[int]
    max_positions: int

    def encode_prompt(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Messages (OpenAI form, tool calls included) through the model's chat template; `tools` are
        offered to the model as the template lays them out, or as text where it cannot (chat.py)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ModelError(f"model {self.name} has no chat template; pass a plain prompt")
        return encode_messages(self.tokenizer, messages, tools)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A plain prompt's token ids, as the engine gets them (the tokenizer's special tokens added)."""
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Messages' token ids through the chat template, as the engine gets them (the template adds the specials)."""
    return tokenizer(render_chat(tokenizer, messages, tools), add_special_tokens=False)["input_ids"]


def same_model(a: str, b: str) -> bool:
    """Whether two `--model` values name one model: equal, or the same folder (a preset by name or folder)."""
    return a == b or _model_identity(a) == _model_identity(b)


def _model_identity(model: str) -> str:
    folder = preset_dir(model) if model in PRESETS else Path(model)
    return str(folder.resolve()) if folder.is_dir() else model


def resolve_model_path(model: str, log=print) -> str:
    if model in PRESETS:
        return str(fetch(model, log=log))
    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise ModelError(f"{model} is a folder without config.json, not a Hugging Face model")
        return model
    if "/" in model and not Path(model).exists():
        return model  # a hub id: transformers fetches it where a hub is reachable
    raise ModelError(f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}), a model folder or a hub id")


def load_model(model: str, dtype: str = "bf16", max_seq_len: int = 2048, log=print) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our commands print their own progress, one line each
    if dtype not in (*DTYPES, "auto"):
        raise ModelError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)}, auto)")
    path = resolve_model_path(model, log=log)
    try:
        # auto picks bf16 or q8_0, and both load the model in bf16
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES.get(dtype, torch.bfloat16)).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as error:
        raise ModelError(f"cannot load model {model!r}: {str(error).splitlines()[0]}") from None
    except SafetensorError as error:  # a truncated or damaged weights file
        raise _damaged(model, path, "its weights are", error) from None
    kernel_path = kernels.chosen_path()[0]  # chosen once: the target and its drafters run on it
    if dtype == "auto":
        choice = auto_dtype(widest_linear(Path(path)), (Path(path) / gguf_blocks.FILE).is_file(), kernel_path)
        log(choice.reason)
        dtype = choice.dtype
    max_positions = min(max_seq_len, getattr(hf_model.config, "max_position_embeddings", max_seq_len))
    weight_format = "q8_0" if dtype == "q8_0" else "bf16"
    try:
        published = gguf_blocks.read(Path(path)) if weight_format == "q8_0" else None
    except SafetensorError as error:
        raise _damaged(model, path, f"{Path(path) / gguf_blocks.FILE} is", error) from None
    if published is not None:
        log(f"q8_0 weights: the GGUF's own blocks ({gguf_blocks.describe(Path(path))})")
    try:
        decoder = target_model(hf_model, max_positions, kernel_path, log, weight_format, published)
    except KernelsUnavailable as reason:
        raise ModelError(f"--dtype {dtype} runs on the compiled kernels, which cannot run here: {reason}") from None
    except ValueError as error:
        raise ModelError(f"cannot load model {model!r} as {dtype}: {error}") from None
    stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        stop_ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    except OSError:
        pass  # no generation_config.json
    _return_freed_heap()
    return LoadedModel(model, path, decoder, tokenizer, frozenset(stop_ids), max_positions)


def _damaged(model: str, path: str, what: str, error: SafetensorError) -> ModelError:
    return ModelError(f"cannot load model {model!r}: {what} damaged ({error}); fetch it again (remove {path} first "
                      "where it is a preset's folder)")


def _return_freed_heap() -> None:
    """Hand the heap that loading freed back to the system. glibc keeps it otherwise: a Qwen q8_0 load held
    3.36 GB resident, 2.41 GB after this, and a stand serving nine methods side by side ran out of memory
    on a 24 GB machine. Elsewhere than glibc there is nothing to do."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def target_model(hf_model, max_positions: int, kernel_path: str, log=print, weight_format: str = "bf16",
                 published: dict | None = None) -> TargetModel:
    """Our forward for the model's architecture: Llama/Qwen2/Qwen3 (compiled where the CPU allows), the
    hybrid families (Gemma 3, LFM2, Qwen3.5), else the transformers module itself (not exact). Weight
    format q8_0 needs our compiled kernels (KernelsUnavailable otherwise); `kernel_path`: kernels.chosen_path;
    `published`: Q8_0 blocks by transformers name (a preset's GGUF's own), used by the Llama/Qwen forward."""
    arch = type(hf_model).__name__
    missing = unsupported_parts(hf_model, max_positions) if arch in SUPPORTED_ARCHITECTURES else ""
    if arch in SUPPORTED_ARCHITECTURES and not missing:
        decoder = DecoderModel(hf_model, max_positions)
        attach_compiled(decoder, kernel_path, log, weight_format, published)
        return decoder
    if arch in FAMILIES:
        hybrid = HybridModel(hf_model, max_positions)
        hybrid.attach_kernels(kernel_path, log, weight_format)
        return hybrid
    if weight_format != "bf16":
        raise ValueError(f"{arch}{f' with {missing}' if missing else ''} runs on the transformers module, which "
                         f"takes no {weight_format} weights (bf16 or fp32 only)")
    why = f"with {missing}" if missing else "has no forward of ours"
    log(f"{arch} {why}: running the transformers module (not exact; the probe decides)")
    return TransformersModel(hf_model, max_positions)
