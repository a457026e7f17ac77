"""Tiny random targets built from a config here, so tests need no download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from specstand import kernels
from specstand.drafters import REGISTRY
from specstand.engine.adaptive import PassCost
from specstand.engine.quiet_profile import WAIT_ENV
from specstand.models import load_model
from specstand.runner.compiled import attach_compiled
from specstand.runner.hybrid import HybridModel
from specstand.runner.transformer import DecoderModel
from specstand.training.config import TrainConfig
from specstand.training.data import generate_rows, save_rows
from specstand.training.trainer import train
from specstand.verification import SamplingParams
from specstand.workloads import Call, Turn

# the methods that draft without training or the target's tokenizer (ngram, suffix)
TRAINING_FREE = [name for name, spec in REGISTRY.items() if spec.make is not None and not spec.needs]

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, head_dim=16, eos_token_id=1, bos_token_id=0,
)
FAMILIES = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**COMMON)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**COMMON)),  # q/k/v biases
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**COMMON)),  # q/k norms
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _kernel_paths() -> list[str]:
    try:
        return kernels.available_paths()
    except kernels.KernelsUnavailable:
        return []


# The kernel paths this CPU runs (avx2 runs on AVX-512 CPUs too); "python" is the reference forward.
KERNEL_PATHS = _kernel_paths()
FORWARDS = ["python", *KERNEL_PATHS]


def tiny_hf_model(
    family: str, dtype: torch.dtype = torch.float32, seed: int = 0, head_dim: int = 16
) -> torch.nn.Module:
    cls, make_config = FAMILIES[family]
    torch.manual_seed(seed)
    config = make_config()
    config.head_dim = head_dim
    model = cls(config).eval()
    if family == "qwen2":  # random init leaves biases at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model.to(dtype)


def tiny_decoder(
    family: str, dtype: torch.dtype = torch.float32, max_positions: int = 512, forward: str = "python",
    head_dim: int = 16, weight_format: str = "bf16",
) -> DecoderModel:
    """A tiny target whose decode/verify passes run `forward`: "python" or a kernel path (bf16 only), on
    bf16 weights or their Q8_0 blocks (`weight_format`)."""
    model = DecoderModel(tiny_hf_model(family, dtype, head_dim=head_dim), max_positions)
    if forward != "python":
        assert attach_compiled(model, forward, weight_format=weight_format) is not None
    return model


class FixedCost(PassCost):
    """A pass cost that ignores the passes actually timed: adaptive decisions stop depending on the machine."""

    def observe(self, rows: int, seconds: float, keys: float = 0.0) -> None:
        pass


def random_prompts(count: int, length: int, seed: int, alphabet: int = 12) -> list[list[int]]:
    """Prompts over a small alphabet: repetitive enough that n-gram and suffix drafts get accepted."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(2, 2 + alphabet, (length,), generator=generator)).tolist() for _ in range(count)]


def save_tiny_model(folder: Path, family: str = "llama", chat_template: bool = True) -> Path:
    """A loadable HF folder: tiny model + a word-level tokenizer (with a chat template unless told not:
    a base model's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tiny_hybrid_hf_model(family) if family in HYBRID_FAMILIES else tiny_hf_model(family)
    model.save_pretrained(folder)
    words = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))
    return folder


@pytest.fixture(autouse=True)
def profile_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine built in a test takes its pass profile once, whatever else loads the machine: whether a test
    waits must not depend on its neighbours (tests/engine/test_quiet_profile.py tests the waiting). Set in the
    environment, so that servers a test starts in processes of their own do not wait either."""
    monkeypatch.setenv(WAIT_ENV, "0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def tiny_turns(count: int = 20) -> list[Turn]:
    prompts = random_prompts(count, 40, seed=1)
    return [Turn(f"t{i}", [Call("c", prompt=" ".join(f"w{t}" for t in p), max_tokens=40)])
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir: Path):
    return load_model(str(tiny_model_dir), "fp32", 512)


@pytest.fixture(scope="session")
def tiny_data(tiny_target, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("train-data")
    rows = generate_rows(tiny_target, tiny_turns(), 0.2, SamplingParams(), 4, 512)
    save_rows(folder, rows, {"model": str(tiny_model_dir)})
    return folder


# steps of the long training run of every method on the tiny target's answers
LONG_RUN = 300


class TrainedDrafters:
    """Drafters trained on the tiny target's own answers, each on first use: trained[method, steps]."""

    def __init__(self, target, data: Path, root: Path) -> None:
        self.target, self.data, self.root, self.folders = target, data, root, {}

    def __getitem__(self, key: tuple[str, int]) -> Path:
        if key not in self.folders:
            method, steps = key
            out = self.root / f"{method}-{steps}"
            train(TrainConfig(method, [str(self.data)], str(out), steps=steps, pack_tokens=256, save_every=100,
                              lr=3e-3, draft_vocab_size=64), self.target, log=lambda _: None)
            self.folders[key] = out
        return self.folders[key]


@pytest.fixture(scope="session")
def trained(tiny_target, tiny_data, tmp_path_factory) -> TrainedDrafters:
    return TrainedDrafters(tiny_target, tiny_data, tmp_path_factory.mktemp("trained"))


# Hybrid families (runner/hybrid.py): sliding-window attention, short convolutions, gated delta rule.
# Four layers, so recurrent and attention layers alternate; Gemma's window is short enough for prompts
# to slide past it.
HYBRID_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, head_dim=16, eos_token_id=1, bos_token_id=0,
)
HYBRID_FAMILIES = {
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(
        **{**HYBRID_COMMON, "num_key_value_heads": 1}, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])),
    "lfm2": (Lfm2ForCausalLM, lambda: Lfm2Config(
        **{k: v for k, v in HYBRID_COMMON.items() if k != "head_dim"},
        layer_types=["conv", "full_attention", "conv", "conv"],
        initializer_range=0.1)),  # at 0.02 this twin answers one token forever
    "qwen3_5": (Qwen3_5ForCausalLM, lambda: Qwen3_5TextConfig(
        **HYBRID_COMMON, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention",
                                               "linear_attention"])),
    "qwen3_next": (Qwen3NextForCausalLM, lambda: Qwen3NextConfig(
        **HYBRID_COMMON, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])),
}
RECURRENT_FAMILIES = ("lfm2", "qwen3_5", "qwen3_next")  # the ones with state a length-based rollback cannot undo


def tiny_hybrid_hf_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    cls, make_config = HYBRID_FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(make_config()).eval()
    with torch.no_grad():  # norms start at 0 or 1: make them matter
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.2)
    return model.to(dtype)


def tiny_hybrid(family: str, dtype: torch.dtype = torch.float32, max_positions: int = 512,
                forward: str = "python", weight_format: str = "bf16") -> HybridModel:
    """A tiny hybrid target whose projections run `forward`: "python" (torch) or a kernel path (bf16), on
    bf16 weights or their Q8_0 blocks."""
    model = HybridModel(tiny_hybrid_hf_model(family, dtype), max_positions)
    if forward != "python":
        assert model.attach_kernels(forward, weight_format=weight_format) == forward
    return model
