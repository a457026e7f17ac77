"""Adaptive verification: the budget rule, the acceptance estimate, and answers that never change."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from specstand.drafters import Draft, Drafter, SequenceView, make_drafter
from specstand.engine import DecodeStats, Engine, EngineConfig, Request, quiet_profile
from specstand.engine import engine as engine_module
from specstand.engine.adaptive import AcceptanceModel, AdaptiveVerifier, PassCost, choose_budget, profile_pass_cost
from tests.conftest import FORWARDS, TRAINING_FREE, FixedCost, random_prompts, tiny_decoder


def test_budget_takes_the_positions_that_pay_for_their_rows():
    survival = [np.array([0.9, 0.8]), np.array([0.1])]
    assert choose_budget(survival, lambda rows, keys: 1.0, 0.0) == [2, 1]  # rows are free: verify everything
    assert choose_budget(survival, lambda rows, keys: float(rows), 0.0) == [0, 0]  # a row costs a whole pass
    # 1 + 0.1 r: B=0 2/1.2, B=1 2.9/1.3, B=2 3.7/1.4 (best), B=3 3.8/1.5
    assert choose_budget(survival, lambda rows, keys: 1.0 + 0.1 * rows, 0.0) == [2, 0]


def test_a_long_context_makes_a_draft_row_cost_more():
    # cost 1 + 0.002 per row-key: with 1000 cached positions B=0 gives 1 / 3, B=1 1.5 / 5 (worse);
    # with 10, B=0 1 / 1.02, B=1 1.5 / 1.04 (better)
    def cost(rows, keys):
        return 1.0 + 0.002 * keys

    assert choose_budget([np.array([0.5])], cost, 0.0, [1000]) == [0]
    assert choose_budget([np.array([0.5])], cost, 0.0, [10]) == [1]


def test_pass_cost_interpolates_between_profiled_rows_and_follows_measured_passes():
    cost = PassCost([1, 2, 4, 8], [1.0, 1.0, 1.2, 2.0], per_key=0.001)
    assert cost(3) == pytest.approx(1.1) and cost(6) == pytest.approx(1.6) and cost(16) == 2.0
    assert cost(6, keys=600) == pytest.approx(2.2)
    for _ in range(100):  # the machine got twice as slow as when it was profiled: the scale takes it at once
        cost.observe(8, 4.0)
    assert cost(8) == pytest.approx(4.0, rel=0.01) and cost(1) == pytest.approx(2.0, rel=0.01)
    for _ in range(800):  # one-row passes too: what 8 rows alone could not tell apart from a shape is settled
        cost.observe(1, 2.0)
        cost.observe(8, 4.0)
    assert cost(1) == pytest.approx(2.0, rel=0.01) and cost(6) == pytest.approx(3.2, rel=0.01)


def test_pass_cost_corrects_a_profile_shape_taken_on_a_busy_machine():
    """Profiled while other servers loaded the CPU, 8 rows looked three times what they cost: plain one-row
    passes and 8-row verifies that disagree with that shape bring it back, and every row count's cost ends
    where the passes put it."""
    cost = PassCost([1, 2, 4, 8], [1.0, 1.0, 1.2, 6.0])
    for _ in range(800):  # at about 25 passes a second, about a minute of serving
        cost.observe(1, 1.0)
        cost.observe(8, 2.0)
    assert cost(1) == pytest.approx(1.0, rel=0.01) and cost(8) == pytest.approx(2.0, rel=0.01)
    assert cost(4) == pytest.approx(1.2, rel=0.01)  # never run: left as profiled
    assert cost.seconds == sorted(cost.seconds)  # more rows never cheaper


def test_pass_cost_shape_does_not_wander_with_timing_noise():
    """Passes timed with +-30% noise: the shape only moves on passes measured against a recent one-row pass,
    toward the ratio they show, so noise averages out instead of adding up (a shape moved by every pass's
    residual drifted until 8 rows looked as cheap as 4)."""
    rng = random.Random(0)
    alone = PassCost([1, 2, 4, 8], [1.0, 1.0, 1.2, 2.0])
    for _ in range(20000):  # only 8-row passes: nothing to tell a shape from the scale, so the shape stays
        alone.observe(8, 2.0 * (1 + rng.uniform(-0.3, 0.3)))
    assert alone.seconds == [1.0, 1.0, 1.2, 2.0]
    mixed = PassCost([1, 2, 4, 8], [1.0, 1.0, 1.2, 6.0])
    for _ in range(20000):
        mixed.observe(1, 1.0 * (1 + rng.uniform(-0.3, 0.3)))
        mixed.observe(8, 2.0 * (1 + rng.uniform(-0.3, 0.3)))
    assert mixed(8) / mixed(1) == pytest.approx(2.0, rel=0.05)


def test_profile_measures_rows_and_the_attention_term():
    def run_pass(rows, cached):  # a pass whose cost is known: 1 ms + 0.1 ms a row + 10 us a row-key
        time.sleep(0.001 + 0.0001 * rows + 0.00001 * rows * cached)

    cost = profile_pass_cost(run_pass, 8, 1000, repeats=3)
    assert cost.rows == [1, 2, 4, 8]
    assert cost.per_key == pytest.approx(1e-5, rel=0.2)  # 80 ms of attention against sleeps' jitter


def test_acceptance_model_learns_what_the_confidence_signal_means():
    rng = np.random.default_rng(0)
    model = AcceptanceModel(refit_every=50)
    assert model.probabilities([5.0])[0] == model.prior
    for _ in range(400):
        confidence = rng.normal(0.0, 2.0, size=4).tolist()
        accepted = next((i for i, c in enumerate(confidence) if c + rng.normal(0.0, 0.5) < 0), 4)
        model.observe(confidence, 4, accepted)
    high, low = model.probabilities([4.0, -4.0])
    assert high > 0.9 and low < 0.1


def test_a_calibrated_confidence_is_used_as_it_is_until_outcomes_correct_it():
    """DSpark's confidence head gives logits of the acceptance: trusted from the first step, then refit.
    Here the head is overconfident by 3 (true logit = head logit - 3) and the fit learns that."""
    rng = np.random.default_rng(1)
    model = AcceptanceModel(refit_every=50)
    np.testing.assert_allclose(model.probabilities([2.0, -1.0], calibrated=True), 1 / (1 + np.exp([-2.0, 1.0])))
    for _ in range(400):
        confidence = rng.normal(1.0, 2.0, size=4).tolist()
        accepted = next((i for i, c in enumerate(confidence) if rng.random() > 1 / (1 + np.exp(3 - c))), 4)
        model.observe(confidence, 4, accepted, calibrated=True)
    (fitted,) = model.probabilities([3.0], calibrated=True)
    assert abs(fitted - 0.5) < 0.1, fitted


class WrongAndSlow(Drafter):
    """Always wrong, and each draft takes a while: drafting can only lose."""

    name = "wrong-and-slow"

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        self.calls += 1
        time.sleep(0.02)
        return Draft([95] * max_tokens, confidence=[0.0] * max_tokens)


def test_a_drafter_that_cannot_pay_is_mostly_not_asked():
    model = tiny_decoder("llama", torch.float32)
    drafter = WrongAndSlow()
    engine = Engine(model, drafter, EngineConfig(4, 512, 1, adaptive=True))
    result = engine.generate([Request(random_prompts(1, 20, seed=1)[0], 64)])[0]
    plain = Engine(model, None, EngineConfig(4, 512, 1)).generate([Request(random_prompts(1, 20, seed=1)[0], 64)])[0]
    assert result.output_ids == plain.output_ids
    assert drafter.calls < result.stats.target_passes / 3


@pytest.mark.parametrize("forward", FORWARDS)
def test_every_drafter_with_adaptive_verification_is_token_identical(forward, monkeypatch):
    # rows priced as on a CPU with matrix units (nearly free): drafts are kept, so verification is exercised
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: FixedCost([1, 64], [1.0, 1.1]))
    dtype = torch.float32 if forward == "python" else torch.bfloat16
    model = tiny_decoder("qwen2", dtype, forward=forward)
    prompts = random_prompts(6, 40, seed=3)
    requests = [Request(p, 40) for p in prompts]
    plain = [r.output_ids for r in Engine(model, None, EngineConfig(5, 512, 1)).generate(requests)]
    for method in TRAINING_FREE:
        engine = Engine(model, make_drafter(method), EngineConfig(5, 512, 3, adaptive=True))
        results = engine.generate(requests)
        assert [r.output_ids for r in results] == plain, method
        assert sum(r.stats.accepted_tokens for r in results) > 0, method


def _verifier(max_depth: int = 5) -> AdaptiveVerifier:
    # a row costs a tenth of a pass: only likely positions pay for theirs
    return AdaptiveVerifier(FixedCost([1, 64], [1.0, 7.3]), max_depth=max_depth)


def test_drafts_are_verified_whole_until_outcomes_can_price_them():
    verifier = _verifier()
    verifier.record_draft_time(0.1)
    drafts = [Draft([1, 2, 3, 4, 5], confidence=[0.0] * 5)]
    assert verifier.trim(drafts, [0]) == drafts  # no estimate yet: the whole draft, no pause
    assert verifier.should_draft()
    for _ in range(verifier.acceptance.first_fit):  # every draft rejected at its first token
        verifier.observe(drafts[0], 0)
    assert verifier.acceptance.fitted
    assert [len(d.tokens) for d in verifier.trim(drafts, [0])] == [0]
    assert not verifier.should_draft()  # and drafting pauses


def test_more_confidence_never_lowers_the_estimate():
    """A few outcomes can say the opposite of what the signal means; the fit never inverts it."""
    model = AcceptanceModel()
    for _ in range(8):
        model.observe([0.9], 1, 0)  # confident and rejected
        model.observe([0.1, 0.1], 2, 1)  # unsure and accepted once
    assert model.fitted
    low, high = model.probabilities([0.1])[0], model.probabilities([0.9])[0]
    assert high >= low


def test_a_probe_refits_the_estimate_at_once():
    """After a pause, the probe's outcomes refit the estimate in the same step (waiting for 100 outcomes
    would keep a stale estimate pausing for the rest of the calls)."""
    verifier = _verifier()
    rejected = accepted = Draft([1, 2, 3], confidence=[0.0] * 3)
    for _ in range(64):
        verifier.observe(rejected, 0)
    verifier.acceptance.fit()
    verifier.record_draft_time(0.001)
    assert [len(d.tokens) for d in verifier.trim([rejected], [0])] == [0]
    assert not verifier.should_draft()  # paused
    while not verifier.should_draft():
        pass
    assert [len(d.tokens) for d in verifier.trim([accepted], [0])] == [1]  # the probe: one token
    before = verifier.acceptance.probabilities([0.0])[0]
    for _ in range(8):  # the probe's requests: all of them accepted
        verifier.observe(Draft([1], confidence=[0.0]), 1)
    assert verifier.acceptance.probabilities([0.0])[0] > before


def _paused_verifier() -> AdaptiveVerifier:
    """An estimate fit on drafts that all failed: drafting is paused, waiting for a probe."""
    verifier = _verifier()
    rejected = Draft([1, 2, 3], confidence=[0.0] * 3)
    for _ in range(64):
        verifier.observe(rejected, 0)
    verifier.acceptance.fit()
    verifier.record_draft_time(0.001)
    for _ in range(4):  # misses in a row: each stretches the next pause
        verifier.trim([rejected], [0])
        while not verifier.should_draft():
            pass
    return verifier


@pytest.mark.parametrize("accepted", [1, 0])
def test_a_probe_that_paid_ends_the_pause(accepted):
    """A probe's pause is set on the estimate it tests; one whose outcome beat plain decoding (two tokens for a
    pass of two rows, 1.1 plain passes here) ends it, so that a drafter whose first drafts failed (suffix
    decoding before it has seen an answer) is not kept paused while its probes pay. One that failed keeps it."""
    verifier = _paused_verifier()
    (probe,) = verifier.trim([Draft([1, 2, 3], confidence=[0.0] * 3)], [0])
    assert len(probe.tokens) == 1
    verifier.observe(probe, accepted)
    assert verifier.should_draft() == bool(accepted)
    assert verifier.drafting_pays == bool(accepted)


@pytest.mark.parametrize("explore_every", [8, 10**9])
def test_positions_past_every_budget_are_judged_now_and_then(explore_every):
    """An estimate that a draft's second position fails cuts every draft to one token, so that position is
    never judged again: verifying one position past the budget every eighth such step lets the estimate see
    that the drafter has changed (without it, the budget stays at one token)."""
    verifier = AdaptiveVerifier(FixedCost([1, 64], [1.0, 7.3]), max_depth=5, explore_every=explore_every)
    verifier.record_draft_time(0.001)
    for _ in range(64):
        verifier.observe(Draft([1, 2], confidence=[1.0, 1.0]), 1)  # the first position passes, the second fails
    verifier.acceptance.fit()
    budgets = []
    for _ in range(400):
        assert verifier.should_draft()
        (cut,) = verifier.trim([Draft([1, 2, 3, 4, 5], confidence=[1.0] * 5)], [0])
        verifier.observe(cut, len(cut.tokens))  # now every position passes
        budgets.append(len(cut.tokens))
    assert budgets[:7] == [1] * 7
    if explore_every == 8:
        assert budgets[7] == 2 and min(budgets[-20:]) >= 2
    else:
        assert set(budgets) == {1}


def test_a_costly_probe_buys_a_longer_pause():
    """Drafting that plain decoding beats pauses until its probes cost at most probe_share of the plain
    steps between them: a cheap drafter is asked again soon, a slow one much later."""

    def steps_paused(draft_seconds: float) -> int:
        verifier = _verifier()
        drafts = [Draft([1, 2, 3], confidence=[0.0] * 3)]
        for _ in range(verifier.acceptance.first_fit):  # every draft rejected at its first token
            verifier.observe(drafts[0], 0)
        verifier.record_draft_time(draft_seconds)
        verifier.trim(drafts, [0])
        paused = 0
        while not verifier.should_draft():
            paused += 1
        return paused

    assert steps_paused(0.001) == 1  # the doubling pause: 1, 2, 4 ... steps
    assert steps_paused(2.0) == 40  # two plain passes (1.0 s each) a probe: 2 / (0.05 x 1.0) steps
    # a probe that read every running request's prompt into the drafter: 2000 steps, not a fixed cap's fewer
    assert steps_paused(100.0) == 2000
    assert steps_paused(1000.0) == _verifier().longest_pause


def test_draft_depth_follows_the_budget():
    verifier = _verifier(max_depth=4)
    assert verifier.depth == 4
    for _ in range(16):  # the first position is always accepted, the second never
        verifier.observe(Draft([1, 2], confidence=[5.0, -5.0]), 1)
    counts = [len(d.tokens) for d in verifier.trim([Draft([1, 2, 3, 4], confidence=[5.0, -5.0, -5.0, -5.0])] * 2,
                                                   [0, 0])]
    assert counts == [1, 1] and verifier.depth == 2  # one past the deepest share: the next may pay
    verifier.observe(Draft([1, 2, 3, 4], confidence=[5.0] * 4), 4)
    verifier.trim([Draft([1, 2, 3, 4], confidence=[5.0] * 4)], [0])
    assert verifier.depth <= 4


def test_draft_cost_is_not_set_by_a_proposal_that_read_a_prompt():
    verifier = _verifier()
    for seconds in (0.010, 0.011, 0.5, 0.009, 0.010):  # 0.5: the first proposal after a long prompt
        verifier.record_draft_time(seconds)
    assert verifier.draft_seconds == pytest.approx(0.010)


class FirstTokenRight(Drafter):
    """Drafts the plain answer's next token (sure of it), then tokens it is never right about."""

    name = "first-token-right"

    def __init__(self, prompt_len: int, answer: list[int], cost_grows_with_depth: bool) -> None:
        self.prompt_len, self.answer = prompt_len, answer
        self.cost_grows_with_depth = cost_grows_with_depth
        self.asked: list[int] = []

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        self.asked.append(max_tokens)
        at = len(seq.token_ids) - self.prompt_len
        right = self.answer[at] if at < len(self.answer) else 0
        wrong = [(self.answer[min(at + 1 + i, len(self.answer) - 1)] + 1) % 97 for i in range(max_tokens - 1)]
        return Draft([right, *wrong], confidence=[5.0] + [-5.0] * (max_tokens - 1))


