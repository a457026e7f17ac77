"""Fuzz and fault suite: bad bodies, parameter extremes and injected faults, sent while good streams run.
Afterwards every good stream has the tokens it gets alone, every slot is free, /health is 200 and the
server answers a normal request. Bounded: a fixed, seeded set of inputs, loopback only."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specstand.drafters import Draft, SequenceView
from specstand.drafters.ngram import NgramDrafter
from specstand.server import ServerLimits
from tests.server.test_server import PROMPTS, LiveServer

OK = {"messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 4, "temperature": 0}

# (body, expected status); every one of these was a crash, a hang or a silent misreading somewhere
BAD = [
    ({**OK, "seed": 2**64}, 400),  # over 64 bits: used to raise inside the engine after taking a slot
    ({**OK, "seed": -1}, 200),
    ({**OK, "temperature": 1e-320, "max_tokens": 8}, 200),  # used to overflow to inf, NaN, and fail everyone
    ({**OK, "temperature": 1e-320, "seed": 3}, 200),
    ({**OK, "temperature": 1000}, 400),
    ({**OK, "top_p": 0}, 400),
    ({**OK, "top_p": 1.5}, 400),
    ({**OK, "top_k": -5}, 400),
    ({**OK, "n": 2}, 400),
    ({**OK, "logprobs": True}, 400),
    ({**OK, "top_logprobs": 3}, 400),
    ({**OK, "presence_penalty": 0.5}, 400),
    ({**OK, "logit_bias": {"5": 10}}, 400),
    ({**OK, "response_format": {"type": "json_schema", "json_schema": {}}}, 400),
    ({**OK, "response_format": {"type": "text"}}, 200),
    ({**OK, "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto"},
     200),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "w4 w5"}]}]}, 200),
    ({**OK, "messages": [{"role": "user", "content": "w1"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "w7"}]}, 200),
    ({**OK, "messages": [{"role": "user"}]}, None),  # no content: an empty turn (empty prompts get a 400)
    ({**OK, "messages": [{"content": "w1"}]}, 400),
    ({**OK, "messages": "w1"}, 400),
    ({**OK, "max_tokens": -3}, 400),
    ({**OK, "max_tokens": 10**9}, 400),
    ({**OK, "stream": "yes please"}, 400),
    ({**OK, "messages": [{"role": "user", "content": "w1 " * 3000}]}, 400),  # over the prompt-character limit
]


def _tokens_alone(server: LiveServer, prompt: str, max_tokens: int = 24) -> list[int]:
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0})
    return reply.json()["specstand"]["token_ids"]


def _stream_tokens(server: LiveServer, prompt: str, max_tokens: int = 24) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    text = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def _assert_healthy_and_idle(server: LiveServer) -> None:
    """Every slot comes back and /health turns 200 (the worker takes a moment to see a hang-up)."""
    deadline = time.time() + 20
    while server.worker.engine.runner.cache.free_slots != server.worker.engine.config.max_batch:
        assert time.time() < deadline, "a slot was never freed"
        time.sleep(0.05)
    while (health := httpx.get(server.url + "/health")).status_code != 200:
        assert time.time() < deadline, f"/health stayed {health.status_code}: {health.text}"
        time.sleep(0.05)
    assert httpx.post(server.url + "/v1/chat/completions", json=OK, timeout=30).status_code == 200


def _malformed_bodies(count: int, seed: int) -> list[bytes]:
    """Random JSON values and mangled good bodies: wrong types, extreme numbers, deep nesting, junk bytes."""
    rng = random.Random(seed)
    atoms = [None, True, -1, 0, 2**70, -(2**70), 1e308, -1e-320, "", "w1", "\u0000", "\ud7ff" * 5, [], {}]
    keys = ["messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream", "model",
            "tools", "tool_choice", "logprobs", "response_format", "prompt"]
    bodies = []
    for i in range(count):
        kind = i % 4
        if kind == 0:  # a good body with one field replaced by a random atom
            body = dict(OK)
            body[rng.choice(keys)] = rng.choice(atoms)
            bodies.append(json.dumps(body).encode())
        elif kind == 1:  # nested junk
            value = rng.choice(atoms)
            for _ in range(rng.randint(1, 40)):
                value = [value] if rng.random() < 0.5 else {"messages": value}
            bodies.append(json.dumps(value).encode())
        elif kind == 2:  # truncated JSON
            text = json.dumps({**OK, "stop": ["w9"]}).encode()
            bodies.append(text[: rng.randint(0, len(text) - 1)])
        else:  # random bytes
            bodies.append(bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
    return bodies


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    live = LiveServer(tiny_model_dir, method="ngram", max_batch=3, max_queue=64,
                      limits=ServerLimits(max_body_bytes=64 * 1024, max_prompt_chars=5000))
    yield live
    live.close()


def test_bad_and_malformed_requests_leave_good_streams_untouched(server):
    good = PROMPTS[:3]
    served = server.client.models.list().data[0].id
    alone = [server.client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": p}], max_tokens=24, temperature=0
    ).choices[0].message.content for p in good]
    url = server.url + "/v1/chat/completions"
    bad = [(json.dumps(body).encode(), status) for body, status in BAD]
    bad += [(b"{" + b" " * (70 * 1024) + b"}", 413)]  # over the body limit
    bad += [(body, None) for body in _malformed_bodies(80, seed=7)]
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(_stream_tokens, server, p) for p in good]
        replies = list(pool.map(
            lambda item: (item, httpx.post(url, content=item[0], headers={"content-type": "application/json"},
                                           timeout=60)), bad))
        chunked = pool.submit(httpx.post, url, content=iter([b'{"messages": [' + b" " * 1024] * 70),
                              headers={"content-type": "application/json"}, timeout=60)  # no length declared
        streamed = [s.result() for s in streams]
    assert streamed == alone
    assert chunked.result().status_code == 413 and "over 65536 bytes" in chunked.result().json()["error"]["message"]
    for (body, expected), reply in replies:
        assert reply.status_code < 500, (body[:120], reply.text[:200])
        assert reply.status_code == expected or expected is None, (body[:120], reply.status_code, reply.text[:200])
        if reply.status_code >= 400:
            assert reply.json()["error"]["message"]
    _assert_healthy_and_idle(server)


def test_seed_reproduces_a_sampled_answer(server):
    body = {**OK, "temperature": 1.0, "seed": 1234, "max_tokens": 16}
    first, second = (httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json() for _ in range(2))
    assert first["specstand"]["token_ids"] == second["specstand"]["token_ids"]


def test_stop_strings_cut_the_answer_streaming_or_not(server):
    prompt, served = PROMPTS[0], server.client.models.list().data[0].id
    messages = [{"role": "user", "content": prompt}]
    full = server.client.chat.completions.create(model=served, messages=messages, max_tokens=24,
                                                 temperature=0).choices[0].message.content
    words = full.split()
    assert len(words) > 3, full
    stop = " ".join(words[2:4])
    reply = server.client.chat.completions.create(model=served, messages=messages, max_tokens=24, temperature=0,
                                                  stop=[stop])
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    chunks = server.client.chat.completions.create(model=served, messages=messages, max_tokens=24, temperature=0,
                                                   stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[: full.index(stop)]
    _assert_healthy_and_idle(server)


class PoisonedDrafter(NgramDrafter):
    """n-gram drafts; a request whose prompt holds the word w77 makes the drafter raise mid-answer."""

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        if 77 + 3 in seq.token_ids[: seq.prompt_len] and len(seq.token_ids) > seq.prompt_len + 2:
            raise RuntimeError("injected fault")
        return super().propose(seq, max_tokens)


def test_a_request_killed_mid_step_fails_alone(tiny_model_dir):
    live = LiveServer(tiny_model_dir, method="ngram", max_batch=3, max_queue=8, adaptive=False)
    live.worker.engine.drafter = PoisonedDrafter()
    try:
        good = PROMPTS[:2]
        alone = [_tokens_alone(live, p) for p in good]
        url = live.url + "/v1/chat/completions"
        poisoned = {"messages": [{"role": "user", "content": "w77 w1 w2"}], "max_tokens": 24, "temperature": 0}
        with ThreadPoolExecutor(3) as pool:
            together = [pool.submit(_tokens_alone, live, p) for p in good]
            failed = pool.submit(httpx.post, url, json=poisoned, timeout=60).result()
            assert [t.result() for t in together] == alone
        assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
        with httpx.stream("POST", url, json={**poisoned, "stream": True}, timeout=60) as reply:
            lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
        assert "injected fault" in lines[-1]
        assert 'outcome="failed"' in httpx.get(live.url + "/metrics").text
        _assert_healthy_and_idle(live)
    finally:
        live.close()


def test_deadline_and_health_tell_the_truth(tiny_model_dir):
    live = LiveServer(tiny_model_dir, method="none", max_batch=1, max_queue=4,
                      limits=ServerLimits(request_timeout_s=1.0))
    release = threading.Event()
    step = live.worker.engine.step

    def stuck_step():
        release.wait(timeout=30)
        return step()

    live.worker.engine.step = stuck_step
    try:
        reply = httpx.post(live.url + "/v1/chat/completions", json={**OK, "max_tokens": 50}, timeout=30)
        assert reply.status_code == 504
        live.worker.stall_s = 0.2  # the engine holds work and has not finished a step since
        time.sleep(0.3)
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and "no engine step" in health.json()["error"]["message"]
        live.worker.stall_s = 300.0
        release.set()
        live.worker.engine.step = step
        _assert_healthy_and_idle(live)
        live.worker.stop()  # the engine thread is gone: unhealthy, whatever else answers
        assert httpx.get(live.url + "/health").status_code == 503
    finally:
        release.set()
        live.close()


def test_an_agent_loop_through_the_openai_client(server):
    """What an agent sends with the official client: tools offered, the assistant's tool call and the tool's
    result sent back (content None beside tool_calls), streaming and not."""
    served = server.client.models.list().data[0].id
    tools = [{"type": "function", "function": {"name": "lookup", "description": "w5 w6",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [
        {"role": "system", "content": "w1 w2"},
        {"role": "user", "content": [{"type": "text", "text": "w3 w4"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "w7 w8"},
    ]
    reply = server.client.chat.completions.create(model=served, messages=messages, tools=tools, tool_choice="auto",
                                                  max_tokens=8, temperature=0, seed=5)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length") and text is not None
    chunks = server.client.chat.completions.create(model=served, messages=messages, tools=tools, max_tokens=8,
                                                   temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        server.client.chat.completions.create(model=served, messages=messages, max_tokens=4, logprobs=True)


def test_a_body_the_server_cannot_read_is_answered_with_what_to_fix(server):
    url = server.url + "/v1/chat/completions"
    broken = httpx.post(url, content=b'{"messages": [,]}', headers={"content-type": "application/json"}, timeout=30)
    assert broken.status_code == 400
    assert broken.json()["error"]["message"].startswith("the request body is not valid JSON (character 14")
    untyped = httpx.post(url, content=json.dumps(OK).encode(),
                         headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)
    assert untyped.status_code == 400 and "Content-Type: application/json" in untyped.json()["error"]["message"]
    both = httpx.post(url, json={**OK, "presence_penalty": 0.5, "logit_bias": {"5": 10}}, timeout=30).json()["error"]
    assert both["message"] == "presence_penalty, logit_bias are not supported by this server"
    assert both["param"] == "presence_penalty"


def test_an_answer_cut_at_a_stop_string_keeps_the_tokens_up_to_it():
    """A verified draft brings several tokens in one pass: those after the one that completes the stop string
    are not the answer's (nor in its usage), as vLLM counts them."""
    from types import SimpleNamespace

    from specstand.engine import StepEvent
    from specstand.server.completions import AnswerText

    words = SimpleNamespace(decode=lambda ids: "".join(f" w{t}" for t in ids))
    answer = AnswerText(words, ["w3 w4"])
    answer.add(StepEvent(0, [1, 2]))
    answer.add(StepEvent(0, [3, 4, 5, 6]))  # the stop completes at 4
    assert answer.stopped and answer.token_ids == [1, 2, 3, 4] and answer.text() == " w1 w2 "
