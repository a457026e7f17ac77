"""The token-by-token drafters (EAGLE-3, MTP) at inference: verified rows caught up late and for several
requests at once give what keeping up every step gives; the kernel-packed linears stand in for torch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specstand.drafters import HiddenRows, SequenceView
from specstand.drafters.base import join_rows
from specstand.drafters.chain import ChainDrafter, ChainModel
from specstand.drafters.eagle3 import build_eagle3
from specstand.drafters.nn import Attention, DrafterSpec, KernelLinear, pack_for_inference
from specstand.drafters.target_parts import TargetParts
from tests.conftest import FORWARDS

VOCAB, HIDDEN, TAPS = 50, 32, (1, 2, 3)


def _eagle3() -> ChainModel:
    spec = DrafterSpec("eagle3", "tiny", "LlamaForCausalLM", VOCAB, HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, num_layers=1, rms_eps=1e-6, rope_theta=10000.0, tap_layers=list(TAPS),
                       draft_vocab_size=VOCAB)
    torch.manual_seed(0)
    parts = TargetParts(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    return build_eagle3(spec, parts, torch.arange(VOCAB)).eval()


def _rows(start: int, count: int, generator: torch.Generator) -> HiddenRows:
    return HiddenRows(start, {layer: torch.randn(count, HIDDEN, generator=generator) for layer in TAPS})


@pytest.mark.parametrize("forward", FORWARDS)
def test_rows_caught_up_late_and_together_give_what_keeping_up_gives(forward):
    model = _eagle3()
    assert pack_for_inference(model, forward) == forward  # "python": torch's fp32 linears
    eager, lazy = ChainDrafter(model, "eagle3"), ChainDrafter(model, "eagle3")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (11,), generator=generator).tolist() for _ in range(3)]  # + 1st answer token
    seqs = {name: [SequenceView(r, list(prompts[r]), 10) for r in range(3)] for name in ("eager", "lazy")}
    for drafter, name in ((eager, "eager"), (lazy, "lazy")):
        for seq in seqs[name]:
            drafter.begin(seq)
    covered = [0, 0, 0]
    for step in range(5):
        for r in range(3):
            # the prompt first (10 rows), then 1..4 verified rows a step, different per request
            count = 10 if step == 0 else 1 + (step + r) % 4
            tokens = torch.randint(0, VOCAB, (0 if step == 0 else count,), generator=generator).tolist()
            hidden = _rows(covered[r], count, generator)
            covered[r] += count
            for drafter, name in ((eager, "eager"), (lazy, "lazy")):
                seqs[name][r].token_ids.extend(tokens)
                drafter.extend(seqs[name][r], tokens, hidden)
        eager_drafts = eager.propose_many(seqs["eager"], [4, 4, 4])  # keeps up every step
    lazy_drafts = lazy.propose_many(seqs["lazy"], [4, 4, 4])  # one catch-up over 4-5 steps of 3 requests
    assert [d.tokens for d in lazy_drafts] == [d.tokens for d in eager_drafts]
    for r in range(3):
        torch.testing.assert_close(lazy._last[r], eager._last[r], atol=1e-5, rtol=1e-5)
        for lazy_kv, eager_kv in zip(lazy._past[r], eager._past[r], strict=True):
            assert lazy_kv.shape[1] == covered[r]
            torch.testing.assert_close(lazy_kv, eager_kv, atol=1e-5, rtol=1e-5)


def test_a_request_drafts_from_its_verified_rows_only():
    model = _eagle3()
    drafter = ChainDrafter(model, "eagle3")
    seq = SequenceView(0, list(range(11)), 10)
    drafter.begin(seq)
    assert drafter.propose(seq, 3).tokens == []  # nothing verified yet: no draft
    prompt = _rows(0, 10, torch.Generator().manual_seed(2))
    drafter.extend(seq, [], prompt)
    first = drafter.propose(seq, 3)
    assert len(first.tokens) == 3 and drafter.propose(seq, 3).tokens == first.tokens
    # row j read the hidden state at j and token j + 1, causally
    causal = torch.zeros(10, 10).masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        _, taps = join_rows([prompt], TAPS)
        out, _ = model.step(torch.tensor(seq.token_ids[1:11]), model.features(taps), torch.arange(10), causal, None)
    torch.testing.assert_close(drafter._last[0], out[-1:], atol=1e-5, rtol=1e-5)


def test_segments_attend_causally_over_their_own_past_only():
    """attend_segments against Attention.forward run per segment with an explicit causal mask."""
    model = _eagle3()
    attention: Attention = model.layers[0].self_attn
    generator = torch.Generator().manual_seed(3)
    sizes, before = [3, 1, 4], [5, 0, 2]
    pasts = [None if n == 0 else (torch.randn(2, n, 8, generator=generator), torch.randn(2, n, 8, generator=generator))
             for n in before]
    x = torch.randn(sum(sizes), 2 * HIDDEN, generator=generator)
    positions = torch.cat([n + torch.arange(size) for n, size in zip(before, sizes, strict=True)])
    with torch.no_grad():
        out, _ = attention.attend_segments(x, positions, pasts, sizes, causal=True)
        start = 0
        for past, n, size in zip(pasts, before, sizes, strict=True):
            rows = slice(start, start + size)
            start += size
            visible = torch.arange(n + size)[None, :] <= n + torch.arange(size)[:, None]
            bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
            expected, _ = attention(x[rows], positions[rows], bias, past)
            torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("forward", FORWARDS)
def test_packing_keeps_the_state_dict_and_stays_close_to_the_fp32_layer(forward):
    model, reference = _eagle3(), _eagle3()
    path = pack_for_inference(model, forward)
    assert path == forward
    assert model.state_dict().keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, atol=0, rtol=0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear | KernelLinear)]
    if path == "python":  # no kernels here: torch's linears stay
        assert all(type(m) is nn.Linear for m in linears)
        return
    assert linears and all(type(m) is KernelLinear for m in linears) and model.target.packed_head is not None
    generator = torch.Generator().manual_seed(4)
    taps, tokens = torch.randn(6, 3 * HIDDEN, generator=generator), torch.randint(0, VOCAB, (6,), generator=generator)
    with torch.no_grad():
        got = model.logits(model.step(tokens, model.features(taps), torch.arange(6), None, None)[0])
        want = reference.logits(reference.step(tokens, reference.features(taps), torch.arange(6), None, None)[0])
    # bf16 weights (and, on bf16 dot-product paths, activations) against fp32: within bf16's rounding
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())


def _dense_training_hidden(model: ChainModel, taps, tokens, positions, docs, steps: int) -> list[torch.Tensor]:
    """The training-time test as first written: every row at every step, dense T x sT masks (the reference)."""
    count = len(tokens)
    index = torch.arange(count)
    same_doc = docs[:, None] == docs[None, :]
    next_tokens = torch.cat([tokens[1:], tokens[-1:]])
    feature = model.features(taps)
    keys, values, outputs = [], [], []
    for s in range(1, steps + 1):
        blocks = [(index[None, :] <= index[:, None] - s + 1) & same_doc]
        blocks += [(index[None, :] == index[:, None] - (s - t)) & same_doc for t in range(2, s + 1)]
        bias = torch.zeros(count, count * s).masked_fill(~torch.cat(blocks, dim=1), float("-inf"))
        past = (torch.cat(keys, 1), torch.cat(values, 1)) if keys else None
        hidden, (k, v) = model.step(next_tokens, feature, positions, bias, past)
        keys.append(k)
        values.append(v)
        outputs.append(hidden)
        feature = torch.cat([hidden[:1], hidden[:-1]])
    return outputs


def _pack(generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Two packed documents of 14 and 10 rows."""
    docs = torch.tensor([0] * 14 + [1] * 10)
    positions = torch.cat([torch.arange(14), torch.arange(10)])
    tokens = torch.randint(0, VOCAB, (24,), generator=generator)
    taps = torch.randn(24, len(TAPS) * HIDDEN, generator=generator)
    return taps, tokens, positions, docs


