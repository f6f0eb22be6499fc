"""Reasoning models (issue 55 item 5): a thinking model's <think> ... </think> returned as reasoning_content, apart
from its content, whole and streamed; thinking turned off by chat_template_kwargs or reasoning_effort; a prompt
that opens the thinking itself (DeepSeek-R1's template). On tiny random Qwen3 files with Qwen3's think tokens."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from justapi import LLM, SamplingParams
from justapi.structured.reasoning import ReasoningStream, split
from tiny_gguf import OPENING_TEMPLATE, THINKING_TEMPLATE, write_tiny_model

ASK = [{"role": "user", "content": "the cat"}]


def test_a_streamed_split_equals_the_whole_one_however_the_text_is_cut():
    """ReasoningStream, fed any cuts of a text, gives split()'s reasoning and content: tags split across deltas,
    newlines after the tags, no closing tag, a prompt that opened the thinking, a tag the answer only mentions."""
    cases = [("<think>\nplan a\nplan b\n</think>\n\nThe answer.", False), ("plan\n</think>\n\nAnswer", True),
             ("no thinking here", False), ("<think>\ncut off while thin", False), ("mentions </think> only", False),
             ("<think>\n\n</think>\n\nJust answer", False), ("\n<think>x</think>y", False), ("", True), ("<thi", False)]
    assert split(cases[0][0], False) == ("plan a\nplan b", "The answer.")
    assert split(cases[4][0], False) == (None, "mentions </think> only")
    rng = random.Random(0)
    for text, inside in cases:
        reasoning, content = split(text, inside)
        for _ in range(40):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 6))))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            stream, got = ReasoningStream(inside), ["", ""]
            for i, piece in enumerate(pieces):
                r, c = stream.feed(piece, final=i == len(pieces) - 1)
                got = [got[0] + r, got[1] + c]
            assert got == [reasoning or "", content], (text, pieces)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny Qwen3 whose template opens the thinking in the prompt (as DeepSeek-R1's does: a random model would not
    open it itself), and a logit bias on </think> that makes its greedy answer close its thinking a few tokens in
    (found once: the weights are random)."""
    path = write_tiny_model(str(tmp_path_factory.mktemp("think") / "qwen3-think.gguf"), "qwen3", seed=9,
                            chat_template=OPENING_TEMPLATE, context_length=256)
    llm = LLM(path, dtype="float32", pool_blocks=64, show_progress=False)
    close = llm.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(close) == 1
    return path, llm, _closing_bias(llm, llm.engine.render_chat(ASK, True), close[0]), close[0]


def _closing_bias(llm, prompt: list[int], close: int) -> float:
    """The least logit bias (in halves) on ``close`` under which the greedy answer first closes its thinking
    between its 3rd and 10th token."""
    for half in range(80):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=((close, half / 2),))
        out = llm.generate([prompt], params)[0].token_ids
        if close in out and 2 <= out.index(close) < 10:
            return half / 2
    raise AssertionError("no bias closes the thinking mid-answer")


