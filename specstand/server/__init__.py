"""The OpenAI-compatible server around the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specstand.drafters import NgramConfig, default_k, make_drafter
from specstand.engine import Engine, EngineConfig
from specstand.engine.prefix_cache import default_store_bytes
from specstand.models import LoadedModel
from specstand.server.app import create_app
from specstand.server.bodies import ServerLimits
from specstand.server.metrics import ServerMetrics
from specstand.server.worker import EngineWorker

__all__ = ["ServerConfig", "ServerLimits", "build_server"]


@dataclass(frozen=True)
class ServerConfig:
    method: str = "none"
    num_speculative_tokens: int | None = None  # None: the method's default
    max_batch: int = 8
    max_queue: int = 64
    served_name: str = ""
    target_name: str = ""  # preset name, to find a shipped trained drafter
    drafter_path: Path | None = None
    ngram: NgramConfig | None = None  # n-gram sizes (vLLM's prompt_lookup_min/max)
    limits: ServerLimits = ServerLimits()
    adaptive: bool = True  # adaptive verification (engine/adaptive.py); False: fixed K
    tool_call_parser: str | None = None  # tool_calls.PARSERS; None: answers are never read for calls
    api_key: str | None = None  # required on /v1/* when set
    prefix_store_bytes: int | None = None  # host memory for cached heads beyond the slots; None: the default

    def name_in_api(self, model: LoadedModel) -> str:
        """The model's name in the API and on /metrics: --served-model-name, else the model's own."""
        return self.served_name or model.name


def build_server(load_model: Callable[[], LoadedModel], config: ServerConfig):
    """The FastAPI app and its engine worker (started); stop the worker when done. The model is loaded by
    `load_model` on the engine thread, where all of its passes run (worker.py says why)."""
    loaded: list[LoadedModel] = []

    def build() -> tuple[Engine, ServerMetrics]:
        model = load_model()
        loaded.append(model)
        drafter = make_drafter(config.method, model.decoder, config.target_name or model.name, config.drafter_path,
                               config.ngram, model.tokenizer)
        k = default_k(drafter, config.num_speculative_tokens)
        store = default_store_bytes() if config.prefix_store_bytes is None else config.prefix_store_bytes
        engine = Engine(model.decoder, drafter, EngineConfig(k, model.max_positions, config.max_batch,
                                                             adaptive=config.adaptive, prefix_store_bytes=store))
        metrics = ServerMetrics(config.name_in_api(model))
        metrics.set_exact(engine.exact)
        metrics.set_num_speculative_tokens(k if drafter is not None else 0)
        cost = engine.pass_cost()  # for the stand's predicted speedup: a plain step and a full verify
        for rows in sorted({1, engine.width}):
            metrics.set_pass_seconds(rows, cost(rows))
        return engine, metrics

    worker = EngineWorker(build, config.max_queue)
    worker.start()
    model = loaded[0]
    return create_app(model, worker, config.name_in_api(model), config.limits, config.tool_call_parser,
                      config.api_key), worker
