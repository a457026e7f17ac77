"""Prometheus metrics with vLLM's speculative-decoding names, plus the honest all-passes figures."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from specstand.engine import DecodeStats


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
        self.passes_without_draft = counter("specstand:passes_without_draft", "Target passes that had no draft.")
        self.emitted_tokens = counter("specstand:emitted_tokens", "Tokens emitted by the engine.")
        self.cached_prompt_tokens = counter("specstand:cached_prompt_tokens", "Prompt positions reused from cache.")
        self.requests = counter("specstand:requests", "Finished requests by outcome.", ("outcome",))
        self.tau = Gauge("specstand:tau", "Emitted tokens per target pass over all passes (cumulative).", labels,
                         registry=r)
        self.waiting = Gauge("specstand:requests_waiting", "Requests queued or running.", labels, registry=r)
        self.draft_seconds = counter("specstand:draft_seconds", "Time drafters spent proposing.")
        self.pass_seconds = Gauge("specstand:pass_seconds_profiled", "A target pass's seconds by rows, profiled at "
                                  "start (1 row: a plain step; K + 1 rows: a full verify).", [*labels, "rows"],
                                  registry=r)
        self.exact = Gauge("specstand:exact", "1 where greedy answers are token-identical to plain decoding by "
                           "construction (checked at start); 0 on the fallback forward where the check failed: "
                           "the stand's identical-answer rate then says how often drafts changed an answer.",
                           labels, registry=r)
        self._model = model_name
        self._totals = DecodeStats()

    def record(self, stats: DecodeStats, outcome: str) -> None:
        m = self._model
        self.num_drafts.labels(m).inc(stats.passes_with_draft)
        self.num_draft_tokens.labels(m).inc(stats.drafted_tokens)
        self.num_accepted_tokens.labels(m).inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(m, str(position)).inc(count)
        self.target_passes.labels(m).inc(stats.target_passes)
        self.passes_without_draft.labels(m).inc(stats.target_passes - stats.passes_with_draft)
        self.emitted_tokens.labels(m).inc(stats.emitted_tokens)
        self.cached_prompt_tokens.labels(m).inc(stats.cached_prompt_tokens)
        self.draft_seconds.labels(m).inc(stats.draft_seconds)
        self.requests.labels(m, outcome).inc()
        self._totals.merge(stats)
        self.tau.labels(m).set(self._totals.tau)

    def set_exact(self, exact: bool) -> None:
        self.exact.labels(self._model).set(int(exact))

    def set_pass_seconds(self, rows: int, seconds: float) -> None:
        self.pass_seconds.labels(self._model, str(rows)).set(seconds)

    def record_cancelled(self) -> None:
        self.requests.labels(self._model, "cancelled").inc()

    def set_waiting(self, count: int) -> None:
        self.waiting.labels(self._model).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