def test_reasoning_and_content_apart_whole_and_streamed(thinker, tmp_path):
    """The chat answer's text, as the completions route gives it for the same prompt, parted at </think>:
    reasoning_content (and reasoning) before, content after; streamed deltas add up to the same."""
    from server_helpers import InProcessServer

    path, llm, bias, close = thinker
    body = {"messages": ASK, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logit_bias": {str(close): bias}}
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "64"], str(tmp_path / "s.log"))
    try:
        ids = llm.engine.render_chat(ASK, True)
        raw = httpx.post(srv.url + "/v1/completions", json={**{k: v for k, v in body.items() if k != "messages"},
                                                            "prompt": ids}).json()["choices"][0]["text"]
        assert "</think>" in raw
        want_reasoning, want_content = split(raw, True)
        assert want_reasoning and want_content
        message = httpx.post(srv.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (want_reasoning, want_content)
        assert message["reasoning"] == want_reasoning
        streamed = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": True})
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == want_reasoning
        assert "".join(d.get("content", "") for d in deltas) == want_content
        hidden = httpx.post(srv.url + "/v1/chat/completions", json={**body, "include_reasoning": False}).json()
        assert "reasoning_content" not in hidden["choices"][0]["message"]
        assert hidden["choices"][0]["message"]["content"] == want_content
    finally:
        assert srv.stop() == 0


def test_thinking_off_by_template_kwargs_or_reasoning_effort(tmp_path):
    """chat_template_kwargs {"enable_thinking": false} and reasoning_effort "none" render Qwen3's empty thinking
    block into the prompt; other efforts leave the model to think."""
    from justapi.server.protocol import ChatCompletionRequest

    path = write_tiny_model(str(tmp_path / "qwen3.gguf"), "qwen3", chat_template=THINKING_TEMPLATE)
    llm = LLM(path, pool_blocks=16, show_progress=False)
    tok = llm.tokenizer

    def rendered(**fields) -> str:
        req = ChatCompletionRequest(messages=ASK, **fields)
        return tok.decode(llm.engine.render_chat(ASK, True, None, req.template_variables()), skip_special_tokens=False)

    assert rendered().endswith("assistant\n")
    assert rendered(chat_template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    assert rendered(reasoning_effort="none").endswith("</think>\n\n")
    assert rendered(reasoning_effort="high").endswith("assistant\n")
    assert rendered(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}).endswith("assistant\n")


def test_an_answer_cut_off_while_thinking_is_all_reasoning(thinker, tmp_path):
    """A prompt that opened the thinking and an answer cut off before </think>: all of it is reasoning."""
    from server_helpers import InProcessServer

    path = thinker[0]
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "64"], str(tmp_path / "s.log"))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 6, "temperature": 0,
                                                               "ignore_eos": True}).json()
        message = r["choices"][0]["message"]
        assert message["content"] == "" and message["reasoning_content"]  # never closed: all thinking
    finally:
        assert srv.stop() == 0


REGEX = r"[a-c]{3}-[0-9]{2}"


@pytest.mark.parametrize("template", ["prompt opens", "model opens"])
def test_a_constraint_applies_after_the_thinking(tmp_path, template):
    """Structured output on a reasoning model constrains the answer after </think>, not the thinking: the
    reasoning is what the model thinks unconstrained (the same tokens as without the constraint), the content
    matches the regex whole. Where the model opens its thinking itself (Qwen3) the first token is <think>."""
    import re

    from server_helpers import InProcessServer

    opens = template == "model opens"
    path = write_tiny_model(str(tmp_path / "m.gguf"), "qwen3", seed=1 if opens else 9, context_length=256,
                            chat_template=THINKING_TEMPLATE if opens else OPENING_TEMPLATE)
    llm = LLM(path, dtype="float32", pool_blocks=64, show_progress=False)
    open_id, close = (llm.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("<think>", "</think>"))
    prompt = llm.engine.render_chat(ASK, True) + ([open_id] if opens else [])
    bias = _closing_bias(llm, prompt, close)
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "64"], str(tmp_path / "s.log"))
    try:
        body = {"messages": ASK, "max_tokens": 40, "temperature": 0, "logit_bias": {str(close): bias},
                "structured_outputs": {"regex": REGEX}}
        message = httpx.post(srv.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert re.fullmatch(REGEX, message["content"]), message
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                     logit_bias=((close, bias),)))[0].outputs[0].text
        assert message["reasoning_content"] == split(free, True)[0] != ""
    finally:
        assert srv.stop() == 0


