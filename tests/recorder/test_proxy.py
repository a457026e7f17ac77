"""The recorder passes calls through and writes them as a replayable workload."""

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from specstand.recorder.proxy import Recording, TurnWriter, create_recorder
from specstand.workloads import load_workload


def _serve(app):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    server.thread = threading.Thread(target=server.run, daemon=True)
    server.thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}"


def _stop(*servers):
    """Stop and wait: the recorder writes its open turns on the way out."""
    for server in servers:
        server.should_exit = True
    for server in servers:
        server.thread.join(timeout=20)


def _upstream(held: threading.Event | None = None, arrived: threading.Event | None = None):
    """An echoing upstream; a call whose message is "slow" tells `arrived` and waits for `held` to be set."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        last = body["messages"][-1]["content"]
        if last == "busy":
            return JSONResponse({"error": {"message": "try later"}}, 503)
        if last == "slow":
            arrived.set()
            await asyncio.to_thread(held.wait, 30)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"echo {last}"},
                             "finish_reason": "stop"}], "usage": {"completion_tokens": 2}}

    return app


class _Clock:
    """The recording's clock, moved by the test: the recorded delays are exact however busy the host is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _recording(tmp_path, upstream_app):
    """The upstream and a recorder in front of it on a clock of the test's: (upstream, recorder, url, out, clock)."""
    upstream, upstream_url = _serve(upstream_app)
    out, clock = tmp_path / "recorded.jsonl", _Clock()
    recorder, url = _serve(create_recorder(upstream_url, out, clock=clock))
    return upstream, recorder, url, out, clock


def test_recorded_calls_keep_their_dependencies_and_pauses(tmp_path):
    upstream, recorder, url, out, clock = _recording(tmp_path, _upstream())
    try:
        def call(content, call_id, **headers):
            body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 7,
                    "response_format": {"type": "json_object"}}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                              headers={"X-Turn-Id": "t1", "X-Call-Id": call_id, **headers})

        assert call("plan", "plan").json()["choices"][0]["message"]["content"] == "echo plan"
        clock.now += 0.2  # the agent thinks for 200 ms
        with_parents = call("search", "search", **{"X-Parent-Call-Ids": "plan", "X-Stage": "tool"})
        assert with_parents.status_code == 200
        call("answer", "answer")  # no parent header: depends on everything finished before it
        call("answer", "answer-retry")  # an identical retry is recorded once
        httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                   headers={"X-Session-Id": "s2"}, timeout=30)
    finally:
        _stop(recorder, upstream)
    turns = {t.turn_id: t for t in load_workload(out)}
    assert set(turns) == {"t1", "s2"}
    calls = {c.id: c for c in turns["t1"].calls}
    assert list(calls) == ["plan", "search", "answer"]
    assert calls["search"].depends_on == ["plan"] and calls["search"].stage == "tool"
    assert calls["search"].delay_ms == 200.0
    assert calls["answer"].depends_on == ["plan", "search"]
    assert calls["plan"].expect_json and calls["plan"].max_tokens == 7
    assert calls["plan"].recorded["answer"] == "echo plan"


def test_a_call_sent_while_the_others_run_keeps_its_offset_from_the_turns_start(tmp_path):
    held, arrived = threading.Event(), threading.Event()
    upstream, recorder, url, out, clock = _recording(tmp_path, _upstream(held, arrived))

    def call(content):
        body = {"model": "m", "messages": [{"role": "user", "content": content}]}
        headers = {"X-Turn-Id": "t", "X-Call-Id": content}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30, headers=headers)

    try:
        with ThreadPoolExecutor(2) as pool:
            slow = pool.submit(call, "slow")
            assert arrived.wait(30)  # "slow" is in flight, held upstream
            clock.now += 0.3
            pool.submit(call, "later").result()  # sent while "slow" runs: it depends on nothing
            held.set()
            slow.result()
    finally:
        held.set()
        _stop(recorder, upstream)
    calls = {c.id: c for c in load_workload(out)[0].calls}
    assert calls["later"].depends_on == [] and calls["slow"].depends_on == []
    assert calls["later"].delay_ms == 300.0  # replayed 0.3 s into the turn, not with "slow"
    assert calls["slow"].delay_ms == 0.0