@pytest.mark.parametrize("share", [1.0, 0.3])
def test_the_training_time_test_of_scored_rows_equals_the_dense_masks(share):
    """Only the scored rows (and their chains' earlier steps) are computed, over a document-packed row:
    the outputs and the gradients they send equal the dense construction's."""
    generator = torch.Generator().manual_seed(3)
    taps, tokens, positions, docs = _pack(generator)
    steps = 4
    scored = []
    for s in range(1, steps + 1):
        index = torch.arange(24)
        anchor = index - s + 1
        inside = (anchor >= 0) & (docs[anchor.clamp_min(0)] == docs)
        scored.append(torch.nonzero(inside & (torch.rand(24, generator=generator) < share)).flatten())
    weights = [torch.randn(24, HIDDEN, generator=generator) for _ in range(steps)]
    grads = []
    for build in ("sparse", "dense"):
        model = _eagle3().train()
        if build == "sparse":
            hidden = model.training_hidden(taps, tokens, positions, docs, scored)
        else:
            hidden = _dense_training_hidden(model, taps, tokens, positions, docs, steps)
        picked = [h[rows] for h, rows in zip(hidden, scored, strict=True)]
        loss = sum((p * w[rows]).sum() for p, w, rows in zip(picked, weights, scored, strict=True))
        loss.backward()
        grads.append(([p.detach() for p in picked], {n: q.grad.clone() for n, q in model.named_parameters()
                                                     if q.grad is not None}))
    (sparse, sparse_grads), (dense, dense_grads) = grads
    for a, b in zip(sparse, dense, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sparse_grads.keys() == dense_grads.keys()
    for name in dense_grads:
        torch.testing.assert_close(sparse_grads[name], dense_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_scored_chain_must_start_in_its_document():
    taps, tokens, positions, docs = _pack(torch.Generator().manual_seed(4))
    model = _eagle3()
    with pytest.raises(ValueError, match="step 2"):  # row 14 starts document 1: its step-2 chain starts at row 13
        model.training_hidden(taps, tokens, positions, docs, [torch.tensor([3]), torch.tensor([14])])
