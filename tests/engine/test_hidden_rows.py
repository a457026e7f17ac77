"""What the engine hands trained drafters: the target's hidden states of exactly the positions it cached."""

from __future__ import annotations

import pytest
import torch

from specstand.drafters import Draft, Drafter, HiddenRows, SequenceView
from specstand.engine import Engine, EngineConfig, Request
from tests.conftest import FORWARDS, random_prompts, tiny_decoder


class Recorder(Drafter):
    name = "recorder"
    tap_layers = (1, 2)

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, HiddenRows]] = []  # (request, length after extend, hidden)

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        return Draft(seq.token_ids[-2:][:max_tokens])  # any guess; some get accepted

    def extend(self, seq: SequenceView, new_tokens: list[int], hidden: HiddenRows | None = None) -> None:
        self.seen.append((seq.request_id, len(seq.token_ids), hidden))


def test_drafters_get_the_whole_prompt_even_when_its_head_is_reused():
    decoder = tiny_decoder("llama", torch.float32)
    head = random_prompts(1, 128, seed=3)[0]
    first, second = head + [5, 6, 7], head + [8, 9]
    fresh = Recorder()
    Engine(decoder, fresh, EngineConfig(3, 512, 1, prefix_reuse=False)).generate([Request(second, 6)])
    reused = Recorder()
    engine = Engine(decoder, reused, EngineConfig(3, 512, 1))
    engine.generate([Request(first, 6)])
    result = engine.generate([Request(second, 6)])[0]
    assert result.stats.cached_prompt_tokens == 128
    prefill = next(h for rid, _, h in reused.seen if rid == result.request_id)
    expected = fresh.seen[0][2]
    assert prefill.start == 0 and prefill.rows == len(second)
    for layer in Recorder.tap_layers:
        assert torch.equal(prefill.taps[layer], expected.taps[layer])


@pytest.mark.parametrize("forward", FORWARDS)
def test_drafters_get_the_whole_prompt_when_a_cached_answer_is_reused(forward):
    decoder = tiny_decoder("llama", torch.bfloat16, forward=forward)
    first = random_prompts(1, 40, seed=4)[0]
    reused = Recorder()
    engine = Engine(decoder, reused, EngineConfig(3, 512, 1))
    answer = engine.generate([Request(first, 12)])[0].output_ids
    second = first + answer + [5, 6]
    result = engine.generate([Request(second, 6)])[0]
    fresh = Recorder()
    Engine(decoder, fresh, EngineConfig(3, 512, 1, prefix_reuse=False)).generate([Request(second, 6)])
    if engine.runner.compiled_prompts:
        # all but the last answer token, which no pass computed unless it was an accepted draft
        assert result.stats.cached_prompt_tokens in (len(first) + len(answer) - 1, len(first) + len(answer))
    prefill = next(h for rid, _, h in reused.seen if rid == result.request_id)
    assert prefill.start == 0 and prefill.rows == len(second)
    for layer in Recorder.tap_layers:
        assert torch.equal(prefill.taps[layer], fresh.seen[0][2].taps[layer])


def test_decode_rows_cover_the_pending_token_and_the_accepted_drafts():
    decoder = tiny_decoder("llama", torch.float32)
    recorder = Recorder()
    Engine(decoder, recorder, EngineConfig(3, 512, 2)).generate([Request(p, 12) for p in random_prompts(2, 20, 4)])
    for request_id in (0, 1):
        calls = [(length, h) for rid, length, h in recorder.seen if rid == request_id]
        cached = calls[0][1].rows  # the prompt
        for length, hidden in calls[1:]:
            assert hidden.start == cached  # the first row is the token that was pending
            cached += hidden.rows
            assert cached == length - 1  # every emitted token but the new pending one is now covered


class Oracle(Recorder):
    """Drafts the known answer, so whole drafts are accepted, a stop token inside them included."""

    def __init__(self, answer: list[int]) -> None:
        super().__init__()
        self.answer = answer

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        done = len(seq.output_ids)
        return Draft(self.answer[done : done + max_tokens])


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_without_a_short_extend():
    decoder = tiny_decoder("llama", torch.float32)
    prompt = random_prompts(1, 20, seed=5)[0]
    answer = Engine(decoder, None, EngineConfig(3, 512, 1)).generate([Request(prompt, 12)])[0].output_ids
    cut = next(i for i in range(3, len(answer)) if answer[i] not in answer[:i])  # a token first seen there
    oracle = Oracle(answer)
    result = Engine(decoder, oracle, EngineConfig(5, 512, 1)).generate(
        [Request(prompt, 12, stop_token_ids=frozenset({answer[cut]}))])[0]
    assert result.output_ids == answer[: cut + 1] and result.finish_reason == "stop"
    assert result.stats.accepted_tokens > 0
    lengths = [length for _, length, _ in oracle.seen]
    assert lengths[-1] < len(prompt) + cut + 1  # the finishing pass did not reach the drafter
