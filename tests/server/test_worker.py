"""The engine thread builds what it runs: every pass of a served model, the model's loading and the start-up
profile included, starts its parallel work from that one thread (worker.py says why)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from specstand.engine import EngineTimes, Request
from specstand.models import load_model
from specstand.server import ServerConfig, build_server
from specstand.server import worker as worker_module
from specstand.server.metrics import ServerMetrics
from specstand.server.worker import EngineWorker


def _samples(text: str) -> dict[str, float]:
    """Each sample's value by its name and outcome label (other labels summed over)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (f"/{sample.labels['outcome']}" if "outcome" in sample.labels else "")
            values[key] = values.get(key, 0.0) + sample.value
    return values


FINISHED, CANCELLED, FAILED = (f"specstand:requests_total/{outcome}" for outcome in ("finished", "cancelled", "failed"))


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


class _FakeEngine:
    """An engine whose one step finishes every request, once `release` is set, or raises `error`."""

    width = 1
    estimated_pass_cost = None

    def __init__(self, error: Exception | None = None) -> None:
        self.times, self.prefix_cache = EngineTimes(), SimpleNamespace(store=None)
        self.release, self.error, self._work = threading.Event(), error, []

    @property
    def has_work(self) -> bool:
        return bool(self._work)

    def check_request(self, request) -> None:
        pass

    def add_request(self, request) -> int:
        self._work.append(request)
        return len(self._work) - 1

    def reset(self) -> None:
        self._work.clear()

    def step(self) -> list:
        if self.error is not None:
            raise self.error
        self.release.wait(30)
        self._work.clear()
        return []


def _submit(worker: EngineWorker) -> asyncio.Queue:
    async def submitted():
        return worker.submit(Request([1, 2, 3], 4))[1]

    return asyncio.run(submitted())


def test_a_request_after_a_long_idle_is_no_stall_and_a_step_stuck_past_the_limit_is(monkeypatch):
    now = [0.0]  # the worker's clock, moved by hand: nothing here depends on how fast the host runs
    monkeypatch.setattr(worker_module, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                                perf_counter=time.perf_counter))
    engine = _FakeEngine()
    worker = EngineWorker(lambda: (engine, ServerMetrics("m")), max_queue=4, stall_s=300)
    worker.start()
    try:
        now[0] = 1000.0  # idle for 1000 s: nothing is wrong
        assert worker.problem() == ""
        _submit(worker)
        assert worker.problem() == ""  # the work just came (it read a stall at once: /health 503)
        now[0] = 1301.0
        assert "no engine step finished for 301 s" in worker.problem()
    finally:
        engine.release.set()
        worker.stop()


def test_a_failed_step_counts_its_requests_as_failed_and_its_time_as_engine_time():
    metrics = ServerMetrics("m")
    worker = EngineWorker(lambda: (_FakeEngine(RuntimeError("a kernel blew up")), metrics), max_queue=4)
    worker.start()

    async def failed():
        return await asyncio.wait_for(worker.submit(Request([1, 2, 3], 4))[1].get(), 30)

    try:
        assert isinstance(asyncio.run(failed()), RuntimeError)
    finally:
        worker.stop()
    text = metrics.render().decode()
    assert _samples(text)[FAILED] == 1
    busy = sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "specstand:engine_seconds_total" and sample.labels["phase"] != "idle")
    assert busy > 0


def test_an_answer_a_stop_string_ends_counts_as_finished_with_its_work(tiny_model_dir):
    app, worker = build_server(lambda: load_model(str(tiny_model_dir), "bf16", 256), ServerConfig(method="ngram"))
    try:
        with TestClient(app) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "max_tokens": 24, "temperature": 0,
                    "messages": [{"role": "user", "content": "w3 w4 w5 w3 w4"}]}
            whole = client.post("/v1/chat/completions", json=body).json()
            text = whole["choices"][0]["message"]["content"]
            stop = text[len(text) // 4 : len(text) // 4 + 3]  # well before the engine's end of the answer
            before = _samples(client.get("/metrics").text)
            cut = client.post("/v1/chat/completions", json={**body, "stop": [stop]}).json()
            assert cut["choices"][0]["finish_reason"] == "stop"
            assert "stats" not in cut["specstand"]  # ended here before the engine: none rather than zeros
            assert len(cut["choices"][0]["message"]["content"]) < len(text)
            deadline = time.monotonic() + 30
            while (after := _samples(client.get("/metrics").text)).get(FINISHED) == before.get(FINISHED):
                assert time.monotonic() < deadline, "the stopped request never reached /metrics"
                time.sleep(0.02)
        assert after.get(CANCELLED, 0) == before.get(CANCELLED, 0)  # it was counted as cancelled
        prompt = whole["specstand"]["stats"]["prompt_tokens"]
        assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == prompt
    finally:
        worker.stop()
