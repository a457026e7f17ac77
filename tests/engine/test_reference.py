"""The single-request reference loop (engine/reference.py) answers as the engine does, for every method."""

from __future__ import annotations

import pytest
import torch

from specstand.drafters import REGISTRY, make_drafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.engine.reference import speculate
from specstand.training.data import load_rows
from specstand.verification import SamplingParams
from tests.conftest import KERNEL_PATHS, LONG_RUN, tiny_decoder

K = 5
MAX_TOKENS = 40
# fp32 on the Python forward, and bf16 on the best kernel path this CPU runs
NUMERICS = [(torch.float32, "python")] + [(torch.bfloat16, path) for path in KERNEL_PATHS[-1:]]


def _drafter(method: str, decoder, trained, tiny_target):
    spec = REGISTRY[method]
    if spec.trained:
        return make_drafter(method, decoder, drafter_path=trained[method, LONG_RUN])
    return make_drafter(method, tokenizer=tiny_target.tokenizer)


def _prompts(tiny_data) -> list[list[int]]:
    _, rows = load_rows(tiny_data)
    return [row.prompt_ids for row in rows if row.split == "train"][:3]


@pytest.mark.parametrize(("dtype", "forward"), NUMERICS)
@pytest.mark.parametrize("method", ["none", *REGISTRY])
def test_reference_loop_answers_as_the_engine(method, dtype, forward, trained, tiny_target, tiny_data):
    decoder = tiny_decoder("llama", dtype, 512, forward)  # the weights of the saved tiny model
    prompts, stops = _prompts(tiny_data), tuple(tiny_target.stop_token_ids)
    engine = Engine(decoder, _drafter(method, decoder, trained, tiny_target) if method != "none" else None,
                    EngineConfig(K, 512, max_batch=3))
    expected = [r.output_ids for r in engine.generate([Request(p, MAX_TOKENS, stop_token_ids=frozenset(stops))
                                                       for p in prompts])]
    drafter = _drafter(method, decoder, trained, tiny_target) if method != "none" else None
    answers = [speculate(decoder, drafter, p, MAX_TOKENS, K, stops) for p in prompts]
    assert answers == expected
    assert any(len(a) > 1 for a in answers)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_reference_loop_samples_as_the_engine_at_fixed_k(method, tiny_target, tiny_data):
    """Same seed, same drafts (no adaptive cuts): the same random draws, so the same sampled answer."""
    decoder = tiny_decoder("llama", torch.float32, 512, "python")
    prompt = _prompts(tiny_data)[0]
    sampling = SamplingParams(temperature=0.8, seed=7)
    engine = Engine(decoder, make_drafter(method), EngineConfig(K, 512, adaptive=False))
    expected = engine.generate([Request(prompt, MAX_TOKENS, sampling)])[0].output_ids
    assert speculate(decoder, make_drafter(method), prompt, MAX_TOKENS, K, sampling=sampling, seed=7) == expected
