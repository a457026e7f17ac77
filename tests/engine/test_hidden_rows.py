"""What the engine hands trained drafters: the target's hidden states of exactly the positions it cached."""

from __future__ import annotations

import torch

from specstand.drafters import Draft, Drafter, HiddenRows, SequenceView
from specstand.engine import Engine, EngineConfig, Request
from tests.conftest import random_prompts, tiny_decoder


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


def test_decode_rows_cover_the_pending_token_and_the_accepted_drafts():
    decoder = tiny_decoder("llama", torch.float32)
    recorder = Recorder()
    Engine(decoder, recorder, EngineConfig(3, 512, 2)).generate([Request(p, 12) for p in random_prompts(2, 20, 4)])
    for request_id in (0, 1):
        calls = [(length, h) for rid, length, h in recorder.seen if rid == request_id]
        cached = calls[0][1].rows  # the prompt
        for length, hidden in calls[1:-1]:  # the last pass may be cut at a stop token
            assert hidden.start == cached  # the first row is the token that was pending
            cached += hidden.rows
            assert cached == length - 1  # every emitted token but the new pending one is now covered
