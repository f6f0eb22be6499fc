"""Completions and chat completions: turn OpenAI requests into engine requests, and outputs into responses."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator

import numpy as np

from ..engine.async_llm import AsyncLLM
from ..engine.llm import child_seed
from ..engine.output_processor import RequestOutput
from ..model.tokenizer import Tokenizer
from ..sampling_params import SamplingParams


class Choice:
    """One completion being produced: index, prompt, and what has come out so far."""

    def __init__(self, index: int, prompt_index: int, prompt_ids: list[int], params: SamplingParams, prefix: str = ""):
        self.index = index
        self.prompt_index = prompt_index
        self.prompt_ids = prompt_ids
        self.params = params
        self.prefix = prefix  # echoed prompt text
        self.final: RequestOutput | None = None
        self.admitted = False  # its params are the engine's admitted ones (server.front.Front.validate)


def make_choices(prompts: list[list[int]], params: SamplingParams, echo_texts: list[str] | None = None) -> list[Choice]:
    """``n`` choices per prompt, seeded so that a seeded request gives the same n completions every time."""
    choices = []
    for p, ids in enumerate(prompts):
        for j in range(params.n):
            seed = child_seed(params.seed, j) if params.seed is not None else None
            choices.append(Choice(len(choices), p, ids, replace(params, seed=seed, n=1),
                                  echo_texts[p] if echo_texts else ""))
    return choices


async def run_choices(llm: AsyncLLM, request_id: str,
                      choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Run every choice at once and yield outputs as they arrive; closing the iterator aborts them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for out in llm.generate(f"{request_id}-{choice.index}", choice.prompt_ids, choice.params,
                                          group=request_id, check_queue=choice is choices[0],
                                          admitted=choice.admitted):
                await queue.put((choice, out))
        except BaseException as e:  # delivered to the consumer, which re-raises it
            await queue.put((choice, e))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    remaining = len(choices)
    try:
        while remaining:
            choice, item = await queue.get()
            if isinstance(item, asyncio.CancelledError):
                raise item
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                choice.final = item
                remaining -= 1
            yield choice, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(choices: list[Choice]) -> dict:
    finals = [c.final for c in choices if c.final is not None]
    per_prompt = {c.prompt_index: c.final for c in choices if c.final is not None}
    prompt_tokens = sum(o.num_prompt_tokens for o in per_prompt.values())
    completion_tokens = sum(len(o.token_ids) for o in finals)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in per_prompt.values())},
    }


def completion_logprobs(tokenizer: Tokenizer, out_logprobs, offset: int) -> dict | None:
    """The legacy completions logprobs object for a run of tokens starting at text offset ``offset``."""
    if out_logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in out_logprobs:
        piece = tokenizer.decode([lp.token_id], skip_special_tokens=False)
        tokens.append(piece)
        token_lps.append(lp.logprob)
        tops.append({tokenizer.decode([t], skip_special_tokens=False): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, out_logprobs) -> dict | None:
    if out_logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        piece = tokenizer.decode([token_id], skip_special_tokens=False)
        # the token's own bytes: where a character spans tokens, each carries its part (its text alone is U+FFFD)
        return {"token": piece, "logprob": logprob, "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
                        for lp in out_logprobs]}


def embedding_data(index: int, vector: list[float], encoding_format: str) -> dict:
    """One entry of an embeddings response: the vector as floats, or as base64 of little-endian float32 (what
    OpenAI's clients decode)."""
    if encoding_format == "base64":
        vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return {"object": "embedding", "index": index, "embedding": vector}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
