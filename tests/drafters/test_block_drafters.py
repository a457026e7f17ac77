"""DSpark and DFlash 2 beside DFlash: their heads, their sampled draft distributions, and the engine's law
with them. Training, acceptance and greedy losslessness of every trained method: tests/training."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from specstand.drafters import HiddenRows, SequenceView, make_drafter
from specstand.drafters.dflash import DFlashDrafter, DFlashModel
from specstand.drafters.dflash2 import CandidateSelector, DFlash2Model, GroupedDynamicConv
from specstand.drafters.nn import DrafterSpec, draw_drafts
from specstand.drafters.target_parts import TargetParts
from specstand.drafters.trained import load_drafter_model
from specstand.engine import Engine, EngineConfig, Request
from specstand.training.data import load_rows
from specstand.training.losses import acceptance_rate, dspark_loss
from specstand.verification import SamplingParams
from tests.conftest import LONG_RUN
from tests.engine.test_sampling import PARAMS, SAMPLES, assert_follows_the_joint_law, exact_joint


def _model(trained, target, method: str):
    weights = target.decoder.weights
    return load_drafter_model(trained[method, LONG_RUN], weights.embed_tokens, weights.lm_head)


def test_q_on_the_target_vocabulary_is_the_law_of_the_drawn_token():
    """Columns that map to one target id are one token: q there is their sum (a copy kept only the last)."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    _, q = draw_drafts(logits, 1.0, torch.Generator().manual_seed(0), torch.tensor([2, 2, 0]), 4)
    assert torch.allclose(q, torch.tensor([[0.25, 0.0, 0.75, 0.0]]))


@pytest.mark.parametrize("method", ["dspark", "dflash2"])
def test_sampled_drafts_carry_proper_distributions(method, trained, tiny_target):
    model = _model(trained, tiny_target, method)
    hidden = torch.randn(model.num_drafts, model.spec.hidden_size)
    draft = model.draft(hidden, anchor=5, temperature=0.8, generator=torch.Generator().manual_seed(0))
    assert draft.probs is not None and draft.probs.shape == (model.num_drafts, model.spec.target_vocab_size)
    assert bool((draft.probs >= 0).all())
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(model.num_drafts), atol=1e-5, rtol=0)
    for i, token in enumerate(draft.tokens):  # every drafted token could have been drawn
        assert draft.probs[i, token] > 0
    support = (draft.probs > 0).sum(-1)
    if method == "dflash2":  # the selector's q lives on its 16 candidates
        assert bool((support <= model.spec.selector_top_k).all())
    else:  # the Markov-corrected softmax covers the draft vocabulary
        assert bool((support == model.spec.draft_vocab_size).all())
    greedy = model.draft(hidden, anchor=5, temperature=0.0, generator=torch.Generator())
    assert greedy.probs is None and len(greedy.tokens) == model.num_drafts


@pytest.mark.parametrize("method", ["dflash", "dspark", "dflash2", "eagle3", "mtp"])
def test_engine_samples_the_targets_law_with_sampled_drafts(method, trained, tiny_target, tiny_data):
    """The chi-square test of tests/engine/test_sampling.py with a trained drafter whose drafts are
    drawn from its own q (not one-hot): the rejection rule with that q must still give the target's law."""
    decoder = tiny_target.decoder
    prompt = next(r.prompt_ids for r in load_rows(tiny_data)[1] if r.split == "train")
    params = SamplingParams(**PARAMS)
    joint = exact_joint(decoder, prompt, params)
    drafter = make_drafter(method, decoder, drafter_path=trained[method, LONG_RUN])
    drafts_with_q = []
    propose_many = drafter.propose_many
    drafter.propose_many = lambda seqs, ks: drafts_with_q.extend(propose_many(seqs, ks)) or drafts_with_q[-len(seqs):]
    engine = Engine(decoder, drafter, EngineConfig(2, 128, 16, adaptive=False))
    results = engine.generate([Request(prompt, 3, SamplingParams(**PARAMS, seed=seed)) for seed in range(SAMPLES)])
    assert drafts_with_q and all(d.probs is not None for d in drafts_with_q if d.tokens)
    # verification was exercised (a drawn draft lands outside the target's top-k more often than an argmax)
    assert sum(r.stats.accepted_tokens for r in results) > SAMPLES // 20
    assert_follows_the_joint_law([r.output_ids for r in results], joint)


