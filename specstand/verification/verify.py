"""Accept or reject a draft against the target's outputs at the draft positions.

For a draft x_1..x_k the target pass gives distributions p_1..p_{k+1} (p_i predicts the token at draft
position i; p_{k+1} follows a fully accepted draft). Greedy keeps the longest prefix equal to argmax and
then emits the argmax at the first mismatch. Sampling follows Leviathan et al. / Chen et al.: accept x_i
with probability min(1, p_i(x_i) / q_i(x_i)); on rejection draw from normalize(max(p_i - q_i, 0)); after
a full acceptance draw a bonus token from p_{k+1}. The emitted tokens are then distributed exactly as
sampling from the target alone, whatever q is. A draft without probabilities is a one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstand.verification.sampling import SamplingParams, target_probs


@dataclass
class Verdict:
    accepted: int  # how many draft tokens were accepted
    tokens: list[int]  # the accepted draft tokens followed by one target token (correction or bonus)


def verify(draft: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator) -> Verdict:
    """The verdict on `draft` from the target's `logits` [len(draft) + 1, V] under the request's sampling."""
    if params.greedy:
        return verify_greedy(draft, logits)
    return verify_sampled(draft, draft_probs, target_probs(logits, params), generator)


def verify_greedy(draft: list[int], logits: torch.Tensor) -> Verdict:
    """`logits` [len(draft) + 1, V]."""
    choices = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choices[accepted]:
        accepted += 1
    return Verdict(accepted, draft[:accepted] + [choices[accepted]])


def verify_sampled(
    draft: list[int],
    draft_probs: torch.Tensor | None,
    probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """`probs` [len(draft) + 1, V] target distributions; `draft_probs` [len(draft), V] or None (one-hot)."""
    for i, token in enumerate(draft):
        p = probs[i]
        q = _one_hot(token, p) if draft_probs is None else draft_probs[i].to(p.dtype)
        accept_ratio = min(1.0, (p[token] / q[token]).item()) if q[token] > 0 else 0.0
        if torch.rand((), generator=generator, dtype=torch.float64).item() < accept_ratio:
            continue
        residual = (p - q).clamp_min(0.0)
        total = residual.sum()
        # residual is 0 only where p <= q everywhere, i.e. p == q; then the token was accepted surely
        corrected = residual / total if total > 0 else p
        return Verdict(i, draft[:i] + [_draw(corrected, generator)])
    return Verdict(len(draft), draft + [_draw(probs[len(draft)], generator)])


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())
