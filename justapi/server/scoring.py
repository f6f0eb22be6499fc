"""Relevance scoring for RAG stacks: ``/v1/rerank`` (Jina's and Cohere's request shape, also at ``/rerank`` and
``/v2/rerank``) and ``/v1/score`` (vLLM's ``text_1`` / ``text_2``, also at ``/score``).

A reranker's file (pooling ``rank``: Qwen3-Reranker, a BERT cross-encoder) scores each (query, document) pair as
one prompt (model.pairs) through its classifier; an embedding model scores the cosine similarity of the two texts'
embeddings, as vLLM does. Scores run in the engine's batches with everything else, as embeddings do.
"""

import math

from fastapi import APIRouter, Request
from pydantic import Field, field_validator

from ..sampling_params import Pooling
from .errors import ApiError
from .front import Front
from .inputs import encoded
from .protocol import MAX_USER_CHARS, WireModel
from .serving import new_id, now


class RerankDocument(WireModel):
    text: str


class RerankRequest(WireModel):
    """Jina's and Cohere's rerank request: a query, documents as strings or ``{"text": ...}``, the best ``top_n``
    (None or 0: all) and whether to return each document's text (Jina's default: yes)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    timeout: float | None = Field(default=None, gt=0)

    @field_validator("documents")
    @classmethod
    def _non_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("documents must not be empty")
        return v

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(WireModel):
    """vLLM's score request: ``text_1`` against ``text_2``, paired 1:1, 1:N or N:N."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    timeout: float | None = Field(default=None, gt=0)

    def pairs(self) -> list[tuple[str, str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not first or not second:
            raise ApiError(400, "text_1 and text_2 must each hold at least one text",
                           param="text_1" if not first else "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ApiError(400, f"text_1 and text_2 must pair 1:1, 1:N or N:N; got {len(first)} and {len(second)} "
                                "texts", param="text_2")
        return list(zip(first, second))


def router(front: Front) -> APIRouter:
    api = APIRouter()

    async def scores(raw: Request, pairs: list[tuple[str, str]], req) -> tuple[list[float], int]:
        """(each pair's score, the tokens computed)."""
        front.ready_llm()
        front.accept(req)
        field = "documents" if isinstance(req, RerankRequest) else "text_2"
        front.check_fan_out(len(pairs), 1, field)
        engine = front.engine
        if engine.model_config.pooling == "rank":
            ids = await encoded(field, lambda: [engine.pair_prompt(q, d) for q, d in pairs])
            vectors, tokens = await front.pooled(raw, ids, Pooling("rank", normalize=False), req.user, req.timeout,
                                                 "score")
            return [v[0] for v in vectors], tokens
        pooling = front.embedding_pooling()
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
        front.check_fan_out(len(texts), 1, field)
        ids = await encoded(field, lambda: [engine.tokenizer.encode(t) for t in texts])
        vectors, tokens = await front.pooled(raw, ids, pooling, req.user, req.timeout, "score")
        by_text = dict(zip(texts, vectors))
        return [_cosine(by_text[q], by_text[d]) for q, d in pairs], tokens

    async def rerank(req: RerankRequest, raw: Request):
        documents = req.texts()
        values, tokens = await scores(raw, [(req.query, d) for d in documents], req)
        order = sorted(range(len(values)), key=lambda i: -values[i])[: req.top_n or None]
        results = [{"index": i, "relevance_score": values[i],
                    **({"document": {"text": documents[i]}} if req.return_documents else {})} for i in order]
        return {"id": new_id("rerank"), "object": "list", "model": front.model_name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def score(req: ScoreRequest, raw: Request):
        values, tokens = await scores(raw, req.pairs(), req)
        return {"id": new_id("score"), "object": "list", "created": now(), "model": front.model_name,
                "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        api.post(path)(rerank)
    for path in ("/v1/score", "/score"):
        api.post(path)(score)
    return api


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / max(math.sqrt(sum(x * x for x in a) * sum(y * y for y in b)), 1e-12)

