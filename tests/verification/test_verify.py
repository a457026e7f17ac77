"""The rejection sampler must reproduce the target distribution exactly, whatever the draft."""

import pytest
import torch

from specstand.verification import SamplingParams, target_probs, verify_greedy, verify_sampled

# chi-square critical values at p = 0.001
CHI2_CRITICAL = {5: 20.52, 8: 26.12, 24: 51.18}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 2]):
        logits[row, best] = 1.0
    assert verify_greedy([3, 5, 9], logits).tokens == [3, 5, 7]
    assert verify_greedy([3, 5, 7], logits).tokens == [3, 5, 7, 2]
    assert verify_greedy([4], logits).accepted == 0
    assert verify_greedy([], logits).tokens == [3]


@pytest.mark.parametrize("soft_draft", [False, True])
def test_first_token_follows_target(soft_draft):
    generator = torch.Generator().manual_seed(0)
    vocab, trials = 6, 30_000
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.4, 0.1, 0.1, 0.1, 0.2, 0.1], dtype=torch.float64)
    probs = torch.stack([p, torch.full((vocab,), 1 / vocab, dtype=torch.float64)])
    counts = torch.zeros(vocab)
    for _ in range(trials):
        if soft_draft:
            token = int(torch.multinomial(q, 1, generator=generator))
            verdict = verify_sampled([token], q[None], probs, generator)
        else:  # a one-hot drafter always proposing token 0, the unlikely one
            verdict = verify_sampled([0], None, probs, generator)
        counts[verdict.tokens[0]] += 1
    assert chi_square(counts, p) < CHI2_CRITICAL[5]


def test_two_step_joint_distribution_with_markov_target():
    """Emit two tokens by draft-and-verify steps against a Markov target; the joint law must be the
    target's p(a | s) p(b | a), whatever the (deliberately bad) draft distribution is."""
    generator = torch.Generator().manual_seed(1)
    vocab = 3
    target = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1]], dtype=torch.float64)
    draft = torch.tensor([[0.1, 0.1, 0.8], [0.7, 0.2, 0.1], [0.3, 0.3, 0.4]], dtype=torch.float64)
    start = 0
    counts = torch.zeros(vocab, vocab)
    for _ in range(20_000):
        emitted = []
        while len(emitted) < 2:
            prev = emitted[-1] if emitted else start
            proposal, dists = [], []
            for _ in range(2):  # draft 2 tokens from the draft model
                d = draft[proposal[-1] if proposal else prev]
                proposal.append(int(torch.multinomial(d, 1, generator=generator)))
                dists.append(d)
            contexts = [prev, *proposal]
            verdict = verify_sampled(proposal, torch.stack(dists), target[contexts], generator)
            emitted.extend(verdict.tokens)
        counts[emitted[0], emitted[1]] += 1
    joint = target[start][:, None] * target
    assert chi_square(counts.flatten(), joint.flatten()) < CHI2_CRITICAL[8]


def test_target_probs_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    top_k = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top_k[0, 2:] == 0).all() and torch.isclose(top_k.sum(), torch.tensor(1.0, dtype=torch.float64))
    full = target_probs(logits, SamplingParams(temperature=1.0))
    top_p = target_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0, 0]) + 1e-6))
    assert (top_p[0, :2] > 0).all() and (top_p[0, 2:] == 0).all()
    cold = target_probs(logits, SamplingParams(temperature=0.1))
    assert cold[0, 0] > full[0, 0]


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
