"""The server answers the official OpenAI client, batches concurrent calls, and survives bad input."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from specstand.cli import main
from specstand.models import load_model
from specstand.server import ServerConfig, build_server

PROMPTS = ["w3 w4 w5 w3 w4 w5 w3", "w9 w8 w7 w9 w8", "w20 w21 w22 w23 w20 w21", "w5", "w40 w41 w40 w41 w40"]


class LiveServer:
    def __init__(self, model_dir, dtype: str = "bf16", **config):
        self.app, self.worker = build_server(lambda: load_model(str(model_dir), dtype, 512), ServerConfig(**config))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=config.get("api_key") or "unused",
                                    max_retries=0, timeout=60)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.worker.stop()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    live = LiveServer(tiny_model_dir, method="ngram", max_batch=3, max_queue=16, adaptive=False)
    yield live
    live.close()


def _generate_ids(capsys, model_dir, prompt_file):
    assert main(["generate", "--model", str(model_dir), "--method", "none", "--messages-file", str(prompt_file),
                 "--max-tokens", "16", "--json", "--max-seq-len", "512"]) == 0
    return json.loads(capsys.readouterr().out)["token_ids"]


def test_openai_client_matches_specstand_generate(server, tiny_model_dir, tmp_path, capsys):
    served = server.client.models.list().data[0].id
    for prompt in PROMPTS[:3]:
        reply = server.client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0)
        path = tmp_path / "m.json"
        path.write_text(json.dumps([{"role": "user", "content": prompt}]))
        assert reply.model_extra["specstand"]["token_ids"] == _generate_ids(capsys, tiny_model_dir, path)
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage.completion_tokens == len(reply.model_extra["specstand"]["token_ids"])


def test_concurrent_requests_share_passes_and_match_single_runs(server):
    served = server.client.models.list().data[0].id

    def ask(prompt):
        reply = server.client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
        return reply.model_extra["specstand"]["token_ids"]

    passes = [0]
    run, step = server.worker.engine.runner.run, server.worker.engine.step

    def counted(*args, **kwargs):
        passes[0] += not kwargs.get("prefill")
        return run(*args, **kwargs)

    def gated_step():  # the concurrent requests all arrive before the engine moves: a fixed schedule
        deadline = time.time() + 30
        while len(server.worker._tickets) < len(PROMPTS) and time.time() < deadline:
            time.sleep(0.01)
        server.worker.engine.step = step  # once
        return step()

    server.worker.engine.runner.run = counted
    try:
        single = [ask(p) for p in PROMPTS]
        alone = passes[0]
        server.worker.engine.step = gated_step
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(ask, PROMPTS))
        shared = passes[0] - alone
    finally:
        server.worker.engine.runner.run, server.worker.engine.step = run, step
    assert together == single
    # batched: decode passes carried several requests (3 slots for 5 requests: well under the sum)
    assert shared < 0.75 * alone, (shared, alone)


def test_streaming_and_completions(server):
    served = server.client.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPTS[0]}]
    full = server.client.chat.completions.create(model=served, messages=messages, max_tokens=16, temperature=0)
    chunks = server.client.chat.completions.create(model=served, messages=messages, max_tokens=16, temperature=0,
                                                   stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    # stream_options.include_usage: one last chunk with the usage and no choices, the whole answer's
    chunks = list(server.client.chat.completions.create(model=served, messages=messages, max_tokens=16,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    completion = server.client.completions.create(model=served, prompt="w3 w4 w5", max_tokens=8, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length")
    # the completions fields the engine does not do are refused, never dropped in silence
    for field, value in (("echo", True), ("best_of", 2), ("suffix", " w9")):
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "w3", "max_tokens": 2, field: value},
                           timeout=30)
        assert reply.status_code == 400 and field in reply.json()["error"]["message"], field
    neutral = {"prompt": "w3", "max_tokens": 2, "echo": False, "best_of": 1, "suffix": ""}
    assert httpx.post(server.url + "/v1/completions", json=neutral, timeout=30).status_code == 200


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    url = server.url + "/v1/chat/completions"
    ok = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 4, "temperature": 0}
    cases = [
        (b"{not json", 400),
        (json.dumps({**ok, "max_tokens": "many"}).encode(), 400),
        (json.dumps({**ok, "max_tokens": 0}).encode(), 400),
        (json.dumps({**ok, "messages": []}).encode(), 400),
        (json.dumps({**ok, "temperature": -1}).encode(), 400),
        (json.dumps({**ok, "messages": [{"role": "user", "content": " ".join(["w2"] * 600)}]}).encode(), 400),
        (json.dumps({**ok, "model": "other-model"}).encode(), 404),
    ]
    for body, status in cases:
        reply = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert reply.status_code == status, body[:80]
        assert reply.json()["error"]["message"]
    assert httpx.post(url, json=ok, timeout=30).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def _samples(text: str) -> dict[str, float]:
    """Sample lines only (HELP/TYPE lines skipped), labels folded into the name, values summed."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{")[0] + ("{position=" + name.split('position="')[1].split('"')[0] + "}"
                                    if 'position="' in name else "")
        values[key] = values.get(key, 0.0) + float(value)
    return values


