"""Turn per-step token outputs into text deltas: incremental detokenization and stop strings."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..core.outputs import EngineCoreOutput, Logprob
from ..model.tokenizer import IncrementalDetokenizer, Tokenizer
from ..sampling_params import SamplingParams

log = logging.getLogger("justapi.engine")


@dataclass
class RequestOutput:
    """What a request produced since the last report (``new_*``) and in total so far."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprob] | None
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[Logprob] | None = field(default=None)
    embedding: list[float] | None = None  # an embedding request's pooled vector, once finished
    error: str | None = None  # finish_reason "error": why the request failed alone


class _RequestText:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
        self.released = 0  # characters of text already reported
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1


class OutputProcessor:
    """Keeps each request's text; finds stop strings; tells the caller which requests a stop string ended."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestText] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.requests[request_id] = _RequestText(self.tokenizer, prompt_token_ids, params)

    def process(self, out: EngineCoreOutput) -> tuple[RequestOutput, bool]:
        """The report for one core output, and whether a stop string ended the request here."""
        st = self.requests[out.request_id]
        st.token_ids.extend(out.new_token_ids)
        if st.logprobs is not None and out.new_logprobs:
            st.logprobs.extend(out.new_logprobs)
        finish_reason = out.finish_reason
        stop_reason: str | int | None = None
        if finish_reason == "timeout":
            # cut short by its deadline: "length" as llama.cpp's server answers for its time limit (strict OpenAI
            # clients know no other reason), with vLLM's stop_reason naming the cause
            finish_reason, stop_reason = "length", "timeout"
        elif finish_reason == "stop" and out.new_token_ids:
            last = out.new_token_ids[-1]
            stop_reason = last if last in st.params.stop_token_ids else None
        before = len(st.detok.text)
        st.detok.add(out.new_token_ids, final=finish_reason is not None)
        text = st.detok.text
        stopped_by_string = False
        if (st.params.stop and finish_reason not in ("abort", "error") and stop_reason != "timeout"
                and len(st.token_ids) >= st.params.min_tokens):
            start = max(0, before - st.hold_back)
            hit = _find_stop(text, st.params.stop, start)
            if hit is not None:
                pos, s = hit
                text = text[:pos]
                st.detok.text = text
                finish_reason, stop_reason, stopped_by_string = "stop", s, True
        finished = finish_reason is not None
        upto = len(text) if finished else max(st.released, len(text) - st.hold_back)
        new_text = text[st.released : upto]
        st.released = upto
        report = RequestOutput(
            request_id=out.request_id,
            new_token_ids=list(out.new_token_ids),
            new_text=new_text,
            new_logprobs=out.new_logprobs,
            token_ids=list(st.token_ids),
            text=text[:upto],
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            logprobs=st.logprobs,
            embedding=out.embedding,
            error=out.error,
        )
        if finished:
            del self.requests[out.request_id]
        return report, stopped_by_string

    def process_safely(self, out: EngineCoreOutput) -> tuple[RequestOutput, bool]:
        """``process``, except that a request whose text raises (its detokenizer, its stop strings) fails alone: an
        error report, its state dropped. The bool: whether the request ended here (a stop string or that failure)
        while its engine may still run it."""
        try:
            return self.process(out)
        except Exception as e:
            log.exception("request %s failed in its text", out.request_id)
            self.requests.pop(out.request_id, None)
            error = f"the request failed in its text: {type(e).__name__}: {e}"
            return RequestOutput(out.request_id, [], "", None, [], "", True, "error", None, out.num_prompt_tokens,
                                 out.num_cached_tokens, error=error), out.finish_reason is None

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
