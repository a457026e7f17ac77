"""A failure in one request's draft, prompt or pass fails that request alone: its slot is freed and the
other requests finish with exactly the tokens they get when run by themselves."""

from __future__ import annotations

import pytest
import torch

from specstand.drafters import Draft, SequenceView, make_drafter
from specstand.drafters.ngram import NgramDrafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.verification import SamplingParams, target_probs
from tests.conftest import FORWARDS, random_prompts, tiny_decoder

POISON = 90  # a prompt that starts with this token (outside random_prompts' alphabet) triggers the fault


class FaultyDrafter(NgramDrafter):
    """n-gram drafts, but proposing for a poisoned request raises (after a few good steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, int] = {}

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        self.steps[seq.request_id] = self.steps.get(seq.request_id, 0) + 1
        if seq.token_ids[0] == POISON and self.steps[seq.request_id] > 3:
            raise RuntimeError("injected drafter fault")
        return super().propose(seq, max_tokens)


def _prompts() -> list[list[int]]:
    prompts = random_prompts(4, 30, seed=5)
    prompts[1] = [POISON, *prompts[1]]
    return prompts


def _alone(model, prompts: list[list[int]]) -> dict[int, list[int]]:
    engine = Engine(model, make_drafter("ngram"), EngineConfig(5, 256, 1))
    return {i: engine.generate([Request(p, 24)])[0].output_ids for i, p in enumerate(prompts) if p[0] != POISON}


def _run(engine: Engine, prompts: list[list[int]]):
    results = engine.generate([Request(p, 24) for p in prompts])
    assert engine.runner.cache.free_slots == engine.config.max_batch  # every slot came back
    return results


@pytest.mark.parametrize("forward", FORWARDS)
def test_a_drafter_fault_fails_its_request_alone(forward):
    model = tiny_decoder("qwen2", torch.bfloat16, forward=forward)
    prompts = _prompts()
    results = _run(Engine(model, FaultyDrafter(), EngineConfig(5, 256, 3)), prompts)
    assert results[1].finish_reason == "error" and "injected drafter fault" in results[1].error
    alone = _alone(model, prompts)
    assert {i: r.output_ids for i, r in enumerate(results) if i != 1} == alone


class ForgetfulDrafter(NgramDrafter):
    """n-gram drafts, but ending a poisoned request's sequence raises."""

    def end(self, seq: SequenceView) -> None:
        super().end(seq)
        if seq.token_ids[0] == POISON:
            raise RuntimeError("injected end fault")


def test_a_drafter_that_fails_to_end_a_finished_answer_loses_nothing():
    """Its slot was freed before the drafter's end raised: failing the request then freed it twice, and two
    later requests shared one slot."""
    model = tiny_decoder("llama", torch.bfloat16)
    prompts = _prompts()
    engine = Engine(model, ForgetfulDrafter(), EngineConfig(5, 256, 2))
    results = _run(engine, prompts) + _run(engine, prompts[2:] + prompts[:1])
    assert sorted(engine.runner.cache.free_slot_ids) == [0, 1]
    assert all(r.finish_reason == "length" for r in results)
    alone = _alone(model, prompts)
    assert [r.output_ids for i, r in enumerate(results[:4]) if i != 1] == list(alone.values())
    assert [r.output_ids for r in results[4:]] == [alone[2], alone[3], alone[0]]


def test_a_pass_fault_fails_only_the_request_whose_rows_break():
    model = tiny_decoder("llama", torch.bfloat16)
    prompts = _prompts()
    engine = Engine(model, make_drafter("ngram"), EngineConfig(5, 256, 3))
    run = engine.runner.run

    def breaks_on_poison(inputs, width, *args, **kwargs):
        slots = {engine._running[i].slot for i in engine._running if engine._running[i].seq.token_ids[0] == POISON}
        if any(item.slot in slots for item in inputs) and not kwargs.get("prefill"):
            raise RuntimeError("injected pass fault")
        return run(inputs, width, *args, **kwargs)

    engine.runner.run = breaks_on_poison
    results = _run(engine, prompts)
    assert results[1].finish_reason == "error" and "injected pass fault" in results[1].error
    assert {i: r.output_ids for i, r in enumerate(results) if i != 1} == _alone(model, prompts)


def test_a_prompt_fault_fails_its_request_and_forgets_the_slot_prompt():
    model = tiny_decoder("llama", torch.float32)
    prompts = _prompts()
    engine = Engine(model, None, EngineConfig(0, 256, 2))
    prefill = engine.runner.prefill

    def breaks_on_poison(slot, tokens, *args):
        if tokens[0] == POISON:
            prefill(slot, tokens[:64] if len(tokens) > 64 else tokens[:1], *args)  # half-written K/V
            raise RuntimeError("injected prompt fault")
        return prefill(slot, tokens, *args)

    engine.runner.prefill = breaks_on_poison
    results = _run(engine, prompts)
    assert results[1].finish_reason == "error" and "injected prompt fault" in results[1].error
    assert all(prompt[0] != POISON for prompt in engine.prefix_cache.heads())
    plain = Engine(model, None, EngineConfig(0, 256, 1))
    assert [r.output_ids for i, r in enumerate(results) if i != 1] == [
        plain.generate([Request(p, 24)])[0].output_ids for i, p in enumerate(prompts) if i != 1
    ]


def test_extreme_temperatures_give_a_proper_distribution():
    logits = torch.tensor([[3.0, 1.0, -2.0, 3.0 - 1e-6]])
    for temperature in (1e-320, 1e-30, 1e-5, 100.0):
        probs = target_probs(logits, SamplingParams(temperature))
        assert torch.isfinite(probs).all() and abs(probs.sum().item() - 1) < 1e-12
    assert target_probs(logits, SamplingParams(1e-320))[0, 0] == 1.0
    with pytest.raises(ValueError):
        SamplingParams(float("inf"))
    with pytest.raises(ValueError):
        SamplingParams(1.0, seed=2**64)
