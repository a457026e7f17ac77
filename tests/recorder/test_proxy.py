"""The recorder passes calls through and writes them as a replayable workload."""

import asyncio
import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI

from specstand.recorder.proxy import create_recorder
from specstand.workloads import load_workload


def _serve(app):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}"


def _upstream():
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        await asyncio.sleep(0.1)
        last = body["messages"][-1]["content"]
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"echo {last}"},
                             "finish_reason": "stop"}], "usage": {"completion_tokens": 2}}

    return app


def test_recorded_calls_keep_their_dependencies_and_pauses(tmp_path):
    upstream, upstream_url = _serve(_upstream())
    out = tmp_path / "recorded.jsonl"
    recorder, url = _serve(create_recorder(upstream_url, out))
    try:
        def call(content, call_id, **headers):
            body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 7,
                    "response_format": {"type": "json_object"}}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                              headers={"X-Turn-Id": "t1", "X-Call-Id": call_id, **headers})

        assert call("plan", "plan").json()["choices"][0]["message"]["content"] == "echo plan"
        time.sleep(0.2)  # the agent thinks for 200 ms
        with_parents = call("search", "search", **{"X-Parent-Call-Ids": "plan", "X-Stage": "tool"})
        assert with_parents.status_code == 200
        call("answer", "answer")  # no parent header: depends on everything finished before it
        call("answer", "answer-retry")  # an identical retry is recorded once
        httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                   headers={"X-Session-Id": "s2"}, timeout=30)
    finally:
        recorder.should_exit = upstream.should_exit = True
    turns = {t.turn_id: t for t in load_workload(out)}
    assert set(turns) == {"t1", "s2"}
    calls = {c.id: c for c in turns["t1"].calls}
    assert list(calls) == ["plan", "search", "answer"]
    assert calls["search"].depends_on == ["plan"] and calls["search"].stage == "tool"
    assert 150 <= calls["search"].delay_ms <= 400
    assert calls["answer"].depends_on == ["plan", "search"]
    assert calls["plan"].expect_json and calls["plan"].max_tokens == 7
    assert calls["plan"].recorded["answer"] == "echo plan"