@pytest.mark.parametrize("cost_grows_with_depth", [True, False])
def test_only_a_chain_drafter_is_asked_for_fewer_tokens_than_k(cost_grows_with_depth, monkeypatch):
    # a row costs a tenth of a pass: the budget settles on the first position, the one that is accepted
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: FixedCost([1, 64], [1.0, 7.3]))
    model = tiny_decoder("llama", torch.float32)
    prompt = random_prompts(1, 20, seed=2)[0]
    plain = Engine(model, None, EngineConfig(5, 512, 1)).generate([Request(prompt, 60)])[0].output_ids
    drafter = FirstTokenRight(len(prompt), plain, cost_grows_with_depth)
    result = Engine(model, drafter, EngineConfig(5, 512, 1, adaptive=True)).generate([Request(prompt, 60)])[0]
    assert result.output_ids == plain
    settled = drafter.asked[12:20]  # past the first fit (8 drafts) and a few budgets after it
    assert len(settled) == 8
    # a chain would pay a step per token it is asked for: one past the budget (1); a block pass costs the
    # same at any depth, so it keeps drafting K and the budget cuts its draft after pricing it
    assert all(n <= 2 for n in settled) if cost_grows_with_depth else all(n == 5 for n in settled)


def test_a_budget_never_puts_a_request_past_its_allowance():
    # cost 1 + 0.1 a row; plain pass of the 2 requests: 1.2 s. Request 1 has no draft, so any drafted row
    # makes its step longer than plain decoding's for the same one token.
    survival = [np.array([0.9, 0.9, 0.9]), np.array([])]

    def cost(rows, keys):
        return 1.0 + 0.1 * rows

    assert choose_budget(survival, cost, 0.0) == [3, 0]  # tokens per second alone: the whole draft
    assert choose_budget(survival, cost, 0.0, allowance=[1.0, 0.0]) == [0, 0]  # no second to spare
    assert choose_budget(survival, cost, 0.0, allowance=[1.0, 0.15]) == [1, 0]  # 0.1 s: one row
    # a request with nothing to spare but a likely draft of its own may still draft it: 1.3 s for 1.9 tokens
    assert choose_budget([np.array([0.9]), np.array([])], cost, 0.0, allowance=[0.0, 1.0]) == [1, 0]
    # every budget overshoots (drafting already cost 0.5 s): the least overshoot, no rows
    assert choose_budget(survival, cost, 0.5, allowance=[1.0, 0.0]) == [0, 0]