def test_an_untrained_dflash2_is_the_dflash_it_starts_from(trained, tiny_target):
    """Identity convolutions and a zero successor codebook: a DFlash checkpoint loaded into DFlash 2 drafts
    the same tokens from the same hidden states."""
    dflash = _model(trained, tiny_target, "dflash")
    spec = replace(dflash.spec, method="dflash2", conv_kernel_size=2, selector_rank=8)
    weights = tiny_target.decoder.weights
    dflash2 = DFlash2Model(spec, TargetParts(weights.embed_tokens, weights.lm_head), dflash.d2t)
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
    b = spec.block_size
    tokens = torch.full((b,), spec.mask_token_id)
    tokens[0] = 7
    positions = 30 + torch.arange(b)
    context = dflash.context(torch.randn(30, len(spec.tap_layers) * spec.hidden_size))
    past = dflash.context_keys_values(context, torch.arange(30))
    hidden = dflash.block_hidden(tokens, positions, past, None)
    torch.testing.assert_close(dflash2.block_hidden(tokens, positions, past, None), hidden)
    generator = torch.Generator()
    assert dflash2.draft(hidden[1:], 7, 0.0, generator).tokens == dflash.draft(hidden[1:], 7, 0.0, generator).tokens


def test_dynamic_convolution_is_causal_within_a_block_and_never_crosses_one():
    torch.manual_seed(0)
    conv = GroupedDynamicConv(hidden=32, taps=2, group=16)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, 4, 32)  # two blocks of four rows
    out = conv(x, conv.deltas(x), 0)
    changed = x.clone()
    changed[0, 2] += 1.0  # a later row of block 0
    out_changed = conv(changed, conv.deltas(changed), 0)
    assert torch.equal(out_changed[0, :2], out[0, :2])  # earlier rows never see it
    assert not torch.equal(out_changed[0, 3], out[0, 3])  # the next row does (tap 1)
    assert torch.equal(out_changed[1], out[1])  # nor does another block
    # by hand: row 1, channel 0, input side
    deltas = conv.deltas(x)
    kernel = conv.base_kernel[0, :, 0] + deltas[0, 1, 0, :, 0]
    torch.testing.assert_close(out[0, 1, 0], kernel[0] * x[0, 1, 0] + kernel[1] * x[0, 0, 0])