def test_a_turns_failed_first_try_adds_no_delay_to_the_call_recorded(tmp_path):
    """A request the upstream refused is not recorded: the retry that is starts the turn, 10 s of back-off or not."""
    upstream, recorder, url, out, clock = _recording(tmp_path, _upstream())
    try:
        for content in ("busy", "again"):
            body = {"model": "m", "messages": [{"role": "user", "content": content}]}
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30, headers={"X-Turn-Id": "t"})
            clock.now += 10
    finally:
        _stop(recorder, upstream)
    (call,) = load_workload(out)[0].calls
    assert call.recorded["answer"] == "echo again" and call.delay_ms == 0.0


TOKEN = "Bearer s3cret"


def _strict_upstream():
    """An upstream that wants a bearer token, fails on request, and answers tool calls (also streamed)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if request.headers.get("authorization") != TOKEN:
            return JSONResponse({"error": {"message": "no token"}}, 401)
        body = await request.json()
        if body.get("max_tokens") == 13:
            return JSONResponse({"error": {"message": "upstream broke"}}, 503)
        if body.get("stream") and body.get("max_tokens") == 31:  # a call streamed as OpenAI streams it
            async def call_chunks():
                for delta in ({"index": 0, "id": "c2", "type": "function", "function": {"name": "f", "arguments": ""}},
                              {"index": 0, "function": {"arguments": "{\"city\": "}},
                              {"index": 0, "function": {"arguments": "\"Oslo\"}"}}):
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [delta]}}]}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(call_chunks(), media_type="text/event-stream")
        if body.get("stream"):
            async def chunks():  # with a second choice's chunks between (n = 2): they are not choice 0's answer
                for index, piece in ((0, "{\"a\": "), (1, "other"), (0, "1}"), (1, " answer")):
                    yield "data: " + json.dumps({"choices": [{"index": index, "delta": {"content": piece}}]}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        return {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}

    return app


def test_headers_statuses_and_tool_calls_pass_through(tmp_path):
    upstream, upstream_url = _serve(_strict_upstream())
    out = tmp_path / "agent.jsonl"
    recorder, url = _serve(create_recorder(upstream_url, out))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    first = {"model": "m", "messages": [{"role": "user", "content": "book it"}], "tools": tools, "max_tokens": 32}
    second = {"model": "m", "tools": tools, "max_tokens": 32, "messages": [
        {"role": "user", "content": "book it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"ok\": true}"}]}
    auth = {"Authorization": TOKEN, "X-Turn-Id": "agent"}
    try:
        chat = f"{url}/v1/chat/completions"
        assert httpx.post(chat, json=first, timeout=30).status_code == 401  # no token: the upstream's answer
        reply = httpx.post(chat, json=first, headers=auth, timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["tool_calls"]
        failed = httpx.post(chat, json={**first, "max_tokens": 13}, headers=auth, timeout=30)
        assert failed.status_code == 503 and failed.json()["error"]["message"] == "upstream broke"
        with httpx.stream("POST", chat, json={**first, "max_tokens": 13, "stream": True}, headers=auth) as streamed:
            assert streamed.status_code == 503  # not a 200 stream around the error
        with httpx.stream("POST", chat, json={**second, "stream": True}, headers=auth) as streamed:
            assert streamed.status_code == 200 and "[DONE]" in "".join(streamed.iter_lines())
        with httpx.stream("POST", chat, json={**first, "stream": True, "max_tokens": 31}, headers=auth) as streamed:
            assert streamed.status_code == 200 and "[DONE]" in "".join(streamed.iter_lines())
        gone, gone_url = _serve(_strict_upstream())
        _stop(gone)
        unreachable, unreachable_url = _serve(create_recorder(gone_url, tmp_path / "none.jsonl"))
        assert httpx.post(f"{unreachable_url}/v1/chat/completions", json=first, timeout=30).status_code == 502
        _stop(unreachable)
    finally:
        _stop(recorder, upstream)
    text = out.read_text()
    assert "s3cret" not in text  # the token went upstream, never to the file
    (turn,) = load_workload(out)
    assert [c.tools for c in turn.calls] == [tools, tools, tools]
    assert turn.calls[1].messages[1]["content"] is None and turn.calls[1].recorded["answer"] == '{"a": 1}'
    assert turn.calls[0].recorded["tool_calls"] == [{"name": "f", "arguments": "{}"}]
    assert "tool_calls" not in turn.calls[1].recorded
    assert turn.calls[2].recorded["tool_calls"] == [{"name": "f", "arguments": '{"city": "Oslo"}'}]
    assert turn.calls[2].recorded["answer"] == ""


def test_turns_are_appended_once_finished(tmp_path):
    upstream, upstream_url = _serve(_upstream())
    out = tmp_path / "recorded.jsonl"
    recorder, url = _serve(create_recorder(upstream_url, out, turn_idle_s=0.3))
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Turn-Id": "a"}, timeout=30)
        deadline = time.time() + 10
        while not out.exists() or not out.read_text():
            assert time.time() < deadline, "a finished turn was not written"
            time.sleep(0.05)
        assert [t.turn_id for t in load_workload(out)] == ["a"]
        httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 5}, headers={"X-Turn-Id": "a"},
                   timeout=30)  # the turn goes on after it was written: a second part
    finally:
        _stop(recorder, upstream)
    assert [t.turn_id for t in load_workload(out)] == ["a", "a#2"]


def test_an_agent_records_through_to_a_keyed_specstand_server(tmp_path):
    """The openai client -> recorder -> `specstand serve` with an API key and tool calls: the key goes
    through (a wrong one gets the server's 401), and the server's tool calls are recorded."""
    import openai

    from tests.server.scripted_model import save_scripted_model
    from tests.server.test_server import LiveServer
    from tests.server.test_tool_call_server import ANSWER, ASK, TOOLS

    folder = save_scripted_model(tmp_path / "scripted", ANSWER["answer"])
    server = LiveServer(folder, tool_call_parser="json", api_key="k-38")
    out = tmp_path / "agent.jsonl"
    recorder, url = _serve(create_recorder(server.url, out))
    try:
        agent = openai.OpenAI(base_url=url + "/v1", api_key="k-38", max_retries=0, timeout=60)
        reply = agent.chat.completions.create(model=agent.models.list().data[0].id, messages=ASK, tools=TOOLS,
                                              temperature=0, max_tokens=200, extra_headers={"X-Turn-Id": "k"})
        assert reply.choices[0].finish_reason == "tool_calls"
        stranger = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model="m", messages=ASK, max_tokens=4)
    finally:
        _stop(recorder)
        server.close()
    (turn,) = load_workload(out)
    (call,) = turn.calls
    assert [[c["name"], json.loads(c["arguments"])] for c in call.recorded["tool_calls"]] == ANSWER["calls"]
    assert call.recorded["answer"] == ANSWER["content"] and "k-38" not in out.read_text()


def _record_session(out, turn_ids: list[str]) -> None:
    """One recording: each turn id's call, written once the turn is finished."""
    writer = TurnWriter(out)
    recording = Recording(writer, 30.0)
    for turn_id in turn_ids:
        turn = recording.turn_for({"x-turn-id": turn_id})
        now = time.time()
        recording.add(turn, {"messages": [{"role": "user", "content": f"{turn_id} {now}"}]}, {}, now, now, "ok")
        recording.done(turn)
        recording.flush(everything=True)
    writer.close()


def test_recorded_turn_ids_stay_unique_whatever_the_agent_names_them(tmp_path):
    """A second recording into the same file, an agent's ids with '#' in them, and a turn split in parts next
    to an agent's own "x#2": the file always loads (its turn ids are unique)."""
    out = tmp_path / "w.jsonl"
    _record_session(out, ["chat#1"])
    _record_session(out, ["chat#1"])
    assert [t.turn_id for t in load_workload(out)] == ["chat#1", "chat#1#2"]
    out.unlink()
    _record_session(out, ["x", "x", "x#2"])
    assert [t.turn_id for t in load_workload(out)] == ["x", "x#2", "x#2#2"]
