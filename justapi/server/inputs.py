"""A request's inputs made ready off the event loop: texts encoded, a chat rendered, a grammar compiled; what a
client got wrong in them answered as a 400 naming its field."""

from __future__ import annotations

import asyncio

from ..engine.protocol import Engine
from ..model.chat_template import ChatTemplateError
from ..model.tokenizer import TextError
from .errors import ApiError


async def prepare_grammar(engine: Engine, req, params, forced_tool: bool = False, field: str | None = None) -> None:
    """Compile the request's grammar in a thread: neither the event loop nor the engine loop waits for it. An error
    names where the constraint came from (``field``, else: a forced tool's parameters, structured_outputs or
    response_format)."""
    if params.structured is None:
        return
    field = field or ("tools" if forced_tool else "structured_outputs" if req.structured_outputs is not None else
                      "response_format")
    try:
        await asyncio.to_thread(engine.prepare, params)
    except ValueError as e:
        raise ApiError(400, f"{field}: {e}", param=field) from None
    except RecursionError:
        raise ApiError(400, f"{field}: the constraint is nested too deeply to compile", param=field) from None


async def chat_prompt(engine: Engine, messages: list[dict], add_generation_prompt: bool, tools=None,
                      variables: dict | None = None) -> list[int]:
    """The chat's token ids, the template rendered and encoded in a thread (never on the event loop)."""
    try:
        return await asyncio.to_thread(engine.render_chat, messages, add_generation_prompt, tools, variables)
    except (ChatTemplateError, TextError) as e:
        raise ApiError(400, str(e), param="messages") from None


async def encoded(field: str, encode, *args):
    """``encode(*args)`` in a thread (never on the event loop); text that is not Unicode is a 400 naming ``field``."""
    try:
        return await asyncio.to_thread(encode, *args)
    except TextError as e:
        raise ApiError(400, f"{field}: {e}", param=field) from None


def completion_prompts(tok, prompts: list, echo: bool) -> tuple[list[list[int]], list[str] | None]:
    """Each prompt's token ids (text encoded), and the echoed texts where asked: run in a thread."""
    ids_list = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    return ids_list, [p if isinstance(p, str) else tok.decode(p) for p in prompts] if echo else None