def test_a_request_whose_drafts_fail_stays_within_its_allowance():
    """Request 0's drafts are always accepted, request 1 never has one: drafting for request 0 makes every
    pass longer, and request 1 waits on it. Its ledger keeps it within one plain step plus lag_share of its
    tokens' plain time behind plain decoding, while request 0 still drafts."""
    # a row costs 0.02 s: four of them (0.08 s) a step would outrun the 0.05 s a token adds to the allowance
    verifier = AdaptiveVerifier(FixedCost([1, 64], [1.0, 2.26]), max_depth=4)
    for _ in range(16):
        verifier.observe(Draft([1, 2, 3, 4], confidence=[0.0] * 4), 4)
    drafted = 0
    for step in range(200):
        if not verifier.should_draft():
            verifier.observe(Draft([]), 0, 0)
            verifier.observe(Draft([]), 0, 1)
            continue
        verifier.record_draft_time(0.001)
        cut = verifier.trim([Draft([1, 2, 3, 4], confidence=[0.0] * 4), Draft([])], [0, 0], [0, 1])
        drafted += len(cut[0].tokens)
        verifier.observe(cut[0], len(cut[0].tokens), 0)
        verifier.observe(cut[1], 0, 1)
        plain = verifier.pass_cost(2)  # request 1 got a token each step, step + 1 so far
        assert verifier.lag(1) <= plain * (1 + verifier.lag_share * (step + 1)) + 1e-9, step
    assert drafted > 100  # request 0 was not held to plain decoding
    assert verifier.lag(0) < 0  # and is far ahead of it


