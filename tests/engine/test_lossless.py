"""Greedy output with any drafter must be token-identical to the same engine without one."""

from __future__ import annotations

import pytest
import torch

from specstand.drafters import Draft, Drafter, SequenceView, make_drafter
from specstand.drafters.schema import SchemaDrafter
from specstand.engine import Engine, EngineConfig, Request, quiet_profile
from specstand.engine import engine as engine_module
from specstand.runner.transformer import DecoderModel
from tests.conftest import (
    DTYPES,
    FAMILIES,
    FORWARDS,
    KERNEL_PATHS,
    TRAINING_FREE,
    VOCAB,
    FixedCost,
    random_prompts,
    tiny_decoder,
    tiny_hf_model,
)
from tests.drafters.schema_fixtures import CFB_TOOLS, NESTFUL_TOOLS, OLD_STYLE_TOOLS, json_piece_codec

K = 5
# (dtype, forward): fp32 runs the Python forward; bf16 runs it and every kernel path this CPU has; q8_0
# (Q8_0 blocks of the bf16 weights) runs every kernel path
NUMERICS = ([("fp32", "python")] + [("bf16", forward) for forward in FORWARDS]
            + [("q8_0", forward) for forward in KERNEL_PATHS])


def target(family: str, dtype: str, forward: str) -> DecoderModel:
    """A tiny `family` target with the numerics (dtype, forward) of NUMERICS."""
    if dtype == "q8_0":
        return tiny_decoder(family, torch.bfloat16, forward=forward, weight_format="q8_0")
    return tiny_decoder(family, DTYPES[dtype], forward=forward)


def _engine(model: DecoderModel, drafter: Drafter | None, max_batch: int = 1, adaptive: bool = True) -> Engine:
    return Engine(model, drafter, EngineConfig(num_speculative_tokens=K, max_seq_len=512, max_batch=max_batch,
                                               adaptive=adaptive))


def _outputs(engine: Engine, prompts: list[list[int]], max_tokens: int = 48) -> list[list[int]]:
    return [r.output_ids for r in engine.generate([Request(p, max_tokens) for p in prompts])]


class ScriptedDrafter(Drafter):
    """Drafts on every other step only, alternating right and wrong guesses taken from a reference answer,
    so passes with and without a draft, full and partial acceptance all interleave."""

    name = "scripted"

    def __init__(self, answers: dict[int, list[int]]) -> None:
        self.answers = answers
        self.calls = 0

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        self.calls += 1
        if self.calls % 2:
            return Draft([])
        answer = self.answers[seq.request_id]
        done = len(seq.output_ids)
        guess = answer[done : done + max_tokens]
        if self.calls % 4 == 0 and len(guess) > 2:
            guess = guess[:2] + [(guess[2] + 1) % 96] + guess[3:]  # wrong from the third token on
        return Draft(guess)