def test_a_thinking_budget_closes_the_thinking(thinker, tmp_path):
    """thinking_budget N: the thinking is closed after N tokens (its close token forced), then the model answers;
    0 closes it at once; a model without thinking refuses the field by name."""
    from server_helpers import InProcessServer

    path, llm, _, close = thinker
    srv = InProcessServer(["--model", path, "--dtype", "float32", "--pool-blocks", "64"], str(tmp_path / "s.log"))
    try:
        def ask(budget):
            body = {"messages": ASK, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "thinking_budget": budget, "logprobs": True}
            r = httpx.post(srv.url + "/v1/chat/completions", json=body).json()
            return r["choices"][0]["message"]

        three, zero = ask(3), ask(0)
        assert zero["reasoning_content"] == "" and zero["content"]
        ids = llm.engine.render_chat(ASK, True)
        free = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0].text
        assert three["reasoning_content"] == free.strip("\n") and three["content"]
    finally:
        assert srv.stop() == 0
    plain = InProcessServer(["--model", write_tiny_model(str(tmp_path / "plain.gguf")), "--pool-blocks", "32"],
                            str(tmp_path / "p.log"))
    try:
        r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": ASK, "thinking_budget": 4})
        assert r.status_code == 400 and "thinking_budget" in r.json()["error"]["message"]
    finally:
        assert plain.stop() == 0


def test_a_constraint_after_the_thinking_is_the_same_disaggregated(thinker):
    """A reasoning request constrained after its thinking (think_tokens: the prompt opened it) gives the same
    tokens with prefill/decode disaggregation: the decode worker takes over a request still thinking, or past it."""
    from justapi.config import EngineConfig
    from justapi.engine.worker_pool import WorkerPoolEngine
    from justapi.structured.spec import StructuredOutput
    from test_pd import run_all

    path, llm, bias, close = thinker
    ids = llm.engine.render_chat(ASK, True)
    params = [SamplingParams(temperature=0, max_tokens=30, logit_bias=((close, bias),), think_tokens=(-1, close),
                             structured=StructuredOutput("regex", REGEX), thinking_budget=budget)
              for budget in (None, 0, 1)]
    want = [r.outputs[0].text for r in llm.generate([ids] * 3, params)]
    assert all("</think>" in w for w in want)
    pd = WorkerPoolEngine(EngineConfig(path, disaggregate=True, num_threads=1, dtype="float32", pool_blocks=64,
                               show_progress=False))
    try:
        done, failed = run_all(pd, [ids] * 3, params)
        assert not failed and [done[f"r{i}"].text for i in range(3)] == want
    finally:
        pd.close()


@pytest.mark.parametrize("spec", ["draft tree", "ngram"])
def test_a_constraint_after_the_thinking_is_the_same_drafted(thinker, spec):
    """Drafts verified for a request still thinking: each tree row is steered by where its own path leaves the
    thinking (its budget forcing the close), the grammar masks only the subtrees after a close. The same tokens as
    without drafts, for a constraint alone, a budget of 0 and 2, and drafts accepted on the way."""
    from justapi.structured.spec import StructuredOutput

    path, llm, bias, close = thinker
    ids = llm.engine.render_chat(ASK, True)
    params = [SamplingParams(temperature=0, max_tokens=30, logit_bias=((close, bias),), think_tokens=(-1, close),
                             structured=StructuredOutput("regex", REGEX), thinking_budget=budget)
              for budget in (None, 0, 2)] + [
              SamplingParams(temperature=0, max_tokens=16, think_tokens=(-1, close), thinking_budget=3,
                             ignore_eos=True)]
    want = [r.outputs[0].token_ids for r in llm.generate([ids] * 4, params)]
    assert all(close in w for w in want)
    opts = dict(draft_model=path, gamma=3, branch=2) if spec == "draft tree" else dict(spec_method="ngram", gamma=3)
    drafted = LLM(path, dtype="float32", pool_blocks=64, show_progress=False, **opts)
    got = [r.outputs[0].token_ids for r in drafted.generate([ids] * 4, params)]
    assert got == want
    if spec == "draft tree":  # (the random model's output repeats too little for n-grams to hit reliably)
        assert drafted.engine.scheduler.stats.spec_accepted_tokens > 0
