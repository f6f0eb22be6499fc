"""OpenAI's chat completions, completions, embeddings and models: each request's wire format onto the engine's
requests (server.front's shared steps) and the outputs back, whole or as SSE chunks (server.chunks)."""

import asyncio
import dataclasses

from fastapi import APIRouter, Request

from ...sampling_params import SamplingParams
from ..chat_tools import ChatTools, Thinking, steered
from ..chunks import ChatChunks, CompletionChunks
from ..errors import ApiError
from ..front import Front, collect, stream
from ..inputs import chat_prompt, completion_prompts, encoded, prepare_grammar
from ..protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from ..serving import (Choice, chat_logprobs, completion_logprobs, embedding_data, make_choices, new_id, now, sse,
                       usage)


def router(front: Front) -> APIRouter:
    api = APIRouter()
    _model_routes(api, front)
    _completion_routes(api, front)
    _chat_route(api, front)
    return api


def _model_routes(api: APIRouter, front: Front) -> None:
    @api.get("/v1/models")
    async def models():
        front.ready_llm()  # 503 while loading: clients poll this route for readiness
        return {"object": "list", "data": [_model_card(front)]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        front.ready_llm()
        front.check_model(model_id)
        return _model_card(front)


def _completion_routes(api: APIRouter, front: Front) -> None:
    """/v1/completions and /v1/embeddings: prompts as texts or token ids."""

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        llm = front.ready_llm()
        _checks(front, req)
        tok = front.engine.tokenizer
        prompts = req.prompt if isinstance(req.prompt, list) and not isinstance(req.prompt[0], int) else [req.prompt]
        front.check_fan_out(len(prompts), req.n, "prompt")
        front.check_token_ids(prompts, "prompt")
        params = _params_of(front, req, raw, req.max_tokens, req.logprobs)
        if req.suffix is not None:  # fill-in-the-middle: the prompt is the prefix
            ids_list, echo = [await _fim(front, req.prompt, req.suffix)], None
        else:
            ids_list, echo = await encoded("prompt", completion_prompts, tok, prompts, req.echo)
        await prepare_grammar(front.engine, req, params)
        choices = make_choices(ids_list, params, echo)
        front.validate(llm, choices)
        rid = new_id("cmpl")
        if req.stream:
            return stream(raw, llm, rid, choices, _sse(choices, req, CompletionChunks(rid, front.model_name, tok)))
        await collect(raw, llm, rid, choices)
        return {"id": rid, "object": "text_completion", "created": now(), "model": front.model_name,
                "choices": await asyncio.to_thread(_completion_entries, tok, choices), "usage": usage(choices)}

    @api.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request):
        front.ready_llm()
        front.accept(req)
        engine = front.engine
        pooling = front.embedding_pooling(req.dimensions)
        inputs = req.inputs()
        front.check_fan_out(len(inputs), 1, "input")
        front.check_token_ids(inputs, "input")
        ids_list, _ = await encoded("input", completion_prompts, engine.tokenizer, inputs, False)
        vectors, tokens = await front.pooled(raw, ids_list, pooling, req.user, req.timeout)
        return {"object": "list", "model": front.model_name,
                "data": [embedding_data(i, v, req.encoding_format) for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _chat_route(api: APIRouter, front: Front) -> None:
    @api.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        llm = front.ready_llm()
        _checks(front, req)
        engine = front.engine
        try:
            tool_req = req.tool_request()
            tools = ChatTools.of(tool_req, engine.tool_parser)
        except ValueError as e:
            raise ApiError(400, str(e), param="tools") from None
        try:
            messages = req.message_dicts()
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = await chat_prompt(engine, messages, req.add_generation_prompt, tool_req.rendered if tool_req else None,
                                req.template_variables())
        thinking = await asyncio.to_thread(Thinking.of, engine, ids, req.include_reasoning)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = _params_of(front, req, raw, max_tokens, top)
        if tools is not None and tools.request.forced:
            if params.structured is not None:
                raise ApiError(400, "tool_choice required or a named function cannot be combined with "
                                    "response_format or structured_outputs", param="tool_choice")
            params = dataclasses.replace(params, structured=tools.request.spec())
        try:
            params = steered(params, thinking, req.thinking_budget)
        except ValueError as e:
            raise ApiError(400, str(e), param="thinking_budget") from None
        await prepare_grammar(engine, req, params, forced_tool=tools is not None and tools.request.forced)
        choices = make_choices([ids], params)
        front.validate(llm, choices)
        rid = new_id("chatcmpl")
        tok = engine.tokenizer
        if req.stream:
            chunks = ChatChunks(rid, front.model_name, tok, tools, thinking)
            return stream(raw, llm, rid, choices, _sse(choices, req, chunks))
        await collect(raw, llm, rid, choices)
        return {"id": rid, "object": "chat.completion", "created": now(), "model": front.model_name,
                "choices": await asyncio.to_thread(lambda: [_chat_choice(c, tok, tools, thinking) for c in choices]),
                "usage": usage(choices)}


def _checks(front: Front, req) -> None:
    """What completions and chat completions check before anything is tokenized."""
    front.accept(req)
    front.check_generates()
    problem = req.unsupported()
    if problem:
        raise ApiError(400, problem)
    if req.n > front.config.max_n:
        raise ApiError(400, f"n must be at most {front.config.max_n}, got {req.n}", param="n")

def _params_of(front: Front, req, raw: Request, max_tokens, logprobs) -> SamplingParams:
    """The engine's settings for a request: its sampling fields, its user and its deadline (server.front)."""
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    try:
        return req.sampling_params(max_tokens, logprobs, front.user(raw, req.user), front.deadline(req.timeout))
    except ValueError as e:
        raise ApiError(400, str(e)) from None

def _model_card(front: Front) -> dict:
    return {"id": front.model_name, "object": "model", "created": 0, "owned_by": "justapi",
            "max_model_len": front.engine.limits.max_model_len}


async def _fim(front: Front, prefix: str, suffix: str) -> list[int]:
    try:
        return await encoded("suffix", front.engine.fim_prompt, prefix, suffix)
    except ValueError as e:
        raise ApiError(400, f"suffix: {e}", param="suffix") from None


def _sse(choices: list[Choice], req, chunk):
    """OpenAI's SSE framing of a stream: each choice's first chunk, the deltas, the usage chunk where asked, [DONE];
    an error midway as an error event, then [DONE]."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # vLLM's continuous_usage_stats: every chunk carries its choice's usage so far
    continuous = include_usage and bool(req.stream_options.continuous_usage_stats)

    async def events(outputs, fail):
        try:
            for c in choices:
                first = chunk.start(c)
                if first is not None:
                    yield sse(dict(first, usage=_usage_so_far(len(c.prompt_ids), 0)) if continuous else first)
            async for choice, out in outputs:
                for payload in chunk.delta(choice, out):
                    if continuous:
                        payload = dict(payload, usage=_usage_so_far(out.num_prompt_tokens, len(out.token_ids)))
                    yield sse(payload)
            if include_usage:
                yield sse(chunk.usage(usage(choices)))
            yield sse("[DONE]")
        except Exception as e:  # once streaming, an error travels inside the stream, which still ends with [DONE]
            err = fail(e)
            yield sse({"error": {"message": err.message, "type": err.type, "code": err.status}})
            yield sse("[DONE]")

    return events


def _usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chat_choice(c: Choice, tok, tools: ChatTools | None, thinking: Thinking | None) -> dict:
    reasoning, text = thinking.split(c.final.text) if thinking is not None else (None, c.final.text)
    message = {"role": "assistant", "content": text}
    reason = c.final.finish_reason
    if tools is not None:
        message, reason = tools.message(text, reason)
    if thinking is not None and thinking.include:
        message.update(reasoning_content=reasoning, reasoning=reasoning)
    return {"index": c.index, "message": message, "logprobs": chat_logprobs(tok, c.final.logprobs),
            "finish_reason": reason, "stop_reason": c.final.stop_reason}


def _completion_entries(tok, choices: list[Choice]) -> list[dict]:
    """A finished completions response's choices, logprobs decoded (in a thread: a long answer's are many)."""
    return [{"index": c.index, "text": c.prefix + c.final.text,
             "logprobs": completion_logprobs(tok, c.final.logprobs, len(c.prefix)),
             "finish_reason": c.final.finish_reason, "stop_reason": c.final.stop_reason} for c in choices]
