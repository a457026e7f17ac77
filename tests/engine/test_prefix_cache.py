"""The prefix store beyond the slots: a head served from it computes exactly as a cold one, eviction under a
tiny budget changes no answer, and targets whose state it cannot copy are refused."""

from __future__ import annotations

import random

import pytest
import torch

from specstand.drafters import make_drafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.engine import engine as engine_module
from specstand.engine.prefix_cache import PrefixStore
from specstand.verification import Verdict, verify
from tests.conftest import FORWARDS, RECURRENT_FAMILIES, random_prompts, tiny_hybrid
from tests.engine.test_lossless import NUMERICS, target

K = 5
STORE = 64 << 20


def _engine(model, drafter=None, max_batch: int = 1, store_bytes: int = STORE, adaptive: bool = True) -> Engine:
    return Engine(model, drafter, EngineConfig(num_speculative_tokens=K, max_seq_len=512, max_batch=max_batch,
                                               prefix_store_bytes=store_bytes, adaptive=adaptive))


def _logged(monkeypatch) -> list[torch.Tensor]:
    """Every logits tensor the engine verifies against from now on, in order (a prompt's last row, then each
    pass): call it before each engine's run, as the engines run one after the other."""
    seen: list[torch.Tensor] = []

    def logging_verify(draft, draft_probs, logits, *args) -> Verdict:
        seen.append(logits.clone())
        return verify(draft, draft_probs, logits, *args)

    monkeypatch.setattr(engine_module, "verify", logging_verify)
    return seen


@pytest.mark.parametrize(("dtype", "forward"), NUMERICS)
def test_a_head_from_the_store_gives_the_logits_of_a_cold_prompt(dtype, forward, monkeypatch):
    model = target("qwen2", dtype, forward)
    head = random_prompts(1, 140, seed=31)[0]
    first, other, second = head + [3, 4, 5], random_prompts(1, 90, seed=32)[0], head + [6, 7]
    # fixed K: the n-gram drafts depend on the sequence alone, so both engines run the same passes
    warm = _engine(model, make_drafter("ngram"), adaptive=False)
    warm.generate([Request(first, 20)])
    warm.generate([Request(other, 20)])  # takes the only slot: the head now lives in the store alone
    logged = _logged(monkeypatch)
    served = warm.generate([Request(second, 20)])[0]
    assert served.stats.stored_prompt_tokens == served.stats.cached_prompt_tokens == 128  # 8 or 2 whole blocks
    cold = _engine(model, make_drafter("ngram"), store_bytes=0, adaptive=False)
    cold_logged = _logged(monkeypatch)
    computed = cold.generate([Request(second, 20)])[0]
    assert computed.stats.cached_prompt_tokens == 0
    assert served.output_ids == computed.output_ids
    assert len(logged) == len(cold_logged)
    assert all(torch.equal(a, b) for a, b in zip(logged, cold_logged, strict=True))


@pytest.mark.parametrize("forward", FORWARDS)
def test_eviction_under_a_tiny_budget_changes_no_answer(forward):
    """Agent-like traffic (three system heads, calls extending earlier ones) through two slots and a store
    of a few blocks: answers equal one-at-a-time cold decoding, the store stays under its budget and never
    keeps a block whose parent it dropped."""
    model = target("llama", "bf16", forward)
    heads = random_prompts(3, 80, seed=33)
    rng = random.Random(34)
    prompts = [heads[rng.randrange(3)] + random_prompts(1, rng.randrange(2, 30), seed=100 + i)[0] for i in range(12)]
    probe = _engine(model, store_bytes=1)
    budget = 5 * _block_bytes(probe)
    engine = _engine(model, make_drafter("suffix"), max_batch=2, store_bytes=budget)
    results = []
    for batch in (prompts[:4], prompts[4:5], prompts[5:9], prompts[9:]):
        results += engine.generate([Request(p, 12) for p in batch])
        store = engine.prefix_cache.store
        assert 0 < store.nbytes <= budget
        assert all(b.parent is None or b.parent in store._blocks for b in store._blocks.values())
    assert sum(r.stats.stored_prompt_tokens for r in results) > 0  # the store served some heads
    cold = _engine(model, make_drafter("suffix"), store_bytes=0)
    assert [r.output_ids for r in results] == [cold.generate([Request(p, 12)])[0].output_ids for p in prompts]


def _block_bytes(engine: Engine) -> int:
    cache, block = engine.runner.cache, engine.prefix_cache.store.block
    return 2 * cache.keys[:, 0, :, :block].numel() * cache.keys.element_size()


def test_the_store_keeps_chains_whole_and_drops_least_recent_leaves_first():
    from specstand.runner.kv_cache import KVCache

    cache = KVCache(1, 1, 1, 64, 2)
    store = PrefixStore(block=4, budget_bytes=3 * 2 * 4 * 2 * 4)  # three blocks of K and V, fp32
    store.insert(list(range(12)), cache, 0, {})  # a chain of three
    assert len(store) == 3
    store.insert(list(range(8)) + [50, 51, 52, 53], cache, 0, {})  # shares two blocks, adds a leaf
    assert len(store) == 3  # the first chain's leaf went: the shared blocks were used more recently
    assert len(store.lookup(list(range(8)) + [50, 51, 52, 53, 9])) == 3
    assert len(store.lookup(list(range(12)))) == 2
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_a_target_with_recurrent_state_has_no_store_and_stays_exact(family):
    model = tiny_hybrid(family, torch.bfloat16)
    engine = _engine(model, make_drafter("suffix"))
    assert engine.prefix_cache.store is None
    assert "recurrent" in engine.prefix_cache.store_off_reason
    prompts = random_prompts(3, 70, seed=35)
    answers = [r.output_ids for r in engine.generate([Request(p, 10) for p in prompts])]
    cold = _engine(model, make_drafter("suffix"), store_bytes=0)
    assert answers == [r.output_ids for r in cold.generate([Request(p, 10) for p in prompts])]


def test_a_sliding_window_target_is_served_from_the_store_exactly():
    model = tiny_hybrid("gemma3", torch.bfloat16)
    head = random_prompts(1, 140, seed=36)[0]
    engine = _engine(model)
    assert engine.prefix_cache.store is not None
    engine.generate([Request(head + [3], 10), Request(random_prompts(1, 90, seed=37)[0], 10)])
    served = engine.generate([Request(head + [4, 5], 10)])[0]
    assert served.stats.stored_prompt_tokens > 0
    assert served.output_ids == _engine(model, store_bytes=0).generate([Request(head + [4, 5], 10)])[0].output_ids


def test_forget_history_empties_the_store():
    model = target("llama", "bf16", FORWARDS[-1])
    engine = _engine(model)
    engine.generate([Request(random_prompts(1, 100, seed=38)[0], 8)])
    assert engine.prefix_cache.store.nbytes > 0
    engine.forget_history()
    assert engine.prefix_cache.store.nbytes == 0 and len(engine.prefix_cache.store) == 0