def test_reset_prefix_cache_forgets_cached_prompts(server):
    served = server.client.models.list().data[0].id
    messages = [{"role": "user", "content": " ".join(f"w{i % 37}" for i in range(150))}]

    def ask():
        reply = server.client.chat.completions.create(model=served, messages=messages, max_tokens=8, temperature=0)
        return reply.choices[0].message.content, reply.model_extra["specstand"]["stats"]["cached_prompt_tokens"]

    first, _ = ask()
    again, cached = ask()
    assert cached > 0 and again == first
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 200
    after_reset, cached = ask()
    assert cached == 0 and after_reset == first


def test_metrics_use_vllm_names_and_count_what_happened(server):
    served = server.client.models.list().data[0].id
    before = _samples(httpx.get(server.url + "/metrics").text)
    reply = server.client.chat.completions.create(model=served, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                  max_tokens=16, temperature=0)
    after = _samples(httpx.get(server.url + "/metrics").text)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    stats = reply.model_extra["specstand"]["stats"]
    assert grew("vllm:spec_decode_num_drafts_total") == stats["passes_with_draft"] > 0
    assert grew("vllm:spec_decode_num_draft_tokens_total") == stats["drafted_tokens"]
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == stats["accepted_tokens"]
    assert sum(grew(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}")
               for i in range(8)) == stats["accepted_tokens"]
    assert grew("specstand:target_passes_total") == stats["target_passes"]
    assert grew("specstand:passes_without_draft_total") == stats["target_passes"] - stats["passes_with_draft"]
    assert grew("specstand:emitted_tokens_total") == reply.usage.completion_tokens
    assert after["specstand:tau"] > 1.0
    assert abs(grew("specstand:draft_seconds_total") - stats["draft_seconds"]) < 1e-6
    assert after["specstand:pass_seconds_profiled"] > 0  # a plain step and a full verify, profiled at start
    assert after["specstand:num_speculative_tokens"] == server.worker.engine.config.num_speculative_tokens == 5
    assert "specstand:pass_seconds_estimated" not in after  # fixed K: no pass is priced