def test_the_engine_charges_each_step_to_the_requests_it_cut(monkeypatch):
    """The ledger is per request: the ids `trim` is given are the engine's request ids, and every verified
    draft is charged to its own request (a second batch of requests gets new ids, not reused positions)."""
    trimmed: list[list[int]] = []
    charged: list[int] = []

    class Recording(AdaptiveVerifier):
        def trim(self, drafts, contexts, request_ids=None):
            trimmed.append(list(request_ids))
            return super().trim(drafts, contexts, request_ids)

        def observe(self, draft, accepted, request_id=None):
            charged.append(request_id)
            super().observe(draft, accepted, request_id)

    monkeypatch.setattr(engine_module, "AdaptiveVerifier", Recording)
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: FixedCost([1, 64], [1.0, 1.1]))
    model = tiny_decoder("llama", torch.float32, forward="python")
    engine = Engine(model, make_drafter("ngram"), EngineConfig(4, 256, 2, adaptive=True))
    first = [engine.add_request(Request(p, 12)) for p in random_prompts(2, 20, seed=4)]
    while engine.has_work:
        engine.step()
    second = [engine.add_request(Request(p, 12)) for p in random_prompts(2, 20, seed=5)]
    while engine.has_work:
        engine.step()
    assert trimmed and set().union(*map(set, trimmed)) == set(first + second)
    assert set(charged) == set(first + second)  # the second batch is charged under its own ids


