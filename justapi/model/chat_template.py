"""Chat templates from model files, rendered in a sandboxed Jinja environment (the templates are untrusted)."""

from __future__ import annotations

import json

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..structured.tools import with_generic_tools


MAX_RENDERED_CHARS = 4 << 20  # a template's output past this is refused (a loop in a hostile template)


class ChatTemplateError(ValueError):
    """The template is missing, broken, unsafe, or rejected the messages."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value, indent=None, **_):
    return json.dumps(value, indent=indent, ensure_ascii=False)


class ChatTemplate:
    """A compiled template; ``render`` turns OpenAI-style messages into the prompt text."""

    def __init__(self, source: str | None) -> None:
        self._source = source
        if not source:
            self._template = None
            return
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], undefined=jinja2.Undefined
        )
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None

    @property
    def available(self) -> bool:
        return self._template is not None

    @property
    def source(self) -> str | None:
        return self._source

    @property
    def renders_tools(self) -> bool:
        """Whether the template itself renders a request's tools (else they are described in the system message,
        structured.tools.with_generic_tools, and calls read in the hermes format)."""
        return bool(self._source) and "tools" in self._source

    def encode(self, tokenizer, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, variables: dict | None = None) -> list[int]:
        """Token ids of a conversation rendered with ``tokenizer``'s BOS and EOS strings and encoded by it."""
        text = self.render(messages, add_generation_prompt, tokenizer.bos_token, tokenizer.eos_token, tools, variables)
        return tokenizer.encode(text)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
               eos_token: str = "", tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """The prompt text; ``tools`` (OpenAI's function definitions) go to the template's ``tools`` variable;
        ``variables`` (a request's chat_template_kwargs, e.g. Qwen3's enable_thinking) are the template's too,
        but never in place of the ones named here."""
        if self._template is None:
            raise ChatTemplateError("the model file has no chat template; use the completions endpoint")
        if tools and not self.renders_tools:  # the functions described in the system message instead
            messages, tools = with_generic_tools(messages, tools), None
        try:
            text = self._template.render(**{**(variables or {}), "messages": messages, "tools": tools,
                                            "add_generation_prompt": add_generation_prompt, "bos_token": bos_token,
                                            "eos_token": eos_token})
            if len(text) > MAX_RENDERED_CHARS:
                raise ChatTemplateError(f"the chat template rendered {len(text)} characters; the limit is "
                                        f"{MAX_RENDERED_CHARS}")
            return text
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"the chat template tried an unsafe operation: {e}") from None
        except Exception as e:  # a template is a program from a file: any failure is the template's
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
