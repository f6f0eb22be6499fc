"""OpenAI request schemas. Unknown fields are set aside (``WireModel``); fields the engine cannot honour fail with a
message."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..sampling_params import SamplingParams
from ..structured.spec import StructuredOutput, from_response_format, from_structured_outputs
from ..structured.tools import ToolRequest, template_messages, tool_request


MAX_USER_CHARS = 256  # a client's name for itself (fair shares, per-user metrics)


class WireModel(BaseModel):
    """A request body, or a part of one: fields the server does not know are kept aside (``model_extra``) for
    server.front to ignore with a warning or, under --strict-fields, refuse; NaN or Infinity in a number is a 400."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The dotted names of the fields ``model`` and its parts carry that their schemas do not know (a message's
    own extra keys aside: chat templates may read them)."""
    names = [prefix + k for k in (model.model_extra or {})] if isinstance(model, WireModel) else []
    for name, value in model:
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, WireModel):
                names += unknown_fields(item, f"{prefix}{name}[{i}]." if isinstance(value, list)
                                        else f"{prefix}{name}.")
    return names


class StreamOptions(WireModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Scheduled(WireModel):
    """JustAPI's scheduling fields, accepted beside every API family's own on its generating requests: how urgent
    the request is and how long it may take."""

    priority: int = 0  # vLLM's field: lower is more urgent (read under --scheduling-policy priority)
    timeout: float | None = Field(default=None, gt=0)  # JustAPI: seconds, then it ends with what it has


class _SamplingRequest(Scheduled):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True  # JustAPI extension: false turns speculative decoding off for this request
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in -100..100
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends the output before this many tokens
    best_of: int | None = None
    response_format: dict | None = None  # OpenAI: text, json_object, json_schema
    structured_outputs: dict | None = None  # vLLM: json, regex, choice, grammar, json_object

    def unsupported(self) -> str | None:
        """A message naming the first field set to something the engine cannot do, else None."""
        if self.best_of not in (None, 1) and self.best_of != self.n:
            return "best_of is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream: true"
        return None

    def structured(self) -> StructuredOutput | None:
        """The output constraint the request asks for (ValueError naming a malformed one)."""
        if self.structured_outputs is not None and self.response_format is not None:
            fmt = self.response_format.get("type") if isinstance(self.response_format, dict) else None
            if fmt != "text":
                raise ValueError("give either response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            return from_structured_outputs(self.structured_outputs)
        if self.response_format is not None:
            return from_response_format(self.response_format)
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, user: str | None = None,
                        deadline: float | None = None) -> SamplingParams:
        """The engine's settings; ``user`` and ``deadline`` as the server decided them (api key, --request-timeout)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_logit_bias(self.logit_bias),
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            n=self.n,
            skip_special_tokens=self.skip_special_tokens,
            speculative=self.speculative,
            structured=self.structured(),
            priority=self.priority,
            user=user,
            deadline=deadline,
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    def unsupported(self) -> str | None:
        if self.suffix is not None and not isinstance(self.prompt, str):
            return "suffix (fill-in-the-middle) needs a text prompt"
        if self.suffix is not None and self.echo:
            return "echo together with suffix is not supported"
        if self.echo and self.logprobs is not None:
            return "echo together with logprobs is not supported (prompt logprobs are not computed)"
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # variables for the chat template (Qwen3's enable_thinking, ...)
    reasoning_effort: str | None = None  # OpenAI's; "none" turns a template's thinking off (enable_thinking false)
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the answer
    thinking_budget: int | None = Field(default=None, ge=0)  # a reasoning model's most thinking tokens (Qwen's)

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    def unsupported(self) -> str | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs requires logprobs: true"
        return super().unsupported()

    def message_dicts(self) -> list[dict]:
        return message_dicts(self.messages)

    def template_variables(self) -> dict:
        """The chat template's extra variables: chat_template_kwargs, and enable_thinking from reasoning_effort where
        the kwargs do not set it."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
        return variables

    def tool_request(self) -> ToolRequest | None:
        return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)


class EmbeddingRequest(WireModel):
    """OpenAI's embeddings request; ``input`` is text, texts, token ids or lists of token ids."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    timeout: float | None = Field(default=None, gt=0)  # JustAPI: seconds, then 408 if not computed yet

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(x, list) and not x for x in v)):
            raise ValueError("input must not be empty")
        if isinstance(v, str) and not v:
            raise ValueError("input must not be an empty string")
        return v

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding: a text or its token ids."""
        v = self.input
        return [v] if isinstance(v, str) or isinstance(v[0], int) else list(v)


class TokenizeRequest(WireModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages as the chat template takes them (ValueError naming a malformed one)."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # the parts form: only text parts can be served
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise ValueError(f"message content of type {str(part.get('type'))[:40]!r} is not supported; "
                                     "only text")
                if not isinstance(part.get("text", ""), str):
                    raise ValueError("a text part's text must be a string")
                texts.append(part.get("text", ""))
            content = "".join(texts)
        message = {"role": m.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        out.append(message)
    return template_messages(out)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as JSON object keys) as (id, bias) pairs; ValueError naming a key that is not
    a token id."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            pairs.append((int(key), value))
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key[:40]!r}") from None
    return tuple(pairs)