def test_the_candidate_rankers_gradient_is_the_same_every_time():
    """Many rows share a codebook row; their gradients must add in one order whatever the threads do, or two
    trainings on the same data drift apart (an indexed tensor's backward on 2 threads did)."""
    selector = CandidateSelector(hidden=16, draft_vocab=64, rank=256)
    generator = torch.Generator().manual_seed(0)
    unary, hidden = torch.randn(512, 16, generator=generator), torch.randn(512, 16, generator=generator)
    candidates = torch.randint(0, 64, (512, 16), generator=generator)
    prev_rows = torch.randint(0, 65, (512,), generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        grads = set()
        for _ in range(20):
            selector.zero_grad(set_to_none=True)
            selector.edge_scores(unary, candidates, hidden, prev_rows).square().sum().backward()
            grads.add(b"".join(p.grad.numpy().tobytes() for p in selector.parameters()))
    finally:
        torch.set_num_threads(threads)
    assert len(grads) == 1


def test_the_confidence_target_is_one_minus_total_variation():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    # TV = (|0.3| + 0 + |0.3|) / 2 = 0.3; sum of min(p, q) = 0.2 + 0.3 + 0.2 = 0.7
    torch.testing.assert_close(acceptance_rate(p, q), torch.tensor(0.7))
    # with only the BCE term, the loss is the BCE of the head's logit against that 0.7
    logits = q.log()[None, None]
    confidence = torch.tensor([[0.4]])
    loss, _ = dspark_loss(logits, p[None, None], torch.tensor([[0]]), torch.tensor([[True]]), torch.ones(1),
                          confidence, ce_weight=0.0, l1_weight=0.0)
    torch.testing.assert_close(loss, F.binary_cross_entropy_with_logits(torch.tensor(0.4), torch.tensor(0.7)))


def test_the_markov_walk_conditions_each_position_on_the_token_chosen_before_it(trained, tiny_target):
    """A hand-set Markov head that maps draft id i to i + 1 overrides flat unary logits: the greedy walk
    from anchor d2t[3] must then draft d2t[4], d2t[5], ..."""
    model = _model(trained, tiny_target, "dspark")
    rank, vocab = model.spec.markov_rank, model.spec.draft_vocab_size
    with torch.no_grad():
        model.markov_head.markov_w1.weight.zero_()
        model.markov_head.markov_w2.weight.zero_()
        for i in range(min(rank, vocab - 1)):
            model.markov_head.markov_w1.weight[i, i] = 1.0
            model.markov_head.markov_w2.weight[i + 1, i] = 1000.0
    drafts = model.draft(torch.zeros(4, model.spec.hidden_size), int(model.d2t[3]), 0.0, torch.Generator())
    assert drafts.tokens == model.d2t[4:8].tolist()
    assert isinstance(model, DFlashModel) and drafts.calibrated


@pytest.mark.parametrize("method", ["dflash", "dspark", "dflash2", "eagle3", "mtp"])
def test_one_batched_drafter_pass_drafts_what_separate_passes_draft(method, trained, tiny_target):
    """propose_many runs every request's block (or chain step) through one pass, attention still per
    request: the same drafts as one propose per request, for requests with contexts of different lengths."""
    from specstand.drafters import HiddenRows, SequenceView

    drafter = make_drafter(method, tiny_target.decoder, drafter_path=trained[method, LONG_RUN])
    torch.manual_seed(3)
    seqs = []
    for request_id, length in enumerate((9, 23, 15)):
        seq = SequenceView(request_id, torch.randint(2, 90, (length,)).tolist(), length - 4)
        drafter.begin(seq)
        taps = {t: torch.randn(length - 1, 64) for t in drafter.tap_layers}
        drafter.extend(seq, seq.token_ids[-1:], HiddenRows(0, taps))
        seqs.append(seq)
    budgets = [5, 0, 3]
    batched = drafter.propose_many(seqs, budgets)
    alone = [drafter.propose(seq, k) if k else None for seq, k in zip(seqs, budgets, strict=True)]
    assert [len(d.tokens) for d in batched] == [5, 0, 3]
    for many, one in zip(batched, alone, strict=True):
        if one is not None:
            assert many.tokens == one.tokens
            torch.testing.assert_close(torch.tensor(many.confidence), torch.tensor(one.confidence),
                                       atol=1e-4, rtol=1e-4)


def test_contexts_caught_up_together_equal_contexts_caught_up_one_request_at_a_time():
    spec = DrafterSpec("dflash", "tiny", "LlamaForCausalLM", 50, 32, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, num_layers=2, rms_eps=1e-6, rope_theta=10000.0, tap_layers=[1, 2, 3],
                       draft_vocab_size=50, block_size=4, mask_token_id=0)
    torch.manual_seed(0)
    model = DFlashModel(spec, TargetParts(torch.randn(50, 32), torch.randn(50, 32)), torch.arange(50)).eval()
    together, alone = DFlashDrafter(model), DFlashDrafter(model)
    generator = torch.Generator().manual_seed(1)
    seqs = [SequenceView(r, torch.randint(1, 50, (12 + r,), generator=generator).tolist(), 10) for r in range(3)]
    for seq in seqs:
        together.begin(seq)
        alone.begin(seq)
    for seq in seqs:  # request r: a prompt of 10 + r rows, then a verified row, before any proposal
        prompt = 10 + seq.request_id
        for start, count in ((0, prompt), (prompt, 1)):
            hidden = HiddenRows(start, {layer: torch.randn(count, 32, generator=generator) for layer in (1, 2, 3)})
            together.extend(seq, [], hidden)
            alone.extend(seq, [], hidden)
    drafts = together.propose_many(seqs, [3, 3, 3])  # one catch-up for all three
    assert [d.tokens for d in drafts] == [alone.propose(seq, 3).tokens for seq in seqs]
    for seq in seqs:
        for (k1, v1), (k2, v2) in zip(together._context[seq.request_id], alone._context[seq.request_id], strict=True):
            assert k1.shape[1] == 11 + seq.request_id
            torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
