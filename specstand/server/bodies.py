"""What a request may send: the API's request bodies, range-checked by pydantic, and the server's bounds on them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specstand.server.errors import Refused


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * 2**20
    max_prompt_chars: int = 1_000_000  # checked before tokenising
    request_timeout_s: float = 600.0  # server-side deadline of a request, queueing included
    default_max_tokens: int = 256  # when the client sends none (cut to what the context leaves)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # chat templates may read more (e.g. `reasoning_content`)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # a last chunk with the usage and no choices, as OpenAI's


class SamplingFields(BaseModel):
    """The fields chat and plain completions share."""

    model_config = ConfigDict(extra="ignore")  # fields no engine needs (user, metadata, ...) are ignored

    model: str | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0, le=100, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1)  # -1 or 0: no top-k cut (vLLM uses -1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    stop: str | list[str] | None = None
    # refused unless left at their neutral value: the engine cannot honour them
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        """Every field set to something the engine does not do."""
        fields = ["logprobs"] if self.logprobs or self.top_logprobs else []
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                fields.append(name)
        if self.logit_bias:
            fields.append("logit_bias")
        if self.response_format and self.response_format.get("type", "text") != "text":
            fields.append("response_format")
        return fields

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)  # text, or token ids as the OpenAI API allows
    # refused unless left at their neutral value, as the shared ones above
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        fields = super().unsupported()
        return fields + [name for name, used in (("echo", self.echo), ("best_of", self.best_of not in (None, 1)),
                                                 ("suffix", bool(self.suffix))) if used]


def message_dict(message: ChatMessage) -> dict:
    """A message as chat templates read it: content parts joined into text (text parts only)."""
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise Refused(400, f"content part type {part.type!r} is not supported (text only)", "messages")
            texts.append(part.text)
        out["content"] = "".join(texts)
    elif message.content is None:
        out["content"] = None if message.tool_calls else ""
    return out


def prompt_chars(body: SamplingFields) -> int:
    if isinstance(body, CompletionRequest):
        return len(body.prompt)
    total = 0
    for m in body.messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(p.text or "") for p in m.content)
        total += len(json.dumps(m.tool_calls)) if m.tool_calls else 0
    return total + (len(json.dumps(body.tools)) if body.tools else 0)
