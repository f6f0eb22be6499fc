"""Structured output: request fields → constraints, grammars enforced while decoding (checked by independent
matchers: Python's re, set membership, jsonschema), and constrained greedy output unchanged by batching,
chunking and preemption."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from justapi import LLM, SamplingParams
from justapi.structured.spec import StructuredOutput, from_response_format, from_structured_outputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "count", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["red", "green", "blue \"quoted\"", "naïve"]
# a grammar and an independent matcher of its language: one to three of ab / ba, then !, then one or two digits
GRAMMAR = 'root ::= pair pair? pair? "!" [0-9] [0-9]?\npair ::= "ab" | "ba"'
GRAMMAR_RE = r"(ab|ba){1,3}![0-9]{1,2}"


def test_request_fields_become_constraints():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutput("json_object")
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                        "strict": True}})
    assert spec.kind == "json" and json.loads(spec.source) == SCHEMA
    assert from_structured_outputs({"json": json.dumps(SCHEMA)}) == spec  # a string or an object: one key
    assert from_structured_outputs({"regex": REGEX}) == StructuredOutput("regex", REGEX)
    assert from_structured_outputs({"choice": CHOICES}).options == CHOICES
    assert from_structured_outputs({"json_object": True}).kind == "json_object"
    for bad, message in [({"regex": "a", "choice": ["b"]}, "exactly one"), ({}, "exactly one"),
                         ({"choice": []}, "non-empty list"), ({"bogus": 1}, "unknown field"),
                         ({"json": "{not json"}, "not valid JSON"), ({"regex": "x" * 70000}, "the limit is")]:
        with pytest.raises(ValueError, match=message):
            from_structured_outputs(bad)
    with pytest.raises(ValueError, match="response_format.type must be"):
        from_response_format({"type": "xml"})
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(structured=spec, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_exact):
    return tiny_exact


def _decode(llm, result) -> str:
    return llm.engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def _sampled(spec, i, max_tokens=80):
    return SamplingParams(temperature=1.0, top_k=0, seed=100 + i, max_tokens=max_tokens, structured=spec)


def test_every_output_matches_its_constraint(tiny):
    """Sampled from a random model (so the grammar does all the work), every finished output matches: the regex by
    re.fullmatch, the choice by membership, the grammar by an equivalent regex, the schema by jsonschema."""
    prompts = [[5, 6, 7 + i] for i in range(8)]
    cases = [
        (StructuredOutput("regex", REGEX), lambda text: re.fullmatch(REGEX, text)),
        (StructuredOutput.choice(CHOICES), lambda text: text in CHOICES),
        (StructuredOutput("grammar", GRAMMAR), lambda text: re.fullmatch(GRAMMAR_RE, text)),
        (StructuredOutput.json_schema(SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ]
    for spec, ok in cases:
        results = tiny.generate(prompts, [_sampled(spec, i) for i in range(len(prompts))])
        finished = [r for r in results if r.outputs[0].finish_reason == "stop"]
        assert len(finished) >= len(prompts) // 2, f"{spec.kind}: too few outputs ended within max_tokens"
        for r in finished:
            text = _decode(tiny, r)
            assert ok(text), f"{spec.kind}: {text!r}"


def test_constrained_greedy_output_is_the_same_alone_batched_chunked_and_preempted(engines_for_structured):
    """Constrained greedy requests mixed with free ones in one batch of 32, at chunk sizes 1 and 512 and in a pool
    small enough to preempt: the same tokens as each request alone."""
    base, chunked, small = engines_for_structured
    rng = random.Random(3)
    specs = [StructuredOutput("regex", REGEX), StructuredOutput.json_schema(SCHEMA), StructuredOutput.choice(CHOICES),
             StructuredOutput("grammar", GRAMMAR)]
    prompts = [[rng.randrange(3, 271) for _ in range(rng.randint(3, 60))] for _ in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=40, structured=specs[i % 4]) if i % 2 == 0 else
              SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True) for i in range(32)]
    alone = [base.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    for llm in (base, chunked, small):
        assert [r.token_ids for r in llm.generate(prompts, params)] == alone
    assert small.engine.scheduler.stats.num_preemptions > 0
    small.engine.scheduler.check_integrity()


@pytest.fixture(scope="module")
def engines_for_structured(tiny_model, tiny_exact):
    from conftest import TINY_EXACT

    chunked = LLM(tiny_model, **{**TINY_EXACT, "chunk_size": 1})
    small = LLM(tiny_model, **{**TINY_EXACT, "pool_blocks": 40, "block_size": 4})
    return tiny_exact, chunked, small


def test_bad_constraints_are_refused_naming_the_problem(tiny):
    for spec, message in [(StructuredOutput("regex", "a(b"), "invalid regex"),
                          (StructuredOutput("grammar", "root ::= undefined_rule"), "invalid grammar"),
                          (StructuredOutput.json_schema({"type": "nonsense"}), "invalid JSON schema")]:
        with pytest.raises(ValueError, match=message):
            tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured=spec))
    assert not tiny.engine.has_unfinished


@pytest.mark.parametrize("speculation", ["ngram", "draft tree"])
def test_constrained_output_under_speculative_decoding(tiny_model, tiny_exact, speculation):
    """Drafts for constrained requests are verified against the grammar's masks along each draft path: greedy output
    is exactly the non-speculative output (alone, and in a batch mixed with free requests), some drafts are accepted,
    and sampled output still matches its constraint."""
    from conftest import TINY_EXACT

    opts = dict(spec_method="ngram", gamma=4) if speculation == "ngram" else dict(draft_model=tiny_model, gamma=3,
                                                                                  branch=2)
    spec = LLM(tiny_model, spec_max_batch=64, **opts, **TINY_EXACT)
    rng = random.Random(5)
    specs = [StructuredOutput("regex", REGEX), StructuredOutput.json_schema(SCHEMA), StructuredOutput.choice(CHOICES),
             StructuredOutput("grammar", GRAMMAR)]
    prompts = [[rng.randrange(3, 271) for _ in range(rng.randint(3, 40))] for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=40, structured=specs[i % 4]) if i % 3 else
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for i in range(12)]
    alone = [tiny_exact.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    constrained = [i for i in range(12) if i % 3]
    assert [spec.generate([prompts[i]], params[i])[0].token_ids for i in constrained] == [alone[i] for i in constrained]
    stats = spec.engine.scheduler.stats
    assert stats.spec_accepted_tokens > 0, "no draft was accepted for a constrained request"
    assert [r.token_ids for r in spec.generate(prompts, params)] == alone
    results = spec.generate(prompts[:8], [_sampled(specs[1], i) for i in range(8)])
    for r in results:
        if r.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(_decode(spec, r)), SCHEMA)
    spec.engine.scheduler.check_integrity()


def test_masks_are_the_same_with_and_without_the_cpp_kernel(tiny_model):
    """The C++ mask_logits and xgrammar's own apply (the path without the kernels) mask the same logits."""
    import torch

    from justapi.kernels import decode_kernels
    from justapi.structured.grammars import for_model

    grammars = for_model(tiny_model)
    matchers = [grammars.matcher(spec, [])
                for spec in (StructuredOutput("regex", REGEX), StructuredOutput.choice(CHOICES))]
    logits = torch.randn(4, grammars.vocab_size, generator=torch.Generator().manual_seed(0))
    with_kernel, without = logits.clone(), logits.clone()
    grammars.mask(with_kernel, [3, 1], matchers, decode_kernels())
    grammars.mask(without, [3, 1], matchers, None)
    assert torch.equal(with_kernel, without)
    assert torch.equal(with_kernel[[0, 2]], logits[[0, 2]]) and torch.isinf(with_kernel[3]).sum() > 0


