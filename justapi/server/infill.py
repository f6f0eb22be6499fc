"""llama.cpp's ``POST /infill``, which code editors' plugins (llama.vim, llama.vscode) call: a fill-in-the-middle
completion from ``input_prefix``, ``input_suffix`` and other files (``input_extra``), answered in the shape of
llama.cpp's /completion (``content``, ``stop``, ``tokens_predicted`` ...), whole or as SSE chunks."""

import json

from fastapi import APIRouter, Request
from pydantic import Field

from ..sampling_params import SamplingParams
from .errors import ApiError
from .front import Front, collect, stream
from .inputs import encoded
from .protocol import WireModel
from .serving import make_choices, new_id


class InfillRequest(WireModel):
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[dict] = Field(default_factory=list)  # [{"filename": ..., "text": ...}]
    prompt: str = ""  # the start of the middle
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    repeat_penalty: float = 1.0
    stream: bool = False

    def extra(self) -> list[tuple[str, str]]:
        chunks = []
        for i, chunk in enumerate(self.input_extra):
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str):
                raise ValueError(f"input_extra[{i}] must be {{\"filename\": str, \"text\": str}}")
            chunks.append((str(chunk.get("filename", "")), chunk.get("text", "")))
        return chunks

    def sampling_params(self, user, deadline) -> SamplingParams:
        return SamplingParams(max_tokens=None if self.n_predict < 0 else max(self.n_predict, 1),
                              temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              seed=self.seed, stop=self.stop, repetition_penalty=self.repeat_penalty, user=user,
                              deadline=deadline)


def router(front: Front) -> APIRouter:
    api = APIRouter()

    @api.post("/infill")
    async def infill(req: InfillRequest, raw: Request):
        llm = front.ready_llm()
        front.accept(req)
        front.check_generates()
        try:
            params = req.sampling_params(front.user(raw, None), front.deadline(None))
            extra = req.extra()
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        try:
            ids = await encoded("input_prefix", front.engine.fim_prompt, req.input_prefix, req.input_suffix, extra,
                                req.prompt)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        choices = make_choices([ids], params)
        front.validate(llm, choices)
        rid = new_id("cmpl")
        if req.stream:
            return stream(raw, llm, rid, choices, _chunks(len(ids)))
        await collect(raw, llm, rid, choices)
        out = choices[0].final
        return _final(out, out.text, len(ids))

    return api


def _final(out, content: str, prompt_tokens: int) -> dict:
    stop_type = "limit" if out.finish_reason == "length" else "word" if isinstance(out.stop_reason, str) else "eos"
    return {"content": content, "stop": True, "stop_type": stop_type, "tokens_predicted": len(out.token_ids),
            "tokens_evaluated": prompt_tokens, "stopping_word": out.stop_reason if stop_type == "word" else ""}


def _chunks(prompt_tokens: int):
    async def events(outputs, fail):
        try:
            async for _, out in outputs:
                if out.finished:
                    yield f"data: {json.dumps(_final(out, out.new_text, prompt_tokens))}\n\n"
                elif out.new_text:
                    yield f"data: {json.dumps({'content': out.new_text, 'stop': False})}\n\n"
        except Exception as e:
            yield f"data: {json.dumps({'error': {'message': fail(e).message}})}\n\n"

    return events