class ReadsHiddenRows(Drafter):
    """Wrong and slow like WrongAndSlow, but it reads the target's hidden rows (as trained drafters do, which
    catch up on every row they missed before they draft): records which requests each call drafted for."""

    name = "reads-hidden-rows"
    tap_layers = (1,)

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        return self.propose_many([seq], [max_tokens])[0]

    def propose_many(self, seqs: list[SequenceView], max_tokens: list[int]) -> list[Draft]:
        self.asked.append([seq.request_id for seq, k in zip(seqs, max_tokens, strict=True) if k > 0])
        time.sleep(0.01)
        return [Draft([95] * k, confidence=[0.0] * k) if k > 0 else Draft([]) for k in max_tokens]


def test_a_probe_of_a_drafter_that_reads_hidden_rows_drafts_for_one_request(monkeypatch):
    """Warm-up and probes ask such a drafter for one request at a time (the one it lags least: the same one
    while it runs), so a probe costs one catch-up however many requests run; answers stay plain decoding's."""
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: FixedCost([1, 64], [1.0, 7.3]))
    model = tiny_decoder("llama", torch.float32)
    requests = [Request(p, 48) for p in random_prompts(3, 20, seed=6)]
    plain = [r.output_ids for r in Engine(model, None, EngineConfig(4, 512, 3)).generate(requests)]
    drafter = ReadsHiddenRows()
    results = Engine(model, drafter, EngineConfig(4, 512, 3, adaptive=True)).generate(requests)
    assert [r.output_ids for r in results] == plain
    asked = [ids for ids in drafter.asked if ids]
    assert len(asked) >= 8  # the warm-up's drafts and some probes after it
    assert all(len(ids) == 1 for ids in asked)
    assert len({ids[0] for ids in asked[:8]}) == 1  # the warm-up stays on the request already caught up


