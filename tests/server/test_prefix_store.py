"""The server's prefix store and time breakdown, as /metrics and the answers' stats show them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.test_server import LiveServer, _samples


@pytest.fixture(scope="module")
def one_slot(tiny_model_dir):
    """One slot: a second conversation takes it, so the first one's head survives in the store alone."""
    live = LiveServer(tiny_model_dir, method="suffix", max_batch=1, max_queue=16, prefix_store_bytes=64 << 20)
    yield live
    live.close()


def _ask(server, words: str) -> dict:
    served = server.client.models.list().data[0].id
    reply = server.client.chat.completions.create(model=served, messages=[{"role": "user", "content": words}],
                                                  max_tokens=8, temperature=0)
    return {"text": reply.choices[0].message.content, **reply.model_extra["specstand"]["stats"]}


def _metrics(server) -> dict[str, float]:
    return _samples(httpx.get(server.url + "/metrics").text)


def _phases(server) -> dict[str, float]:
    """specstand:engine_seconds_total by phase."""
    families = text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
    return {sample.labels["phase"]: sample.value for family in families for sample in family.samples
            if sample.name == "specstand:engine_seconds_total"}


def test_a_head_outlives_its_slot_in_the_store_until_reset(one_slot):
    first = " ".join(f"w{i % 37}" for i in range(150))
    other = " ".join(f"w{40 + i % 23}" for i in range(120))
    before = _metrics(one_slot)
    cold = _ask(one_slot, first)
    _ask(one_slot, other)  # takes the only slot
    warm = _ask(one_slot, first)
    assert warm["stored_prompt_tokens"] > 0 and warm["cached_prompt_tokens"] >= warm["stored_prompt_tokens"]
    assert warm["text"] == cold["text"]
    after = _metrics(one_slot)
    assert after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0) >= \
        warm["cached_prompt_tokens"]
    assert after["specstand:prefix_store_hits_total"] - before.get("specstand:prefix_store_hits_total", 0) == \
        warm["stored_prompt_tokens"]
    queried = after["vllm:prefix_cache_queries_total"] - before.get("vllm:prefix_cache_queries_total", 0)
    assert queried == after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0)
    assert queried >= 2 * cold["prompt_tokens"]
    assert after["specstand:prefix_store_bytes"] > 0
    assert httpx.post(one_slot.url + "/reset_prefix_cache", timeout=30).status_code == 200
    _ask(one_slot, other)  # the reset takes effect before this one; it refills the store with its own head
    again = _ask(one_slot, first)
    assert again["cached_prompt_tokens"] == 0 and again["text"] == cold["text"]


def test_the_time_breakdown_adds_up_to_the_wall_time(one_slot):
    prompts = [" ".join(f"w{(i * 7 + j) % 90 + 3}" for j in range(60 + 20 * i)) for i in range(4)]
    before, started = _phases(one_slot), time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda words: _ask(one_slot, words), prompts))
    time.sleep(1.0)  # idle time counts too
    after, wall = _phases(one_slot), time.perf_counter() - started
    grew = {phase: after[phase] - before.get(phase, 0.0) for phase in after}
    assert abs(sum(grew.values()) - wall) <= 0.05 * wall
    assert grew["prompt"] > 0 and grew["decode"] > 0 and grew["draft"] > 0 and grew["idle"] >= 0.9
