"""Greedy and sampled decoding on the hybrid families (sliding-window attention, short convolutions,
the gated delta rule) stays lossless with drafts: the seed stand's failure was a recurrent state left at
a rejected draft's last row, worst where drafted and undrafted passes alternate."""

from __future__ import annotations

import pytest

from specstand.drafters import make_drafter
from specstand.engine import Engine, EngineConfig, Request, quiet_profile
from specstand.runner.kv_cache import KVCache
from specstand.runner.state_cache import StateCache
from specstand.verification import SamplingParams
from tests.conftest import (
    DTYPES,
    FORWARDS,
    HYBRID_FAMILIES,
    KERNEL_PATHS,
    RECURRENT_FAMILIES,
    TRAINING_FREE,
    FixedCost,
    random_prompts,
    tiny_hybrid,
)
from tests.engine.test_lossless import (
    K,
    ScriptedDrafter,
    assert_every_drafter_answers_as_plain_decoding,
    assert_schema_drafting_answers_as_plain_decoding,
)
from tests.engine.test_sampling import PARAMS, assert_follows_the_joint_law, exact_joint, likeliest_second_drafter


def _engine(model, drafter, max_batch: int = 1, adaptive: bool = True) -> Engine:
    return Engine(model, drafter, EngineConfig(num_speculative_tokens=K, max_seq_len=512, max_batch=max_batch,
                                               adaptive=adaptive))


def _outputs(engine: Engine, prompts: list[list[int]], max_tokens: int = 48) -> list[list[int]]:
    return [r.output_ids for r in engine.generate([Request(p, max_tokens) for p in prompts])]


# fp32 and bf16 on torch's linears, bf16 and Q8_0 blocks on the best compiled linears (every kernel path's
# rows are checked for invariance in tests/runner/test_hybrid.py and tests/kernels)
NUMERICS = list(dict.fromkeys([("fp32", "python"), ("bf16", "python"), ("bf16", FORWARDS[-1])]
                              + [("q8_0", path) for path in KERNEL_PATHS[-1:]]))


def broken_rollback(self: StateCache, slot: int, length: int) -> None:
    """A length-only rollback, as the seed's engine had: the recurrent state stays where the rejected
    draft left it."""
    stale = self.checkpoints[slot].get(self.lengths[slot])
    KVCache.rollback(self, slot, length)
    if stale is not None and length:
        self.checkpoints[slot][length] = stale


@pytest.mark.parametrize(("dtype", "forward"), NUMERICS)
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_every_drafter_is_token_identical_to_plain_greedy(family, dtype, forward):
    model = (tiny_hybrid(family, DTYPES["bf16"], forward=forward, weight_format="q8_0") if dtype == "q8_0"
             else tiny_hybrid(family, DTYPES[dtype], forward=forward))
    assert_every_drafter_answers_as_plain_decoding(model,
                                                   random_prompts(6, 40, seed=3))


@pytest.mark.parametrize("adaptive", [False, True])
def test_schema_drafting_is_token_identical_to_plain_greedy(adaptive, monkeypatch):
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: FixedCost([1, 64], [1.0, 1.1]))
    forced = sum(assert_schema_drafting_answers_as_plain_decoding(tiny_hybrid(family), adaptive)
                 for family in HYBRID_FAMILIES)
    assert forced >= 10


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_alternating_drafted_and_undrafted_passes(family):
    model = tiny_hybrid(family)
    prompts = random_prompts(4, 30, seed=5)
    baseline = _outputs(_engine(model, None), prompts)
    results = _engine(model, ScriptedDrafter(dict(enumerate(baseline))), max_batch=2, adaptive=False).generate(
        [Request(p, 48) for p in prompts])
    assert [r.output_ids for r in results] == baseline
    stats = results[0].stats
    assert 0 < stats.passes_with_draft < stats.target_passes - 1
    assert stats.accepted_tokens < stats.drafted_tokens  # some drafts were rejected and rolled back


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_a_broken_rollback_fails_the_alternating_test(family, monkeypatch):
    """The test above can fail: with a length-only rollback the same run changes answers."""
    model = tiny_hybrid(family)
    prompts = random_prompts(4, 30, seed=5)
    baseline = _outputs(_engine(model, None), prompts)
    monkeypatch.setattr(StateCache, "rollback", broken_rollback)
    drafted = _outputs(_engine(model, ScriptedDrafter(dict(enumerate(baseline))), max_batch=2, adaptive=False), prompts)
    assert drafted != baseline


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_prefix_reuse_over_shared_heads_is_exact(family):
    """Batch 3, prompts of three prefill blocks sharing the first two, reused from the cache (recurrent
    state from its block-boundary checkpoint) while other requests decode."""
    model = tiny_hybrid(family)
    head = random_prompts(1, 150, seed=30)[0]
    prompts = [head + tail for tail in random_prompts(5, 20, seed=31)]
    alone = [_outputs(_engine(model, None), [p], 32)[0] for p in prompts]
    for method in TRAINING_FREE:
        results = _engine(model, make_drafter(method), max_batch=3).generate([Request(p, 32) for p in prompts])
        assert [r.output_ids for r in results] == alone, method
        assert sum(r.stats.cached_prompt_tokens for r in results) >= 4 * 128


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])  # Qwen3-Next's recurrence is Qwen3.5's
def test_sampling_with_drafts_follows_the_targets_joint_law(family):
    model = tiny_hybrid(family)
    prompt = random_prompts(1, 20, seed=8)[0]
    params = SamplingParams(**PARAMS)
    joint = exact_joint(model, prompt, params)
    engine = Engine(model, likeliest_second_drafter(joint), EngineConfig(2, 128, 16, adaptive=False))
    samples = 2000
    results = engine.generate([Request(prompt, 3, SamplingParams(**PARAMS, seed=seed)) for seed in range(samples)])
    assert sum(r.stats.accepted_tokens for r in results) > samples // 10  # verification was exercised
    assert_follows_the_joint_law([r.output_ids for r in results], joint)


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_adaptive_verification_cuts_drafts_not_answers(family, monkeypatch):
    """Adaptive verification keeps a prefix of each draft: rollbacks land anywhere in a pass."""
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: FixedCost([1, 16], [1.0, 1.6]))
    model = tiny_hybrid(family)
    prompts = random_prompts(4, 40, seed=9)
    baseline = _outputs(_engine(model, None), prompts)
    engine = Engine(model, make_drafter("suffix"), EngineConfig(K, 512, 3, adaptive=True))
    results = engine.generate([Request(p, 48) for p in prompts])
    assert [r.output_ids for r in results] == baseline
    assert sum(r.stats.accepted_tokens for r in results) > 0