def test_a_probe_of_a_drafter_without_hidden_rows_drafts_for_every_request(monkeypatch):
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: FixedCost([1, 64], [1.0, 7.3]))
    model = tiny_decoder("llama", torch.float32)
    drafter = ReadsHiddenRows()
    drafter.tap_layers = ()  # n-gram and suffix drafts cost the same for one request or all
    Engine(model, drafter, EngineConfig(4, 512, 3, adaptive=True)).generate(
        [Request(p, 48) for p in random_prompts(3, 20, seed=6)])
    assert len(drafter.asked[0]) == 3


class AlwaysWrong(Drafter):
    """Drafts a token the target never takes next: its plain answer's next token, plus one."""

    name = "always-wrong"

    def __init__(self, answers: dict[int, list[int]], slow_s: float = 0.0) -> None:
        self.answers, self.slow_s = answers, slow_s

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        time.sleep(self.slow_s)
        done = len(seq.output_ids)
        wrong = (self.answers[seq.request_id][done] + 1) % 96
        return Draft([wrong] * max_tokens, confidence=[0.0] * max_tokens)


def _target_time(engine: Engine, prompts: list[list[int]], cost: PassCost, monkeypatch) -> tuple[float, list]:
    """The target time of answering `prompts` one at a time, as `cost` prices each decode pass's rows (prompt
    passes are the same with or without a drafter, so left out), and the answers."""
    passes: list[int] = []
    run = engine.runner.run

    def counting_run(inputs, width, *args, **kwargs):
        if all(item.logits == "all" for item in inputs):
            passes.append(sum(len(item.tokens) for item in inputs))
        return run(inputs, width, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", counting_run)
    answers = [engine.generate([Request(p, 128)])[0].output_ids for p in prompts]
    return sum(cost(rows) for rows in passes), answers


def test_a_drafter_that_is_always_wrong_costs_at_most_two_percent_of_target_time(monkeypatch):
    """Counted passes and rows, priced by a decode-bound profile (a verify of K + 1 rows: 1.4 plain steps):
    probes and the warm-up's whole drafts add at most 2% to plain decoding's target time."""
    cost = FixedCost([1, 2, 6, 64], [1.0, 1.08, 1.4, 8.0])
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: cost)
    model = tiny_decoder("llama", torch.float32, forward="python")
    prompts = random_prompts(4, 30, seed=61)
    plain_time, answers = _target_time(Engine(model, None, EngineConfig(5, 512, 1)), prompts, cost, monkeypatch)
    engine = Engine(model, AlwaysWrong({}), EngineConfig(5, 512, 1, adaptive=True))
    engine.drafter.answers = {i: a for i, a in enumerate(answers)}  # request ids count from 0, one at a time
    drafted_time, drafted_answers = _target_time(engine, prompts, cost, monkeypatch)
    assert drafted_answers == answers
    assert drafted_time <= 1.02 * plain_time


