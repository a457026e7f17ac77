"""The engine thread builds what it runs: every pass of a served model, the model's loading and the start-up
profile included, starts its parallel work from that one thread (worker.py says why)."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from specstand.models import load_model
from specstand.server import ServerConfig, build_server


def test_the_engine_thread_loads_the_model_and_runs_every_pass(tiny_model_dir):
    threads = {"load": set(), "pass": set()}

    def load():
        threads["load"].add(threading.get_ident())
        return load_model(str(tiny_model_dir), "bf16", 256)

    app, worker = build_server(load, ServerConfig(method="ngram", max_batch=2))
    try:
        run = worker.engine.runner.run

        def recorded(*args, **kwargs):
            threads["pass"].add(threading.get_ident())
            return run(*args, **kwargs)

        worker.engine.runner.run = recorded
        with TestClient(app) as client:
            reply = client.post("/v1/chat/completions", json={
                "model": client.get("/v1/models").json()["data"][0]["id"], "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "w3 w4 w5 w3 w4"}]})
        assert reply.status_code == 200, reply.text
        assert threads["pass"], "no pass ran"
        assert threads["load"] == threads["pass"] == {worker._thread.ident}
        assert worker._thread.ident != threading.get_ident()
    finally:
        worker.stop()


def test_a_model_that_fails_to_load_fails_the_start_and_serves_nothing():
    def load():
        raise ValueError("no such model: nowhere")

    with pytest.raises(ValueError, match="no such model"):
        build_server(load, ServerConfig())
