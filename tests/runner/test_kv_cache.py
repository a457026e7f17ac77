"""Rollback after a rejected draft must leave the cache as if the draft never happened."""

import torch

from specstand.runner import PassInput, TargetRunner
from specstand.runner.transformer import DecoderModel
from tests.conftest import tiny_hf_model


def _runner(dtype=torch.float32):
    return TargetRunner(DecoderModel(tiny_hf_model("llama", dtype), 512), num_slots=2, capacity=300)


def test_rollback_erases_a_rejected_draft():
    runner = _runner()
    prompt = list(range(2, 30))
    continuation = [5, 9, 13]
    clean, drafted = runner.cache.allocate(), runner.cache.allocate()
    for slot in (clean, drafted):
        runner.prefill(slot, prompt)
    # the drafted slot verifies a 6-token draft of which only the first token survives; every pass is
    # padded to 8 rows, which makes fp32 rows independent of their pass on this CPU (see exactness.py)
    runner.run([PassInput(drafted, [continuation[0], 40, 41, 42, 43, 44])], 8)
    assert runner.cache.lengths[drafted] == len(prompt) + 6
    runner.cache.rollback(drafted, len(prompt) + 1)
    runner.run([PassInput(clean, continuation[:1])], 8)
    after_clean = runner.run([PassInput(clean, continuation[1:])], 8)[0].logits
    after_drafted = runner.run([PassInput(drafted, continuation[1:])], 8)[0].logits
    assert torch.equal(after_clean, after_drafted)
    length = runner.cache.lengths[clean]
    assert length == runner.cache.lengths[drafted]
    assert torch.equal(runner.cache.keys[:, clean, :, :length], runner.cache.keys[:, drafted, :, :length])


def test_batched_requests_of_different_lengths_match_single_runs():
    runner = _runner(torch.bfloat16)
    a, b = list(range(2, 20)), list(range(30, 70))
    single = []
    for prompt in (a, b):
        slot = runner.cache.allocate()
        runner.prefill(slot, prompt)
        single.append(runner.run([PassInput(slot, [7, 8, 9])], 3)[0].logits)
        runner.cache.release(slot)
    slots = [runner.cache.allocate(), runner.cache.allocate()]
    for slot, prompt in zip(slots, (a, b), strict=True):
        runner.prefill(slot, prompt)
    batched = runner.run([PassInput(slots[0], [7, 8, 9]), PassInput(slots[1], [7])], 3)
    assert torch.equal(batched[0].logits, single[0])
    assert torch.equal(batched[1].logits, single[1][:1])


def test_release_and_capacity_errors():
    runner = _runner()
    slot = runner.cache.allocate()
    runner.cache.allocate()
    assert runner.cache.free_slots == 0
    try:
        runner.cache.allocate()
        raise AssertionError("allocated past the slot count")
    except RuntimeError:
        pass
    runner.cache.release(slot)
    assert runner.cache.free_slots == 1