def test_requests_count_how_often_their_drafter_ran_and_probed(monkeypatch):
    """An always-wrong drafter: it runs in few steps (paused between probes), those runs are probes, and every
    draft verified came from a run."""
    cost = FixedCost([1, 2, 6, 64], [1.0, 1.08, 1.4, 8.0])
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: cost)
    model = tiny_decoder("llama", torch.float32, forward="python")
    prompts = random_prompts(2, 30, seed=61)
    answers = [r.output_ids for r in Engine(model, None, EngineConfig(5, 512, 1)).generate(
        [Request(p, 128) for p in prompts])]
    engine = Engine(model, AlwaysWrong(dict(enumerate(answers))), EngineConfig(5, 512, 1, adaptive=True))
    stats = DecodeStats()
    for prompt in prompts:
        stats.merge(engine.generate([Request(prompt, 128)])[0].stats)
    assert stats.passes_with_draft <= stats.drafter_runs < stats.target_passes / 4
    assert 0 < stats.probes <= stats.drafter_runs


def test_probes_that_keep_failing_come_ever_more_rarely():
    """Each unpaid probe in a row halves the share of plain time probes may take, down to half a percent: a
    costly probe's pauses grow, a cheap one's stay near max_pause."""
    verifier = _verifier()
    draft = Draft([1, 2, 3], confidence=[0.0] * 3)
    for _ in range(verifier.acceptance.first_fit):
        verifier.observe(draft, 0)
    pauses = []
    for _ in range(8):
        verifier.record_draft_time(2.0)  # two plain passes a probe
        verifier.trim([draft], [0])
        paused = 0
        while not verifier.should_draft():
            paused += 1
        pauses.append(paused)
        verifier.observe(draft.cut(1), 0)
    # the first budget verified nothing (2.0 s lost); each probe after it a row too (0.1 s), less the plain time
    # of the token it might give (the estimate of an always-wrong drafter: near 0), down to half a percent
    assert pauses[0] == 40
    for paused, full in zip(pauses[1:], [84, 168, 336, 420, 420, 420, 420], strict=True):
        assert 0.99 * full <= paused <= full
    cheap = _verifier()
    for _ in range(cheap.acceptance.first_fit):
        cheap.observe(draft, 0)
    for _ in range(12):  # a lookup's cost: only its probe's row counts (a tenth of a pass here)
        cheap.record_draft_time(0.0001)
        cheap.trim([draft], [0])
        paused = 0
        while not cheap.should_draft():
            paused += 1
        cheap.observe(draft.cut(1), 0)
    assert cheap.max_pause <= paused <= 20  # 0.1 / 0.005: a twentieth of the slow drafter's pause


