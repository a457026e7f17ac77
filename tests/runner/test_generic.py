"""The fallback target: architectures without a forward of ours run through the transformers module,
with a rollback that crops its cache or recomputes, and say whether they are exact."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specstand import kernels
from specstand.drafters import Draft, SequenceView, make_drafter
from specstand.drafters.ngram import NgramDrafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.models.loading import target_model
from specstand.runner import TargetRunner
from specstand.runner.generic import TransformersModel
from specstand.runner.hybrid import HybridModel
from specstand.runner.transformer import DecoderModel
from tests.conftest import HYBRID_FAMILIES, VOCAB, random_prompts, tiny_hybrid_hf_model
from tests.runner.test_hybrid import rolled_back_and_clean

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             max_position_embeddings=1024, eos_token_id=1, bos_token_id=0)
MODELS = {
    # attention only: the module's cache crops back exactly
    "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**SMALL)),
    # recurrent layers (short convolutions; the gated delta rule), run through the module here although
    # specstand has forwards of its own for them: their caches cannot crop, the slot is recomputed
    "lfm2": lambda: tiny_hybrid_hf_model("lfm2"),
    "qwen3_5": lambda: tiny_hybrid_hf_model("qwen3_5"),
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def test_unknown_architectures_run_through_the_module_and_known_ones_do_not():
    logged = []
    path = kernels.chosen_path()[0]
    model = target_model(_model("gpt_neox"), 512, path, log=logged.append)
    assert isinstance(model, TransformersModel) and "not exact" in logged[0]
    for family in HYBRID_FAMILIES:
        assert isinstance(target_model(tiny_hybrid_hf_model(family), 512, path, log=logged.append), HybridModel)


LLAMA_LIKE = dict(SMALL, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize(("build", "named"), [
    (lambda: LlamaForCausalLM(LlamaConfig(**LLAMA_LIKE, attention_bias=True)), "a bias on o_proj"),
    (lambda: LlamaForCausalLM(LlamaConfig(**LLAMA_LIKE, mlp_bias=True)), "MLP biases"),
    (lambda: MistralForCausalLM(MistralConfig(**LLAMA_LIKE, sliding_window=8)), "a 8-token sliding window"),
    (lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA_LIKE, use_sliding_window=True, sliding_window=8,
                                          max_window_layers=2)), "a 8-token sliding window"),
])
def test_llama_family_parts_our_forward_leaves_out_run_through_the_module(build, named):
    """Our Llama-family forward computes no o_proj or MLP bias and no sliding window: such a checkpoint ran
    through it and answered other tokens than the model (drafted or not alike). It runs through the module."""
    torch.manual_seed(0)
    hf = build().eval()
    logged = []
    assert isinstance(target_model(hf, 512, kernels.chosen_path()[0], log=logged.append), TransformersModel)
    assert named in logged[0]
    with pytest.raises(ValueError, match=named):
        DecoderModel(hf, 512)
    with pytest.raises(ValueError, match=f"with {named} runs on the transformers module, which takes no q8_0"):
        target_model(hf, 512, kernels.chosen_path()[0], log=logged.append, weight_format="q8_0")


def test_a_sliding_window_no_context_reaches_is_no_window():
    hf = MistralForCausalLM(MistralConfig(**LLAMA_LIKE, sliding_window=4096)).eval()  # Mistral-7B-v0.1's
    assert isinstance(target_model(hf, 512, kernels.chosen_path()[0], log=lambda _: None), DecoderModel)


@pytest.mark.parametrize("name", MODELS)
def test_rollback_leaves_no_trace(name):
    """A verify pass of 4 rows kept 1, then the next pass: the logits of a slot that never saw the
    rejected rows (crop, or recompute where the module's cache cannot crop)."""
    runner = TargetRunner(TransformersModel(_model(name), 512), 2, 256)
    rolled, clean = rolled_back_and_clean(runner, random_prompts(1, 30, seed=3)[0], 20, 1, 4)
    assert (rolled - clean).abs().max() < 1e-4


@pytest.mark.parametrize("name", MODELS)
def test_the_engine_says_whether_the_fallback_is_exact_and_answers(name):
    model = TransformersModel(_model(name), 512)
    prompts = random_prompts(3, 30, seed=4)
    plain = Engine(model, None, EngineConfig(5, 256, 1))
    drafted = Engine(model, make_drafter("suffix"), EngineConfig(5, 256, 2))
    assert isinstance(drafted.exact, bool)  # the probe's verdict, reported rather than refused
    baseline = [r.output_ids for r in plain.generate([Request(p, 24) for p in prompts])]
    results = drafted.generate([Request(p, 24) for p in prompts])
    assert all(r.finish_reason in ("stop", "length") for r in results)
    if drafted.exact:
        assert [r.output_ids for r in results] == baseline


def test_the_fallback_keeps_no_prefix_store_and_a_repeated_prompt_answers_as_cold():
    """The module's cache is not K/V tensors the store can copy: a head it kept would be positions without K/V.
    A prompt served again after its slot went to another prompt answers as it did cold."""
    model = TransformersModel(_model("gpt_neox"), 512)
    first, other = random_prompts(2, 100, seed=5)
    engine = Engine(model, None, EngineConfig(5, 256, 1, prefix_store_bytes=1 << 26))
    assert engine.prefix_cache.store_off_reason is not None
    cold = [r.output_ids for r in Engine(model, None, EngineConfig(5, 256, 1)).generate([Request(first, 16)])]
    for prompt in (first, other, first):
        answer = engine.generate([Request(prompt, 16)])[0].output_ids
    assert [answer] == cold


class OutOfVocabularyDrafter(NgramDrafter):
    """n-gram drafts, but the second request's drafts hold a token the module has no embedding for."""

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        return Draft([VOCAB + 5]) if seq.request_id == 1 else super().propose(seq, max_tokens)


def test_a_request_whose_rows_break_the_module_fails_alone():
    """The module runs a batch's requests one by one: those before the failing one had advanced their caches,
    and their passes of their own then failed too (the cache held more positions than the pass started at)."""
    model = TransformersModel(_model("gpt_neox"), 512)
    prompts = random_prompts(2, 20, seed=6)
    plain = Engine(model, None, EngineConfig(3, 256, 1)).generate([Request(prompts[0], 12)])[0].output_ids
    engine = Engine(model, OutOfVocabularyDrafter(), EngineConfig(3, 256, 2, adaptive=False))
    first, second = engine.generate([Request(p, 12) for p in prompts])
    assert second.finish_reason == "error"
    assert first.finish_reason == "length"
    if engine.exact:  # the probe's verdict on this CPU (the module may round by pass shape)
        assert first.output_ids == plain
