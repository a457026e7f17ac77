"""The hybrid families' forwards (Gemma 3, LFM2, Qwen3.5) against the transformers modules, and the
state cache's exact rollback."""

from __future__ import annotations

import copy

import pytest
import torch

from specstand.runner import PassInput, TargetRunner
from specstand.runner.exactness import row_unit
from specstand.runner.hybrid import HybridModel
from tests.conftest import HYBRID_FAMILIES, KERNEL_PATHS, RECURRENT_FAMILIES, VOCAB, tiny_hybrid_hf_model

# fp32 logits of a tiny model against transformers' own forward: the same math in another order (our
# fp32 RoPE and token-by-token recurrences against its chunked ones)
LOGIT_BOUND = 1e-5


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_logits_match_transformers_over_prompt_and_decode_passes(family):
    hf = tiny_hybrid_hf_model(family)
    runner = TargetRunner(HybridModel(hf, 256), 1, 256)
    tokens = _tokens(90, seed=1)
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0].float()
    slot = runner.cache.allocate()
    logits = [runner.prefill(slot, tokens[:70]).logits]  # a full prefill block, then part of one
    position = 70
    for width in (1, 3, 2, 5, 1, 4, 3):  # decode and verify-sized passes
        logits.append(runner.run([PassInput(slot, tokens[position : position + width])], 5)[0].logits)
        position += width
    got = torch.cat(logits)
    assert got.shape[0] == position - 69
    assert (got - reference[69:position]).abs().max() < LOGIT_BOUND


def rolled_back_and_clean(runner: TargetRunner, tokens: list[int], prompt: int, kept: int,
                          width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the next pass in a slot whose verify pass kept `kept` of `width` rows (the rest rejected
    and rolled back), and in a slot that only ever saw the kept ones."""
    rolled, clean = runner.cache.allocate(), runner.cache.allocate()
    for slot in (rolled, clean):
        runner.prefill(slot, tokens[:prompt])
    accepted = tokens[prompt : prompt + kept]
    runner.run([PassInput(rolled, accepted + [5] * (width - kept))], width)
    runner.cache.rollback(rolled, prompt + kept)
    runner.run([PassInput(clean, accepted)], width)
    after = tokens[prompt + kept : prompt + kept + 4]
    return tuple(runner.run([PassInput(slot, after)], width)[0].logits for slot in (rolled, clean))


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_rollback_restores_the_state_of_the_last_kept_row(family):
    """A verify pass of 5 rows kept 2 then continued: logits equal a run that never saw the 3 others."""
    runner = TargetRunner(HybridModel(tiny_hybrid_hf_model(family), 256), 2, 256)
    rolled, clean = rolled_back_and_clean(runner, _tokens(40, seed=2), 30, 2, 5)
    assert torch.equal(rolled, clean)


def test_rollback_to_a_length_without_a_state_is_refused():
    runner = TargetRunner(HybridModel(tiny_hybrid_hf_model("lfm2"), 256), 1, 256)
    slot = runner.cache.allocate()
    runner.prefill(slot, _tokens(100, seed=3))  # a long prompt keeps block boundaries and its end only
    with pytest.raises(ValueError, match="no recurrent state at length 70"):
        runner.cache.rollback(slot, 70)
    runner.cache.rollback(slot, 64)  # a block boundary: kept for prefix reuse
    assert runner.cache.reusable_length(slot, 99, 64) == 64


def test_sliding_window_layers_see_only_their_window():
    """Gemma's sliding layers ignore keys older than the window: changing them leaves the logits of a
    late position unchanged only where every layer slides (the tiny twin has one global layer, so the
    global layer is made to slide too for this check)."""
    hf = tiny_hybrid_hf_model("gemma3")
    model = HybridModel(hf, 256)
    for layer in model.weights.layers:
        layer.mixer.window = 8
    runner = TargetRunner(model, 2, 256)
    base = _tokens(40, seed=4)
    changed = [(t + 1) % VOCAB for t in base[:10]] + base[10:]  # differs only far outside every window
    out = []
    for tokens in (base, changed):
        slot = runner.cache.allocate()
        out.append(runner.prefill(slot, tokens).logits)
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("forward", KERNEL_PATHS)
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_compiled_linears_keep_bf16_close_and_rows_invariant(family, forward):
    """bf16 logits through the compiled linears are about as close to the fp32 module as transformers'
    own bf16 forward (within 1.25x of its error), and a row computes the same in passes of 1..16 rows
    (row_unit 1 at K = 15, where torch's bf16 linears need padding on some CPUs)."""
    hf = tiny_hybrid_hf_model(family)
    tokens = _tokens(60, seed=5)
    with torch.no_grad():
        exact = hf(torch.tensor([tokens])).logits[0, 39:59]
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([tokens])).logits[0, 39:59].float()
    model = HybridModel(copy.deepcopy(hf).to(torch.bfloat16), 256)
    assert model.attach_kernels(forward) == forward
    runner = TargetRunner(model, 2, 256)
    slot = runner.cache.allocate()
    logits = [runner.prefill(slot, tokens[:40]).logits]
    for position in range(40, 59, 4):
        logits.append(runner.run([PassInput(slot, tokens[position : position + 4])], 4)[0].logits)
    ours = torch.cat(logits)[:19]
    assert (ours - exact[:19]).abs().max() <= 1.25 * (theirs[:19] - exact[:19]).abs().max()
    runner.cache.release(slot)
    assert row_unit(runner, 16) == 1
