"""Ollama's request bodies, and its ``options`` as the engine's sampling settings."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ...sampling_params import SamplingParams
from ...structured.spec import StructuredOutput
from ..protocol import Scheduled, WireModel

# Ollama's defaults where a request's options say nothing (its documented Modelfile defaults)
DEFAULT_OPTIONS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}


class Options(WireModel):
    """The ``options`` object: the sampling ones honoured; the load-time ones (num_ctx, num_gpu, num_thread, ...)
    accepted and ignored (one model is loaded with the server's settings), as any unknown field is."""

    num_predict: int | None = None  # -1: until the context ends
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = None


class OllamaMessage(WireModel):
    role: str
    content: str = ""
    images: list | None = None
    tool_calls: list | None = None
    thinking: str | None = None
    tool_name: str | None = None


class _Generating(Scheduled):
    model: str
    format: str | dict | None = None  # "json" or a JSON schema
    options: Options | None = None
    stream: bool = True
    keep_alive: Any = None  # accepted: one model stays loaded
    think: bool | None = None

    def sampling_params(self, user: str | None, deadline: float | None) -> SamplingParams:
        """ValueError naming a bad option."""
        given = (self.options or Options()).model_dump(exclude_none=True)
        o = {**DEFAULT_OPTIONS, **given}
        predict = o.get("num_predict")
        return SamplingParams(
            max_tokens=None if predict is None or predict < 0 else max(predict, 1),
            temperature=o["temperature"], top_k=o["top_k"], top_p=o["top_p"], min_p=o.get("min_p", 0.0),
            seed=o.get("seed"), stop=o.get("stop") or [], repetition_penalty=o.get("repeat_penalty", 1.0),
            presence_penalty=o.get("presence_penalty", 0.0), frequency_penalty=o.get("frequency_penalty", 0.0),
            structured=self.structured(), user=user, deadline=deadline, priority=self.priority)

    def structured(self) -> StructuredOutput | None:
        if self.format is None or self.format == "":
            return None
        if self.format == "json":
            return StructuredOutput("json_object")
        if isinstance(self.format, dict):
            return StructuredOutput.json_schema(self.format)
        raise ValueError(f"format must be \"json\" or a JSON schema, got {str(self.format)[:40]!r}")

    def template_variables(self) -> dict:
        return {} if self.think is None else {"enable_thinking": self.think}


class ChatRequest(_Generating):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list | None = None


class GenerateRequest(_Generating):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list | None = None
    context: list[int] | None = None  # deprecated in Ollama: the earlier answer's tokens, prepended


class EmbedRequest(WireModel):
    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: Any = None
    options: Options | None = None


class EmbeddingsRequest(WireModel):  # the legacy /api/embeddings
    model: str
    prompt: str
    keep_alive: Any = None
    options: Options | None = None


class ShowRequest(WireModel):
    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool = False