@pytest.mark.parametrize("profile", [
    [1.0, 1.08, 1.4, 8.0],  # matrix units: rows nearly free until the weights' read is covered
    [1.0, 1.6, 4.2, 40.0],  # two AVX2 cores on Qwen q8_0 (19 ms a row, 79 ms for 6): every row computed
])
def test_probes_of_a_cheap_drafter_that_never_pays_cost_at_most_one_percent(profile):
    """A lookup that is always wrong, priced by its step's predicted seconds against plain steps: after the
    warm-up its probes (each verifies a token) add at most 1% to plain decoding, where draft rows are
    nearly free and where each costs most of a pass. A probe's price is its drafting and the rows it adds."""
    cost = FixedCost([1, 2, 6, 64], profile)
    verifier = AdaptiveVerifier(cost)
    draft = Draft([1, 2, 3, 4, 5], confidence=[0.0] * 5)
    for _ in range(verifier.acceptance.first_fit):  # the warm-up: whole drafts, every one rejected at once
        verifier.observe(draft, 0)
    steps, drafted_seconds, probes = 4000, 0.0, 0
    for _ in range(steps):
        if not verifier.should_draft():
            drafted_seconds += cost(1)
            continue
        verifier.record_draft_time(1e-4)
        n = len(verifier.trim([draft], [0])[0].tokens)
        drafted_seconds += 1e-4 + cost(1 + n)
        probes += n > 0
        verifier.observe(draft.cut(n), 0)
    assert probes > 0  # it is still asked now and then: traffic may change
    assert drafted_seconds <= 1.01 * steps * cost(1)
