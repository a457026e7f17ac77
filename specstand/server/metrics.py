"""Prometheus metrics with vLLM's speculative-decoding names, plus the honest all-passes figures."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specstand.engine import DecodeStats, EngineTimes

# where the engine thread's time goes: the engine's own phases (EngineTimes) and the time it waited for work
PHASES = ("prompt", "decode", "draft", "other", "idle")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Target passes that verified a draft.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens.")
        self.accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens per draft position.", ("position",)
        )
        self.target_passes = counter("specstand:target_passes", "All target passes that emitted tokens.")
        self.drafter_runs = counter("specstand:drafter_runs", "Steps a drafter proposed for a request.")
        self.probes = counter("specstand:probes", "Drafter runs in steps that adaptive verification found slower "
                              "than plain decoding (probes: how it learns that drafting does not pay).")
        self.passes_without_draft = counter("specstand:passes_without_draft", "Target passes that had no draft.")
        self.emitted_tokens = counter("specstand:emitted_tokens", "Tokens emitted by the engine.")
        self.cached_prompt_tokens = counter("specstand:cached_prompt_tokens", "Prompt positions reused from cache.")
        # vLLM's prefix-cache names (tokens queried and found), so the stand reads specstand and vLLM alike
        self.prompt_tokens = counter("vllm:prompt_tokens",
                                     "Prompt tokens of requests that ended (finished, failed, cancelled once begun).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.store_hits = counter("specstand:prefix_store_hits", "Prompt tokens copied from the prefix store (the "
                                  "part of the hits that no slot held any more).")
        self.store_bytes = Gauge("specstand:prefix_store_bytes", "Bytes the prefix store holds.", labels, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Seconds a request waited for a slot.",
                                    labels, registry=r, buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.engine_seconds = counter("specstand:engine_seconds", "The engine thread's seconds by phase: prompt "
                                      "and decode/verify passes (a pass split by its rows), drafting, other "
                                      "engine work, idle (waiting for requests).", ("phase",))
        self.requests = counter("specstand:requests", "Requests that ended, by outcome (finished, failed, cancelled).",
                                ("outcome",))
        self.tau = Gauge("specstand:tau", "Emitted tokens per target pass over all passes (cumulative).", labels,
                         registry=r)
        self.waiting = Gauge("specstand:requests_waiting", "Requests queued or running.", labels, registry=r)
        self.draft_seconds = counter("specstand:draft_seconds", "Time drafters spent proposing.")
        self.pass_seconds = Gauge("specstand:pass_seconds_profiled", "A target pass's seconds by rows, profiled at "
                                  "start (1 row: a plain step; K + 1 rows: a full verify).", [*labels, "rows"],
                                  registry=r)
        self.pass_estimated = Gauge("specstand:pass_seconds_estimated", "A target pass's seconds by rows as "
                                    "adaptive verification prices it now: the start-up profile as the passes run "
                                    "have corrected it.", [*labels, "rows"], registry=r)
        self.num_speculative_tokens = Gauge("specstand:num_speculative_tokens", "K: the most draft tokens a pass "
                                            "verifies for a request (0: no drafter).", labels, registry=r)
        self.exact = Gauge("specstand:exact", "1 where greedy answers are token-identical to plain decoding by "
                           "construction (checked at start); 0 on the fallback forward where the check failed: "
                           "the stand's identical-answer rate then says how often drafts changed an answer.",
                           labels, registry=r)
        self._model = model_name
        self._totals = DecodeStats()
        for phase in PHASES:  # every phase shows, at 0 until it happens
            self.engine_seconds.labels(model_name, phase)

    def record(self, stats: DecodeStats, outcome: str) -> None:
        m = self._model
        self.num_drafts.labels(m).inc(stats.passes_with_draft)
        self.num_draft_tokens.labels(m).inc(stats.drafted_tokens)
        self.num_accepted_tokens.labels(m).inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(m, str(position)).inc(count)
        self.target_passes.labels(m).inc(stats.target_passes)
        self.passes_without_draft.labels(m).inc(stats.target_passes - stats.passes_with_draft)
        self.drafter_runs.labels(m).inc(stats.drafter_runs)
        self.probes.labels(m).inc(stats.probes)
        self.emitted_tokens.labels(m).inc(stats.emitted_tokens)
        self.cached_prompt_tokens.labels(m).inc(stats.cached_prompt_tokens)
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens)
        self.prefix_queries.labels(m).inc(stats.prompt_tokens)
        self.prefix_hits.labels(m).inc(stats.cached_prompt_tokens)
        self.store_hits.labels(m).inc(stats.stored_prompt_tokens)
        self.queue_time.labels(m).observe(stats.queue_seconds)
        self.draft_seconds.labels(m).inc(stats.draft_seconds)
        self.requests.labels(m, outcome).inc()
        self._totals.merge(stats)
        self.tau.labels(m).set(self._totals.tau)

    def add_engine_seconds(self, times: EngineTimes) -> None:
        """The engine's phases over some steps."""
        for phase in ("prompt", "decode", "draft", "other"):
            seconds = getattr(times, phase)
            if seconds > 0:
                self.engine_seconds.labels(self._model, phase).inc(seconds)

    def add_idle_seconds(self, seconds: float) -> None:
        """Time the engine thread waited for work."""
        self.engine_seconds.labels(self._model, "idle").inc(seconds)

    def set_store_bytes(self, nbytes: int) -> None:
        self.store_bytes.labels(self._model).set(nbytes)

    def set_num_speculative_tokens(self, k: int) -> None:
        self.num_speculative_tokens.labels(self._model).set(k)

    def set_exact(self, exact: bool) -> None:
        self.exact.labels(self._model).set(int(exact))

    def set_pass_seconds(self, rows: int, seconds: float) -> None:
        self.pass_seconds.labels(self._model, str(rows)).set(seconds)

    def set_pass_seconds_estimated(self, rows: int, seconds: float) -> None:
        self.pass_estimated.labels(self._model, str(rows)).set(seconds)

    def record_outcome(self, outcome: str, requests: int = 1) -> None:
        """Requests that end without stats: dropped while queued, or failed with an engine step."""
        self.requests.labels(self._model, outcome).inc(requests)

    def set_waiting(self, count: int) -> None:
        self.waiting.labels(self._model).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
