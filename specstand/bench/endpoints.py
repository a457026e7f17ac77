"""An OpenAI-compatible endpoint (specstand, vLLM, SGLang, ...) as the replay sees it."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from specstand.bench.replay import Answer
from specstand.workloads import Call

# An idle pooled connection is dropped after this long: less than the 5 s after which uvicorn (so vLLM and
# specstand too) closes it, so a call never goes out on a connection the server is closing at that moment
# (seen on the stand: one call in 518 turns failed with an empty ReadError).
KEEPALIVE_EXPIRY_S = 2.0
# the samples the stand reads: speculative decoding, prefix caching, prompt tokens and per-request phase times
# under vLLM's names (specstand exports them too), and specstand's own
SCRAPED = ("vllm:spec_decode", "vllm:prefix_cache_", "vllm:prompt_tokens", "vllm:request_queue_time_seconds",
           "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "specstand:")
# the gauges of requests a server has in flight (queued or running)
IN_FLIGHT_GAUGES = frozenset(("specstand:requests_waiting", "vllm:num_requests_running", "vllm:num_requests_waiting"))


class OpenAIEndpoint:
    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 600,
                 api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        limits = httpx.Limits(max_connections=512, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.client = httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers)

    async def resolve_model(self) -> str:
        if self.model is None:
            reply = await self.client.get(f"{self.base_url}/v1/models")
            reply.raise_for_status()
            self.model = reply.json()["data"][0]["id"]
        return self.model

    async def complete(self, call: Call) -> Answer:
        model = await self.resolve_model()
        body = {"model": model, "max_tokens": call.max_tokens, "temperature": 0}
        if call.messages is not None:
            chat = {**body, "messages": call.messages}
            chat.update({k: v for k, v in (("tools", call.tools), ("tool_choice", call.tool_choice)) if v is not None})
            reply = await self.client.post(f"{self.base_url}/v1/chat/completions", json=chat)
        else:
            reply = await self.client.post(f"{self.base_url}/v1/completions", json={**body, "prompt": call.prompt})
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
        data = reply.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)  # a server may send "usage": null
        calls = [c.get("function") or {} for c in (choice.get("message") or {}).get("tool_calls") or []]
        tool_calls = [{"name": c.get("name"), "arguments": c.get("arguments")} for c in calls] or None
        return Answer(text or "", tokens, choice.get("finish_reason") or "", tool_calls)

    async def reset_prefix_cache(self) -> bool:
        """Ask the server to forget cached prompts (vLLM's and specstand's route; specstand also forgets
        its drafter's earlier answers), so a run does not find the previous run's turns. False where the
        server has no such route (vLLM answers it only with VLLM_SERVER_DEV_MODE=1)."""
        try:
            reply = await self.client.post(f"{self.base_url}/reset_prefix_cache")
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def scrape_metrics(self) -> dict[str, float]:
        """Counter totals by sample name (labels folded: per-position counters keep their position)."""
        totals: dict[str, float] = {}
        for sample in await self._metric_samples() or []:
            if not sample.name.startswith(SCRAPED) or sample.name.endswith(("_bucket", "_created")):
                continue
            key = sample.name
            if "position" in sample.labels:
                key += f"[{sample.labels['position']}]"
            for label in ("rows", "phase"):
                if label in sample.labels:
                    key += f"[{label}={sample.labels[label]}]"
            totals[key] = totals.get(key, 0.0) + sample.value
        return totals

    async def _metric_samples(self) -> list[Sample] | None:
        """Every sample of the server's /metrics (None where it has none to give)."""
        try:
            reply = await self.client.get(f"{self.base_url}/metrics")
        except httpx.HTTPError:
            return None
        if reply.status_code != 200:
            return None
        try:
            return [sample for family in text_string_to_metric_families(reply.text) for sample in family.samples]
        except ValueError:  # a page that is no Prometheus text (a proxy's HTML, say): no metrics either
            return None

    async def wait_idle(self, timeout_s: float = 10.0, poll_s: float = 0.05) -> bool | None:
        """Wait until the server runs and queues no request, as its gauges tell (specstand's, vLLM's): the calls
        a replay cancelled at its end are aborted only once the server notices the client gone, and the next
        run should not share the server with them. True once idle; False past the timeout; None at once where the
        server shows no such gauge."""
        deadline = time.monotonic() + timeout_s
        while True:
            in_flight = await self._requests_in_flight()
            if in_flight is None:
                return None
            if in_flight == 0:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(poll_s)

    async def _requests_in_flight(self) -> float | None:
        counts = [sample.value for sample in await self._metric_samples() or [] if sample.name in IN_FLIGHT_GAUGES]
        return sum(counts) if counts else None

    async def close(self) -> None:
        await self.client.aclose()
