"""Requests and their results."""

from __future__ import annotations

from dataclasses import dataclass, field

from specstand.engine.stats import DecodeStats
from specstand.verification import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    # what the answer's structure follows (drafters read them; nothing constrains decoding): the functions
    # offered, as OpenAI tools, and the response format asked for
    tools: list[dict] | None = None
    response_format: dict | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_tokens <= 0:
            raise ValueError("max_tokens must be > 0")


@dataclass
class GenerationResult:
    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (a stop token), "length", or "error" (this request alone failed: `error`)
    stats: DecodeStats
    error: str = ""


@dataclass
class StepEvent:
    """What one engine step produced for one request."""

    request_id: int
    new_tokens: list[int]
    finished: GenerationResult | None = None
