"""Tool calls and the API key through a real server (HTTP, engine, parser) whose target answers a chosen
text, read by the official OpenAI client."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.scripted_model import save_scripted_model
from tests.server.test_server import LiveServer

CASES = {c["name"]: c for c in json.loads((Path(__file__).parent / "fixtures" / "tool_call_answers.json").read_text())}
ANSWER = CASES["text_then_call"]
KEY = "sk-test-key"
TOOLS = [{"type": "function", "function": {"name": name, "description": "d",
                                           "parameters": {"type": "object", "properties": {}}}}
         for name in ANSWER["tools"]]
ASK = [{"role": "user", "content": "music events in Portland on March 14"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_scripted_model(tmp_path_factory.mktemp("scripted"), ANSWER["answer"])
    live = LiveServer(folder, method="suffix", tool_call_parser="json", api_key=KEY)
    yield live
    live.close()


def test_tool_calls_non_streaming(server):
    reply = server.client.chat.completions.create(model=server.client.models.list().data[0].id, messages=ASK,
                                                  tools=TOOLS, temperature=0, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ANSWER["content"]
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert [call.function.name, json.loads(call.function.arguments)] == ANSWER["calls"][0]


def test_tool_calls_streaming(server):
    stream = server.client.chat.completions.create(model=server.client.models.list().data[0].id, messages=ASK,
                                                   tools=TOOLS, temperature=0, max_tokens=200, stream=True)
    content, calls, reasons = [], {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        if delta.content:
            content.append(delta.content)
        for part in delta.tool_calls or []:
            if part.id is not None:  # a call's first delta: its id, type, name and empty arguments
                assert part.type == "function" and part.function.arguments == ""
                calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
            calls[part.index]["arguments"] += part.function.arguments or ""
    assert "".join(content) == ANSWER["content"]
    assert not any(mark in piece for piece in content for mark in "`{<")
    assert [[c["name"], json.loads(c["arguments"])] for c in calls.values()] == ANSWER["calls"]
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_no_tools_or_tool_choice_none_leave_the_answer_as_content(server):
    model = server.client.models.list().data[0].id
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        reply = server.client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=200,
                                                      **extra)
        assert reply.choices[0].message.content == ANSWER["answer"] and not reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "stop"


def test_a_call_to_a_tool_not_offered_stays_content(server):
    other = [{"type": "function", "function": {"name": "Flights_1_Book", "parameters": {}}}]
    reply = server.client.chat.completions.create(model=server.client.models.list().data[0].id, messages=ASK,
                                                  tools=other, temperature=0, max_tokens=200)
    assert reply.choices[0].message.content == ANSWER["answer"] and not reply.choices[0].message.tool_calls


def test_api_key_guards_v1_only(server):
    body = {"messages": ASK, "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert reply.status_code == 401
        error = reply.json()["error"]
        assert error["type"] == "authentication_error" and error["param"] is None and error["message"]
    assert httpx.get(server.url + "/v1/models").status_code == 401
    ok = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                    timeout=30)
    assert ok.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 401
    assert httpx.post(server.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    bad_client = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()


def test_a_failed_request_logs_its_traceback_with_the_client_id(server, caplog, monkeypatch):
    def broken(_request):
        raise RuntimeError("worker exploded")

    monkeypatch.setattr(server.worker, "submit", broken)
    with caplog.at_level(logging.ERROR, logger="specstand.server"):
        reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "internal_error"
    request_id = reply.json()["error"]["message"].split("(request ")[1].split(")")[0]
    assert request_id.startswith("chatcmpl-")
    [record] = [r for r in caplog.records if request_id in r.getMessage()]
    assert record.levelno == logging.ERROR and record.exc_info and "worker exploded" in str(record.exc_info[1])
    monkeypatch.undo()
    assert server.client.chat.completions.create(model=server.client.models.list().data[0].id, messages=ASK,
                                                 max_tokens=4).choices[0].message.content


def test_a_tool_conversation_renders_on_a_template_without_tools(server):
    # the scripted template knows no tools: the conversation goes in chat.py's text form, never a 400
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "Events_3_FindEvents", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2 concerts"}]
    reply = server.client.chat.completions.create(model=server.client.models.list().data[0].id, messages=conversation,
                                                  tools=TOOLS, temperature=0, max_tokens=200)
    assert reply.choices[0].finish_reason == "tool_calls"


def _failed_request(server, caplog) -> tuple[str, list[logging.LogRecord]]:
    with caplog.at_level(logging.ERROR):
        reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert reply.status_code == 500
    request_id = reply.json()["error"]["message"].split("(request ")[1].split(")")[0]
    return request_id, list(caplog.records)


def test_a_request_failed_in_the_engine_is_logged_with_its_traceback_and_id(server, caplog, monkeypatch):
    def broken_pass(work):
        raise RuntimeError("pass exploded")

    monkeypatch.setattr(server.worker.engine, "_run", broken_pass)
    request_id, records = _failed_request(server, caplog)
    [engine] = [r for r in records if r.name == "specstand.engine.engine"]
    assert engine.exc_info and "pass exploded" in str(engine.exc_info[1])
    [served] = [r for r in records if r.name == "specstand.server.completions"]
    engine_request = engine.getMessage().split()[2]  # "engine request N failed"
    assert request_id in served.getMessage() and f"(engine request {engine_request})" in served.getMessage()


def test_a_failed_engine_step_is_logged_by_the_worker(server, caplog, monkeypatch):
    def broken_step():
        raise RuntimeError("step exploded")

    monkeypatch.setattr(server.worker.engine, "step", broken_step)
    request_id, records = _failed_request(server, caplog)
    [worker] = [r for r in records if r.name == "specstand.server.worker"]
    assert worker.levelno == logging.ERROR and "step exploded" in str(worker.exc_info[1])
    assert any(request_id in r.getMessage() for r in records if r.name == "specstand.server.completions")
    monkeypatch.undo()
    assert server.client.chat.completions.create(model=server.client.models.list().data[0].id, messages=ASK,
                                                 max_tokens=4).choices[0].message.content