def test_a_draft_trees_masks_follow_each_path_and_leave_the_matcher_where_it_was(tiny_model):
    """Row 0 masks by the matcher's state, row 1 + i by the state after node i's path; a node the grammar refuses
    leaves its row (and its subtree's) all-allowed, never reached; the walk rolls the matcher back."""
    import xgrammar as xgr

    from justapi.structured.grammars import for_model

    grammars = for_model(tiny_model)
    tok = LLM(tiny_model, **{"pool_blocks": 8, "show_progress": False}).engine.tokenizer
    a, b, x, dash = (tok.encode(c, add_special_tokens=False)[0] for c in ("a", "b", "x", "-"))
    matcher = grammars.matcher(StructuredOutput("regex", REGEX), [])
    # root → a → b, root → x (refused) → a
    parents, tokens = [-1, 0, -1, 2], [a, b, x, a]
    bitmask = xgr.allocate_token_bitmask(5, grammars.vocab_size)
    matcher.fill_tree(bitmask, parents, tokens)
    allowed = lambda row, t: bool((int(bitmask[row, t // 32]) >> (t % 32)) & 1)  # noqa: E731
    assert allowed(0, a) and allowed(0, b) and not allowed(0, x) and not allowed(0, dash)  # [a-c] first
    assert allowed(1, b) and not allowed(1, dash)  # after "a": still [a-c]
    assert allowed(2, a) and not allowed(2, dash)  # after "ab": a third [a-c] before the "-"
    assert bool((bitmask[3] == -1).all()) and bool((bitmask[4] == -1).all())  # below the refused "x"
    assert matcher.accept(a) and not matcher.accept(dash)  # rolled back to the start: "a" allowed, "-" not yet


def test_a_slow_grammar_is_ended_and_never_holds_up_another(tiny_model, monkeypatch):
    """A schema that compiles for longer than the limit is refused and its worker process replaced; a simple one sent
    meanwhile compiles on the other worker before the slow one is given up."""
    import concurrent.futures

    from justapi.structured import grammars
    from justapi.structured.spec import from_response_format

    def schema(depth: int) -> dict:
        s: dict = {}
        for _ in range(depth):  # nested objects: xgrammar's schema conversion grows with the depth
            s = {"type": "object", "properties": {"a": s, "b": {"type": "string", "minLength": 3}},
                 "required": ["a", "b"]}
        return {"type": "json_schema", "json_schema": {"name": "deep", "schema": s}}

    g = grammars.for_model(tiny_model)
    g.check(from_response_format({"type": "json_object"}))  # both workers started
    monkeypatch.setattr(grammars, "COMPILE_TIMEOUT_S", 3.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(g.check, from_response_format(schema(400)))
        g.check(from_response_format(schema(3)))
        assert not slow.done()  # the simple one did not wait for it
        with pytest.raises(grammars.GrammarError, match="did not compile within 3 s"):
            slow.result()
    g.check(from_response_format(schema(4)))  # the replaced worker compiles


def test_smollm2_json_ends_compact_and_an_object(real_llm):
    """JSON mode and schemas compile compact (one space after ``,`` and ``:``, no newline or indent), so SmolLM2 at
    temperature 0 writes an object that parses and ends well inside its budget on these asks (one that loops on its
    keys is in docs/benchmarks.md: the whitespace no longer spends the budget, repetition still can); JSON mode
    gives an object, never a bare array or value."""
    import json

    asks = ["hi", "List three colors.", "What is 2+2?", "Give me a JSON object describing a cat with its name and age."]
    params = SamplingParams(temperature=0, max_tokens=200, structured=StructuredOutput("json_object"))
    schema = StructuredOutput.json_schema(json.dumps({
        "type": "object", "properties": {"name": {"type": "string"},
                                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["name", "tags"]}))
    conversations = [[{"role": "user", "content": a}] for a in asks]
    outs = [r.outputs[0] for r in real_llm.chat(conversations, params)]
    outs += [real_llm.chat(conversations[3], SamplingParams(temperature=0, max_tokens=200, structured=schema))[0]
             .outputs[0]]
    for out in outs:
        assert out.finish_reason == "stop" and len(out.token_ids) < 200, out.text
        assert isinstance(json.loads(out.text), dict) and "\n" not in out.text, out.text