def test_an_adaptive_server_shows_its_pass_costs_as_the_passes_corrected_them(tiny_model_dir):
    live = LiveServer(tiny_model_dir, method="ngram", max_batch=2, max_queue=4)  # adaptive verification
    try:
        served = live.client.models.list().data[0].id
        live.client.chat.completions.create(model=served, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=16, temperature=0)
        cost, width = live.worker.engine.estimated_pass_cost, live.worker.engine.width
        for _ in range(100):  # the worker sets the gauge after it hands the answer out: let it
            text = httpx.get(live.url + "/metrics").text
            estimated = {line.split('rows="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                         for line in text.splitlines() if line.startswith("specstand:pass_seconds_estimated{")}
            if set(estimated) == {"1", str(width)} and all(
                    seconds == pytest.approx(cost(int(rows))) for rows, seconds in estimated.items()):
                break
            time.sleep(0.05)
        assert set(estimated) == {"1", str(width)}
        assert all(seconds == pytest.approx(cost(int(rows))) for rows, seconds in estimated.items())
    finally:
        live.close()


def test_disconnect_frees_the_slot(tiny_model_dir):
    live = LiveServer(tiny_model_dir, method="none", max_batch=1, max_queue=4)
    # Hold the engine until the server has seen the hang-up, so the answer cannot finish first (a race the
    # tiny model used to win now and then): every step waits for the worker's cancel call.
    hung_up = threading.Event()
    cancel, step = live.worker.cancel, live.worker.engine.step

    def cancel_and_release(ticket: int, outcome: str = "cancelled") -> None:
        cancel(ticket, outcome)
        hung_up.set()

    def held_step():
        assert hung_up.wait(timeout=30), "the server never saw the client hang up"
        return step()

    live.worker.cancel, live.worker.engine.step = cancel_and_release, held_step
    try:
        body = {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 400, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as reply:
            next(reply.iter_lines())  # the first chunk arrived; now hang up
        deadline = time.time() + 20
        while 'outcome="cancelled"' not in httpx.get(live.url + "/metrics").text:
            assert time.time() < deadline, "the abandoned request kept its slot"
            time.sleep(0.1)
        served = live.client.models.list().data[0].id
        reply = live.client.chat.completions.create(model=served, messages=[{"role": "user", "content": "w3"}],
                                                    max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        live.close()


def test_overload_answers_429(tiny_model_dir):
    live = LiveServer(tiny_model_dir, method="none", max_batch=1, max_queue=1)
    try:
        body = {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 200, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda _: httpx.post(live.url + "/v1/chat/completions", json=body,
                                                       timeout=60).status_code, range(4)))
        assert 429 in codes and 200 in codes
    finally:
        live.close()


def test_a_base_model_serves_completions_and_refuses_chat(tmp_path):
    """A model without a chat template (as the gemma3-270m preset): /v1/completions answers; a chat
    request gets a 400 that says why, and the server keeps serving."""
    from transformers import AutoTokenizer

    from tests.conftest import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny-gemma3", "gemma3", chat_template=False)
    live = LiveServer(folder, method="suffix")
    try:
        served = live.client.models.list().data[0].id
        # greedy: an unseeded sampled answer depends on the process's random state, so on the tests run before
        completion = httpx.post(live.url + "/v1/completions", json={
            "model": served, "prompt": "w3 w4 w5 w3 w4", "max_tokens": 8, "temperature": 0}, timeout=30).json()
        ids = completion["specstand"]["token_ids"]
        assert ids and completion["usage"]["completion_tokens"] == len(ids)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert completion["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        refused = httpx.post(live.url + "/v1/chat/completions", json={
            "model": served, "messages": [{"role": "user", "content": "w3"}], "max_tokens": 4}, timeout=30)
        assert refused.status_code == 400 and "no chat template" in refused.json()["error"]["message"]
        after = live.client.completions.create(model=served, prompt="w5", max_tokens=4, temperature=0)
        assert after.choices[0].finish_reason in ("stop", "length") and 1 <= after.usage.completion_tokens <= 4
    finally:
        live.close()


def test_completions_take_token_ids_as_the_prompt(server, tiny_model_dir):
    """The OpenAI API's token-array prompt: used as given (train-data --endpoint relies on it); ids outside
    the vocabulary are a 400."""
    from transformers import AutoTokenizer

    served = server.client.models.list().data[0].id
    prompt_ids = AutoTokenizer.from_pretrained(tiny_model_dir)("w3 w4 w5")["input_ids"]
    text = httpx.post(server.url + "/v1/completions", json={"model": served, "prompt": "w3 w4 w5", "max_tokens": 6,
                                                             "temperature": 0}, timeout=30).json()
    ids = httpx.post(server.url + "/v1/completions", json={"model": served, "prompt": prompt_ids, "max_tokens": 6,
                                                            "temperature": 0}, timeout=30).json()
    assert ids["specstand"]["token_ids"] == text["specstand"]["token_ids"]
    bad = httpx.post(server.url + "/v1/completions", json={"model": served, "prompt": [3, 10_000]}, timeout=30)
    assert bad.status_code == 400 and "token ids" in bad.json()["error"]["message"]


def test_schema_drafting_reads_the_tools_a_chat_request_offers(tiny_model_dir):
    live = LiveServer(tiny_model_dir, "fp32", method="schema", max_batch=2)
    try:
        drafter, offered = live.worker.engine.drafter, []
        begin = drafter.begin

        def recording_begin(seq) -> None:
            offered.append(seq.tools)
            begin(seq)

        drafter.begin = recording_begin
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
        ask = {"model": live.client.models.list().data[0].id, "max_tokens": 4, "temperature": 0,
               "messages": [{"role": "user", "content": "w3 w4 w5"}]}
        live.client.chat.completions.create(**ask)
        live.client.chat.completions.create(**ask, tools=tools)  # the answer's losslessness: tests/engine
        live.client.chat.completions.create(**ask, tools=tools, tool_choice="none")  # tools not offered
        assert offered == [None, tools, None]
    finally:
        live.close()


def test_the_default_answer_fits_whatever_rows_a_pass_is_padded_to(tiny_model_dir):
    """With no max_tokens, an answer may take the room the prompt leaves, less a whole pass of rows: the
    engine's exact passes may be padded past K + 1 rows (row_unit), and a default it refuses is a 400."""
    live = LiveServer(tiny_model_dir, method="ngram", max_batch=1, max_queue=4, adaptive=False)
    try:
        engine = live.worker.engine
        engine.row_unit = engine.width + 2  # as where the kernels pad passes to more rows than a draft has
        room = engine.answer_room(0)
        prompt = [5] * (room - 3)  # leaves 3 tokens of answer: the default must not be more
        reply = httpx.post(live.url + "/v1/completions", json={"prompt": prompt, "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] <= 3
    finally:
        live.close()
