"""Sampled decoding through the whole engine reproduces the target's law, with and without a drafter: the
joint distribution of the first three answer tokens (temperature, top-k and top-p applied) against the
exact one computed from the target's logits. With the drafter, the third token is often the bonus token
of a pass whose draft was accepted. Fixed seeds: the test's outcome is deterministic."""

from __future__ import annotations

import itertools

import pytest
import torch

from specstand.drafters import Draft, Drafter, SequenceView
from specstand.engine import Engine, EngineConfig, Request, quiet_profile
from specstand.runner import PassInput, TargetRunner
from specstand.verification import SamplingParams, target_probs
from tests.conftest import FORWARDS, FixedCost, random_prompts, tiny_decoder

PARAMS = {"temperature": 0.9, "top_k": 4, "top_p": 0.95}
SAMPLES = 2000


def chi2_critical(dof: int, z: float = 3.0902) -> float:
    """The chi-square value exceeded with probability 0.001 (z: the normal 0.999 quantile), by the
    Wilson-Hilferty approximation (within 1% for dof >= 3)."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


class FixedDrafter(Drafter):
    """After the first answer token, proposes the most likely second one (often right, sometimes wrong):
    the second token then comes out of the rejection sampler."""

    name = "fixed"

    def __init__(self, second: dict[int, int]) -> None:
        self.second = second  # first answer token -> the token proposed after it

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        if len(seq.token_ids) != seq.prompt_len + 1 or max_tokens < 1:
            return Draft([])
        return Draft([self.second[seq.token_ids[-1]]])


def likeliest_second_drafter(joint: dict[tuple[int, ...], float]) -> FixedDrafter:
    """A FixedDrafter proposing, after each first token, the second token most likely with it."""
    best: dict[int, tuple[float, int]] = {}
    for (a, b, _), p in joint.items():
        best[a] = max(best.get(a, (0.0, b)), (p, b))
    return FixedDrafter({a: b for a, (_, b) in best.items()})


def exact_joint(model, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """p(a | prompt) p(b | prompt, a) p(c | prompt, a, b) over the support, from the runner the engine uses."""
    runner = TargetRunner(model, 1, 128)
    slot = runner.cache.allocate()

    def law(tokens: list[int]):
        runner.cache.rollback(slot, len(prompt))
        logits = runner.run([PassInput(slot, tokens)], len(tokens))[0].logits[-1]
        return target_probs(logits, params)

    first = target_probs(runner.prefill(slot, prompt).logits[-1], params)
    joint = {}
    for a in torch.nonzero(first).flatten().tolist():
        second = law([a])
        for b in torch.nonzero(second).flatten().tolist():
            third = law([a, b])
            for c in torch.nonzero(third).flatten().tolist():
                joint[a, b, c] = float(first[a] * second[b] * third[c])
    return joint


# plain sampling once; with drafts on the Python forward and on the best kernel path, fixed and adaptive
@pytest.mark.parametrize(("drafted", "forward", "adaptive"), [
    (False, FORWARDS[0], False), (True, FORWARDS[0], False), (True, FORWARDS[-1], False), (True, FORWARDS[-1], True),
])
def test_engine_samples_the_targets_joint_law(drafted, forward, adaptive, monkeypatch):
    # passes priced flat (rows free): adaptive verification keeps every draft position that may be
    # accepted, whatever the machine's timings, so the run is deterministic
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: FixedCost([1], [1.0]))
    model = tiny_decoder("llama", torch.bfloat16 if forward != "python" else torch.float32, forward=forward)
    prompt = random_prompts(1, 20, seed=8)[0]
    params = SamplingParams(**PARAMS)
    joint = exact_joint(model, prompt, params)
    drafter = likeliest_second_drafter(joint) if drafted else None
    engine = Engine(model, drafter, EngineConfig(2, 128, 16, adaptive=adaptive))
    # three tokens asked, so the second step may carry a draft (a pass never drafts past max_tokens)
    results = engine.generate([Request(prompt, 3, SamplingParams(**PARAMS, seed=seed)) for seed in range(SAMPLES)])
    if drafted:
        assert sum(r.stats.accepted_tokens for r in results) > SAMPLES // 10  # verification was exercised
    assert_follows_the_joint_law([r.output_ids for r in results], joint)


def assert_follows_the_joint_law(outputs: list[list[int]], joint: dict[tuple[int, ...], float]) -> None:
    """Chi-square test at the 0.001 level of the answers' first three tokens against `joint`."""
    counts: dict[tuple[int, ...], int] = {}
    for output in outputs:
        key = tuple(output[:3])
        assert key in joint, f"sampled {key}, which has probability 0"
        counts[key] = counts.get(key, 0) + 1
    cells = sorted(joint)
    expected = [joint[c] * len(outputs) for c in cells]
    # pool the rare cells into one, so every expected count is >= 5
    rare = [i for i, e in enumerate(expected) if e < 5]
    observed = [counts.get(c, 0) for c in cells]
    pooled_e = [e for i, e in enumerate(expected) if i not in rare] + [sum(expected[i] for i in rare)]
    pooled_o = [o for i, o in enumerate(observed) if i not in rare] + [sum(observed[i] for i in rare)]
    statistic = sum((o - e) ** 2 / e for o, e in zip(pooled_o, pooled_e, strict=True) if e > 0)
    dof = sum(1 for e in pooled_e if e > 0) - 1
    assert dof >= 3 and statistic < chi2_critical(dof), (statistic, dof, list(itertools.islice(counts.items(), 8)))
