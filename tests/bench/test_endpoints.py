"""Connection reuse between the stand's client and a server: neither closes what the other is about to use."""

import asyncio
import json

import httpx
import uvicorn

from specstand.bench.endpoints import KEEPALIVE_EXPIRY_S, OpenAIEndpoint
from specstand.cli.serving import KEEP_ALIVE_S
from specstand.workloads import Call


def test_idle_connections_expire_on_the_client_before_any_uvicorn_server_closes_them():
    # uvicorn's default (vLLM keeps it) closes idle connections after 5 s; a client that may still send on
    # one at that moment gets an empty ReadError instead of an answer
    server_default = uvicorn.Config(app=None).timeout_keep_alive
    assert server_default > KEEPALIVE_EXPIRY_S
    endpoint = OpenAIEndpoint("http://127.0.0.1:1")
    assert endpoint.client._transport._pool._keepalive_expiry == KEEPALIVE_EXPIRY_S


def test_specstand_serve_keeps_idle_connections_longer_than_httpx_clients_do():
    # the openai SDK is an httpx client: with its default pool it drops an idle connection first
    assert httpx.Limits().keepalive_expiry < KEEP_ALIVE_S


def test_the_api_key_is_sent_and_tool_calls_are_read():
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "find", "arguments": '{"a": 1}'}}]}
        return httpx.Response(200, json={"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                                         "usage": {"completion_tokens": 9}})

    endpoint = OpenAIEndpoint("http://stand.test", model="m", api_key="k1")
    endpoint.client = httpx.AsyncClient(transport=httpx.MockTransport(answer), headers=endpoint.client.headers)
    call = Call("a", messages=[{"role": "user", "content": "q"}], tools=[{"type": "function", "function": {}}])
    reply = asyncio.run(endpoint.complete(call))
    assert seen == ["Bearer k1"]
    assert (reply.text, reply.finish_reason, reply.completion_tokens) == ("", "tool_calls", 9)
    assert reply.tool_calls == [{"name": "find", "arguments": '{"a": 1}'}]
    assert json.loads(reply.tool_calls[0]["arguments"]) == {"a": 1}


def test_a_good_reply_with_null_usage_is_an_answer():
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "{}", "finish_reason": "stop"}],
                                         "usage": None})

    endpoint = OpenAIEndpoint("http://stand.test", model="m")
    endpoint.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    reply = asyncio.run(endpoint.complete(Call("a", prompt="q")))
    assert (reply.text, reply.completion_tokens) == ("{}", 0)


def _metrics_endpoint(pages: list[str]) -> OpenAIEndpoint:
    """An endpoint whose /metrics answers `pages` in turn (the last one from then on)."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=pages.pop(0) if len(pages) > 1 else pages[0])

    endpoint = OpenAIEndpoint("http://stand.test")
    endpoint.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return endpoint


def test_a_run_waits_for_the_server_to_drop_the_calls_it_cancelled():
    busy = '# TYPE specstand:requests_waiting gauge\nspecstand:requests_waiting{model_name="m"} 2.0\n'
    idle = busy.replace("2.0", "0.0")
    endpoint = _metrics_endpoint([busy, busy, idle])
    assert asyncio.run(endpoint.wait_idle(timeout_s=5, poll_s=0)) is True
    vllm = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 1.0\n'
    assert asyncio.run(_metrics_endpoint([vllm]).wait_idle(timeout_s=0.05, poll_s=0.01)) is False  # never idle
    # a server without such gauges is not waited for
    assert asyncio.run(_metrics_endpoint(["# TYPE other gauge\nother 3.0\n"]).wait_idle(timeout_s=5)) is None
    # nor one whose /metrics is no Prometheus text; it has no metrics to scrape either
    assert asyncio.run(_metrics_endpoint(["<html>hi</html>"]).wait_idle(timeout_s=5)) is None
    assert asyncio.run(_metrics_endpoint(["<html>hi</html>"]).scrape_metrics()) == {}


def test_a_runs_metrics_are_counters_increases_and_gauges_as_they_stand():
    from specstand.bench.run import _run_delta

    before = {"specstand:target_passes_total": 10.0, "specstand:pass_seconds_estimated[rows=6]": 0.020,
              "specstand:pass_seconds_profiled[rows=1]": 0.010, "specstand:num_speculative_tokens": 5.0}
    after = {"specstand:target_passes_total": 25.0, "specstand:pass_seconds_estimated[rows=6]": 0.024,
             "specstand:pass_seconds_profiled[rows=1]": 0.010, "specstand:num_speculative_tokens": 5.0}
    assert _run_delta(before, after) == {"specstand:target_passes_total": 15.0,
                                         "specstand:pass_seconds_estimated[rows=6]": 0.024,
                                         "specstand:pass_seconds_profiled[rows=1]": 0.010,
                                         "specstand:num_speculative_tokens": 5.0}
    # a counter labelled during the run (absent before) counts from 0
    assert _run_delta(before, {**after, "vllm:spec_decode_num_accepted_tokens_per_pos[0]": 4.0})[
        "vllm:spec_decode_num_accepted_tokens_per_pos[0]"] == 4.0
    # the scrape before the run failed, or the server restarted during it: its totals are not the run's
    assert _run_delta({}, after) == {}
    assert _run_delta(before, {**after, "specstand:target_passes_total": 3.0}) == {}