@pytest.mark.parametrize(("dtype", "forward"), NUMERICS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_drafter_is_token_identical_to_plain_greedy(family, dtype, forward):
    assert_every_drafter_answers_as_plain_decoding(target(family, dtype, forward),
                                                   random_prompts(8, 40, seed=3))


def assert_every_drafter_answers_as_plain_decoding(model, prompts: list[list[int]]) -> None:
    """Each training-free drafter, 3 requests at a time: the greedy answers of plain decoding, one by one,
    with drafts accepted (else the test would not exercise verification)."""
    baseline = _outputs(_engine(model, None), prompts)
    for method in TRAINING_FREE:
        results = _engine(model, make_drafter(method), max_batch=3).generate([Request(p, 48) for p in prompts])
        assert [r.output_ids for r in results] == baseline, method
        assert sum(r.stats.accepted_tokens for r in results) > 0, f"{method} never had a draft accepted"


class CountingSchemaDrafter(SchemaDrafter):
    """Counts the drafts that began with forced text."""

    forced_drafts = 0

    def _forced_tokens(self, seq: SequenceView, drafted: list[int] | None = None) -> list[int]:
        tokens = super()._forced_tokens(seq, drafted)
        self.forced_drafts += bool(tokens) and not drafted
        return tokens


def tool_call_requests(max_tokens: int = 48) -> list[Request]:
    """Random prompts offering tools, and one that writes its tools list into the prompt as older workloads
    did, over json_piece_codec's vocabulary (whose pieces make random answers full of braces and keys)."""
    codec = json_piece_codec(VOCAB)
    prompts = random_prompts(8, 40, seed=8, alphabet=VOCAB - 6)
    requests = [Request(p, max_tokens, tools=CFB_TOOLS if i % 2 else NESTFUL_TOOLS) for i, p in enumerate(prompts)]
    return requests + [Request(codec.encode(OLD_STYLE_TOOLS) + prompts[0], max_tokens)]


def assert_schema_drafting_answers_as_plain_decoding(model, adaptive: bool = False) -> int:
    """Schema drafting, 3 requests at a time (adaptive verification on or off): the greedy answers of plain
    decoding, with drafts accepted. Returns how many drafts began with forced text (a random target leaves
    the schema at once, so they are mostly wrong)."""
    requests = tool_call_requests()
    baseline = _outputs(_engine(model, None), [r.prompt_ids for r in requests])
    drafter = CountingSchemaDrafter(json_piece_codec(VOCAB))
    config = EngineConfig(num_speculative_tokens=K, max_seq_len=512, max_batch=3, adaptive=adaptive)
    results = Engine(model, drafter, config).generate(requests)
    assert [r.output_ids for r in results] == baseline
    assert sum(r.stats.accepted_tokens for r in results) > 0
    return drafter.forced_drafts


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize(("dtype", "forward"), [NUMERICS[0], NUMERICS[-1]])  # fp32 Python, the best kernels
def test_schema_drafting_is_token_identical_to_plain_greedy(dtype, forward, adaptive, monkeypatch):
    # rows priced nearly free under adaptive verification: drafts are kept, so verification is exercised
    monkeypatch.setattr(quiet_profile, "profile_pass_cost", lambda *profile_args: FixedCost([1, 64], [1.0, 1.1]))
    forced = sum(assert_schema_drafting_answers_as_plain_decoding(target(family, dtype, forward), adaptive)
                 for family in FAMILIES)
    assert forced >= 10


@pytest.mark.parametrize("forward", [FORWARDS[0], FORWARDS[-1]])  # the Python forward and the best kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_drafting_over_long_prompts_sharing_a_head(family, forward):
    """Batch 3, prompts of three prefill blocks whose first two are shared (reused from the cache while
    other requests decode): every training-free drafter answers as each prompt does alone."""
    model = tiny_decoder(family, DTYPES["fp32" if forward == "python" else "bf16"], forward=forward)
    head = random_prompts(1, 150, seed=30)[0]
    prompts = [head + tail for tail in random_prompts(5, 20, seed=31)]
    alone = [_outputs(_engine(model, None), [p], 32)[0] for p in prompts]
    for method in TRAINING_FREE:
        engine = _engine(model, make_drafter(method), max_batch=3)
        results = engine.generate([Request(p, 32) for p in prompts])
        assert [r.output_ids for r in results] == alone, method
        assert sum(r.stats.cached_prompt_tokens for r in results) >= 4 * 128  # the head came from the cache
        assert sum(r.stats.accepted_tokens for r in results) > 0, method


@pytest.mark.parametrize(("dtype", "forward"), NUMERICS)
def test_alternating_drafted_and_undrafted_steps(dtype, forward):
    model = target("qwen3", dtype, forward)
    prompts = random_prompts(4, 30, seed=5)
    baseline = _outputs(_engine(model, None), prompts)
    drafter = ScriptedDrafter(dict(enumerate(baseline)))
    engine = _engine(model, drafter, adaptive=False)  # every scripted draft verified
    results = engine.generate([Request(p, 48) for p in prompts])
    assert [r.output_ids for r in results] == baseline
    stats = results[0].stats
    assert 0 < stats.passes_with_draft < stats.target_passes - 1
    assert stats.accepted_tokens < stats.drafted_tokens  # some drafts were rejected and rolled back


@pytest.mark.parametrize("forward", FORWARDS)
def test_batched_decoding_matches_one_request_at_a_time(forward):
    model = tiny_decoder("llama", torch.bfloat16, forward=forward)
    prompts = random_prompts(5, 25, seed=7) + random_prompts(2, 60, seed=8)
    baseline = _outputs(_engine(model, None), prompts)
    assert _outputs(_engine(model, make_drafter("ngram"), max_batch=4), prompts) == baseline


def test_cache_holds_all_but_the_last_token_between_steps():
    model = DecoderModel(tiny_hf_model("llama"), 512)
    engine = _engine(model, make_drafter("suffix"))
    engine.add_request(Request(random_prompts(1, 30, seed=9)[0], 40))
    while engine.has_work:
        engine.step()
        for state in engine._running.values():
            assert engine.runner.cache.lengths[state.slot] == len(state.seq.token_ids) - 1


def test_stop_tokens_and_max_tokens():
    model = DecoderModel(tiny_hf_model("llama"), 512)
    prompt = random_prompts(1, 20, seed=11)[0]
    free = _outputs(_engine(model, None), [prompt], max_tokens=30)[0]
    stop = free[10]
    first = free.index(stop)
    for drafter in (None, make_drafter("ngram")):
        result = _engine(model, drafter).generate([Request(prompt, 30, stop_token_ids=frozenset({stop}))])[0]
        assert result.output_ids == free[: first + 1] and result.finish_reason == "stop"
        short = _engine(model, drafter).generate([Request(prompt, 7)])[0]
        assert short.output_ids == free[:7] and short.finish_reason == "length"


def test_tau_counts_all_passes():
    model = DecoderModel(tiny_hf_model("llama"), 512)
    result = _engine(model, make_drafter("suffix")).generate([Request(random_prompts(1, 30, seed=2)[0], 40)])[0]
    stats = result.stats
    assert stats.emitted_tokens == len(result.output_ids)
    assert stats.tau == pytest.approx(stats.emitted_tokens / stats.target_passes)
    # emitted = one target token per pass + every accepted draft token
    assert stats.emitted_tokens == stats.target_passes + stats.accepted_tokens
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert stats.drafted_per_position[0] == stats.passes_with_draft
    assert stats.tau_per_draft == pytest.approx(1 + stats.accepted_tokens / stats.passes_with_draft)


def test_request_validation():
    model = DecoderModel(tiny_hf_model("llama"), 512)
    engine = _engine(model, None)
    with pytest.raises(ValueError, match="empty"):
        Request([], 10)
    with pytest.raises(ValueError, match="max_tokens"):
        Request([3], 0)
    with pytest.raises(ValueError, match="exceed the context"):
        engine.add_request(Request([3] * 500, 20))


@pytest.mark.parametrize("fp32_prefill", [False, True])
def test_lossless_whichever_way_prompts_are_computed(fp32_prefill):
    model = DecoderModel(tiny_hf_model("llama", torch.bfloat16), 512, fp32_prefill=fp32_prefill)
    prompts = random_prompts(4, 50, seed=12)
    assert _outputs(_engine(model, make_drafter("ngram")), prompts) == _outputs(_engine(model, None), prompts)


@pytest.mark.parametrize(("dtype", "forward"), NUMERICS)
def test_prefix_reuse_is_exact(dtype, forward):
    model = target("qwen2", dtype, forward)
    head = random_prompts(1, 140, seed=21)[0]
    first, second = head + [3, 4, 5], head + [6, 7]
    warm = _engine(model, make_drafter("ngram"))
    warm.generate([Request(first, 30)])
    reused = warm.generate([Request(second, 30)])[0]
    # where prompts run compiled any head is reusable; elsewhere whole prefill blocks of it
    assert reused.stats.cached_prompt_tokens == (140 if warm.runner.compiled_prompts else 128)
    fresh = _engine(model, make_drafter("ngram")).generate([Request(second, 30)])[0]
    assert fresh.stats.cached_prompt_tokens == 0
    assert reused.output_ids == fresh.output_ids


@pytest.mark.parametrize("forward", FORWARDS)
def test_a_finished_answer_is_reused_by_the_next_call(forward):
    """An agent's next call extends the last prompt with its answer: where prompts run compiled (prompt
    rows compute like decode rows), those answer positions come from the cache too, and nothing changes."""
    model = tiny_decoder("llama", torch.bfloat16, forward=forward)
    first = random_prompts(1, 70, seed=23)[0]
    engine = _engine(model, make_drafter("suffix"))
    answer = engine.generate([Request(first, 20)])[0].output_ids
    second = first + answer + [7, 8, 9]
    reused = engine.generate([Request(second, 20)])[0]
    # all but the last answer token, which no pass computed unless it was an accepted draft
    expected = (len(first) + len(answer) - 1, len(first) + len(answer)) if engine.runner.compiled_prompts else (64,)
    assert reused.stats.cached_prompt_tokens in expected
    assert reused.output_ids == _engine(model, make_drafter("suffix")).generate([Request(second, 20)])[0].output_ids


@pytest.mark.parametrize("forward", FORWARDS)
def test_a_longer_cached_head_is_not_overwritten_by_a_shorter_reuse(forward):
    model = tiny_decoder("llama", torch.bfloat16, forward=forward)
    head = random_prompts(1, 130, seed=24)[0]
    long, short = head + random_prompts(1, 70, seed=25)[0], head + [3]
    engine = _engine(model, None, max_batch=2)
    engine.generate([Request(long, 4)])
    engine.generate([Request(short, 4)])  # reuses the head; must copy it, not take the long prompt's slot
    again = engine.generate([Request(long, 4)])[0]
    assert again.stats.cached_prompt_tokens == (len(long) - 1 if engine.runner.compiled_prompts else 192)


@pytest.mark.parametrize("forward", FORWARDS)
def test_prefix_is_copied_from_a_running_request(forward):
    model = tiny_decoder("llama", torch.bfloat16, forward=forward)
    head = random_prompts(1, 130, seed=22)[0]
    prompts = [head + [3], head + [4, 5], head + [6]]
    engine = _engine(model, make_drafter("suffix"), max_batch=3)
    engine.generate([Request(prompts[0], 5)])
    # two calls sharing the head start together: one takes the finished slot, the other copies from it
    results = engine.generate([Request(p, 20) for p in prompts[1:]])
    expected = [130, 130] if engine.runner.compiled_prompts else [128, 128]
    assert [r.stats.cached_prompt_tokens for r in results] == expected
    fresh = [_engine(model, make_drafter("suffix")).generate([Request(p, 20)])[0].output_ids for p in prompts[1:]]
    assert [r.output_ids for r in results] == fresh


@pytest.mark.parametrize("forward", FORWARDS)
def test_prompt_chunks_share_passes_with_decoding_requests(forward, monkeypatch):
    """Where prompts run compiled, a new prompt is computed in chunks inside the passes that advance the
    requests already decoding; answers stay those of one request at a time without a drafter."""
    monkeypatch.setattr(engine_module, "PROMPT_CHUNK", 24)
    model = tiny_decoder("qwen2", torch.bfloat16, forward=forward)
    prompts = random_prompts(3, 30, seed=40) + random_prompts(3, 70, seed=41)
    engine = _engine(model, make_drafter("suffix"), max_batch=2)
    selections = []
    run = engine.runner.run

    def recording_run(inputs, *args, **kwargs):
        selections.append({item.logits for item in inputs})
        return run(inputs, *args, **kwargs)

    engine.runner.run = recording_run
    outputs = _outputs(engine, prompts, 24)
    assert outputs == [_outputs(_engine(model, None), [p], 24)[0] for p in prompts]
    if engine.runner.compiled_prompts:
        mixed = [s for s in selections if "all" in s and s & {"none", "last"}]
        assert len(mixed) >= 4  # every later prompt (70 tokens: 3 chunks) rode along decoding rows
