"""Hybrid models (issue 57): LFM2's short convolutions and Qwen3.5's Gated DeltaNet between attention layers, their
states in the state cache beside the KV pool. Tiny random-weight GGUFs in llama.cpp's converter layout
(tests/tiny_hybrid.py), held to transformers' models holding the same weights."""

from __future__ import annotations

import httpx
import pytest
import torch

from justapi import LLM, SamplingParams
from justapi.model import delta_rule
from justapi.model.kernel_policy import KernelPolicy
from justapi.model.recurrent import GatedDeltaNet
from paged_helpers import paged_prefill_logits
from server_helpers import InProcessServer, metric, undocumented_metrics
from test_model import load_model
from tiny_hybrid import write_tiny_lfm2, write_tiny_qwen35

IDS = [(7 * i + 3) % 260 + 3 for i in range(90)]  # 90 tokens: two chunks of the scan (64), many prefill chunks
PROMPTS = [IDS[:5], IDS[3:40], IDS[10:12], IDS]
WRITERS = {"lfm2": write_tiny_lfm2, "qwen35": write_tiny_qwen35}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def hybrid(request, tmp_path_factory):
    """(arch, the GGUF's path, transformers' model of the same weights, its greedy continuations of PROMPTS)."""
    arch = request.param
    path, hf = WRITERS[arch](str(tmp_path_factory.mktemp(arch) / f"{arch}.gguf"))
    with torch.no_grad():
        greedy = [hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):]
                  .tolist() for p in PROMPTS]
    return arch, path, hf, greedy


def test_the_file_reads_as_a_hybrid(hybrid):
    arch, path, _, _ = hybrid
    model = load_model(path)
    kinds = [type(layer.attn).__name__ for layer in model.layers]
    expected = {"lfm2": ["ShortConv", "Attention", "ShortConv", "ShortConv"],
                "qwen35": ["GatedDeltaNet"] * 3 + ["Attention"]}
    assert kinds == expected[arch] and model.kv_layers == 1


@pytest.mark.parametrize("path_", ["per-token", "chunked-scan", "kernel"])
def test_logits_match_transformers_over_chunks(hybrid, path_, cpp_kernels):
    """fp32 logits of a 90-token prompt within 1e-4 of transformers', prefilled whole and in chunks of 7 and 64 (the
    states carried between chunks in the state cache): the per-token rule (--batch-invariant), the chunked scan, and
    the C++ runs (Qwen3.5's Gated DeltaNet; LFM2 has no kernel and takes the chunked path)."""
    _, path, hf, _ = hybrid
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    model = load_model(path, batch_invariant=path_ == "per-token",
                       policy=KernelPolicy.make(torch.float32, cpp_kernels) if path_ == "kernel" else None)
    assert model.policy.uses("delta_rule") == (path_ == "kernel")
    for chunk in (7, 64, 90):
        assert (paged_prefill_logits(model, IDS, block_size=4, chunk=chunk) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("options", [
    {"dtype": "float32"},  # the chunked scan, the C++ kernels
    {"dtype": "float32", "chunk_size": 8},  # prompts in many chunks, mixed with decodes
    {"batch_invariant": True, "chunk_size": 5},
    {"dtype": "float32", "pool_blocks": 36},  # preempted and recomputed
], ids=["default", "chunked-prefill", "batch-invariant", "preemption"])
def test_greedy_text_equals_transformers_in_a_batch(hybrid, options):
    """Four prompts of 2 to 90 tokens served together equal transformers' greedy continuations of each alone;
    every state slot is free again afterwards; with a small pool requests are preempted and still equal."""
    _, path, _, greedy = hybrid
    llm = LLM(path, block_size=4, show_progress=False, **{"pool_blocks": 64, **options})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == greedy
    engine = llm.engine
    engine.step()  # the runner hears of the last finished requests with the next step
    assert engine.runner.state_cache.num_used == 0
    assert (engine.scheduler.stats.num_preemptions > 0) == ("pool_blocks" in options)
    engine.scheduler.check_integrity()  # snapshots too: each slot once, each keyed by a cached block


def test_prefix_cache_hits_start_from_state_snapshots(hybrid):
    """A shared system prompt: the first request snapshots the end of its last whole block, the second finds the
    shared blocks without a snapshot and takes one where they end, the third and fourth start there (40 of their
    50 tokens cached); a follow-up turn that extends a prompt starts from that prompt's snapshot. Every answer
    equals the one computed without the prefix cache (the per-token rule: bit-identical however it is split)."""
    _, path, _, _ = hybrid
    system = IDS[:41]
    asks = [system + [(11 * i + j) % 250 + 5 for i in range(9)] for j in range(4)]
    asks.append(asks[0] + [9, 8, 7, 6, 5, 4])
    answers, cached = {}, []
    for prefix_cache in (True, False):
        llm = LLM(path, block_size=4, pool_blocks=64, batch_invariant=True, prefix_cache=prefix_cache,
                  show_progress=False)
        outs = [llm.generate([a], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0] for a in asks]
        answers[prefix_cache] = [o.token_ids for o in outs]
        cached.append([o.num_cached_tokens for o in outs])
        llm.engine.scheduler.check_integrity()
    assert answers[True] == answers[False]
    assert cached == [[0, 0, 40, 40, 48], [0] * 5]


def test_disaggregation_with_tensor_parallel_workers_is_refused_by_name(hybrid):
    _, path, _, _ = hybrid
    with pytest.raises(ValueError, match="--disaggregate with tensor-parallel workers cannot serve a hybrid model"):
        LLM(path, tp=2, disaggregate=True, show_progress=False)


def test_the_state_cache_is_counted_in_the_memory_budget(hybrid):
    """One slot per --max-seqs sequence and as many prefix-cache snapshots (none without the prefix cache), sized by
    the layers' state shapes, taken out of the KV budget: a budget the states alone exceed is refused in one line
    naming --max-seqs."""
    arch, path, _, _ = hybrid
    llm = LLM(path, max_seqs=8, pool_blocks=16, show_progress=False)
    states = llm.engine.runner.state_cache
    per_seq = {"lfm2": 3 * 64 * 2 * 4, "qwen35": 3 * (64 * 3 * 4 + 4 * 8 * 8 * 4)}[arch]
    assert states.num_slots == states.num_snapshots == 8
    assert states.nbytes == 16 * per_seq == llm.engine.executor.rank.state_bytes()
    assert LLM(path, max_seqs=8, pool_blocks=16, prefix_cache=False, show_progress=False).engine.runner.state_cache \
        .nbytes == 8 * per_seq
    with pytest.raises(Exception, match="lower --max-seqs"):
        LLM(path, max_seqs=4096, kv_memory_fraction=1e-9, show_progress=False)


def test_served_over_http_with_the_state_cache_in_metrics(hybrid, tmp_path):
    """`justapi serve` on a hybrid: a chat completion through the OpenAI client, then /metrics shows the state cache's
    slots (all free again) and bytes, each documented."""
    from openai import OpenAI

    arch, path, _, _ = hybrid
    server = InProcessServer(["--model", path, "--max-seqs", "4", "--pool-blocks", "64"], str(tmp_path / "log"))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        answer = client.chat.completions.create(model=arch, messages=[{"role": "user", "content": "hi there"}],
                                                max_tokens=8, temperature=0)
        assert answer.usage.completion_tokens == 8 or answer.choices[0].finish_reason == "stop"
        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "justapi_state_slots_total") == 4 and metric(text, "justapi_state_slots_used") == 0
        assert metric(text, "justapi_state_cache_bytes") > 0 and not undocumented_metrics(text)
    finally:
        assert server.stop() == 0


def test_scan_forms_agree_and_per_token_is_split_invariant():
    """The chunked scan equals the per-token rule within fp32 rounding; the per-token rule and the convolution give
    bit-identical results however a sequence is split."""
    g = torch.Generator().manual_seed(0)
    n, h, dk, dv = 150, 4, 16, 24
    q, k = (torch.nn.functional.normalize(torch.randn(n, h, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(n, h, dv, generator=g)
    decay, beta = -torch.rand(n, h, generator=g), torch.rand(n, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    whole, s_whole = delta_rule.per_token(q, k, v, decay, beta, s0)
    fast, s_fast = delta_rule.chunked(q, k, v, decay, beta, s0)
    assert (fast - whole).abs().max() < 1e-4 and (s_fast - s_whole).abs().max() < 1e-4
    a, s_a = delta_rule.per_token(q[:70], k[:70], v[:70], decay[:70], beta[:70], s0)
    b, s_b = delta_rule.per_token(q[70:], k[70:], v[70:], decay[70:], beta[70:], s_a)
    assert torch.equal(torch.cat([a, b]), whole) and torch.equal(s_b, s_whole)
    x, weight = torch.randn(n, 6, generator=g), torch.randn(6, 4, generator=g)
    out, tail = delta_rule.conv_continue(x, torch.zeros(6, 3), weight)
    first, mid = delta_rule.conv_continue(x[:5], torch.zeros(6, 3), weight)
    rest, end = delta_rule.conv_continue(x[5:], mid, weight)
    assert torch.equal(torch.cat([first, rest]), out) and torch.equal(end, tail)
    step, _ = delta_rule.conv_step(x[5:6], mid.unsqueeze(0), weight)
    assert torch.equal(step[0], out[5])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_hybrids_keep_their_projections_packed(tmp_path, qtype):
    """A 4- or 8-bit hybrid's recurrent projections stay packed on the default engine (the packed kernels, bf16
    activations here) and its logits follow the fp32 engine's on the same file: the same top token at nearly every
    position, the mean difference a few percent of the logits' size (bf16's rounding, which the norms of small
    vectors amplify at some positions)."""
    from justapi.model.quant import Int4Weight, Int8Weight

    for writer in WRITERS.values():
        path, _ = writer(str(tmp_path / f"{qtype}.gguf"), qtype=qtype)
        packed = LLM(path, show_progress=False, pool_blocks=8).engine.model
        assert isinstance(packed.layers[0].attn.in_proj, (Int4Weight, Int8Weight))
        exact = LLM(path, show_progress=False, pool_blocks=8, dtype="float32").engine.model
        a, b = (paged_prefill_logits(m, IDS, chunk=16) for m in (packed, exact))
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
        assert (a - b).abs().mean() < 0.06 * b.abs().mean()


def _oracle(greedy: dict[tuple, list[int]], right: int):
    """Drafts from the known greedy continuations: the next ``right`` tokens right, then a wrong one."""
    def continuation(tokens: list[int]) -> list[int]:
        prompt = next(p for p in greedy if tuple(tokens[: len(p)]) == p)
        return greedy[prompt][len(tokens) - len(prompt):]

    def chain(tokens: list[int], gamma: int) -> list[int]:
        ahead = continuation(tokens)[:gamma]
        return [t if i < right else (t + 1) % 250 + 3 for i, t in enumerate(ahead)]

    def trees(requests):
        """Each level a wrong child first, then the right one (under the right parent), ``right`` levels deep; then
        two wrong children."""
        from justapi.spec.tree import ROOT, DraftTree

        out = {}
        for rid, tokens, _, start, depth in requests:
            ahead, tree, parent = continuation(tokens[: start + 1]), DraftTree(), ROOT
            for level, t in enumerate(ahead[:depth]):
                tree.add((t + 1) % 250 + 3, parent)
                node = tree.add(t if level < right else (t + 2) % 250 + 3, parent)
                parent = node
            out[rid] = tree
        return out

    return chain, trees


@pytest.mark.parametrize("right", [0, 2, 8])
def test_drafts_verified_keep_the_state_after_the_last_accepted_token(hybrid, tiny_model, monkeypatch, right):
    """Speculative decoding on a hybrid is lossless: drafts (prompt-lookup chains, a draft model's trees) that are
    right for ``right`` tokens and then wrong; each verification steps every draft row from its parent's state and the
    runner keeps the state after the last accepted row. Greedy text equals plain decoding, with that many drafts
    accepted; the tree puts a wrong sibling before each right node, so the kept row is never simply the last."""
    from justapi.core import drafts

    _, path, _, greedy = hybrid
    known = {tuple(p): g for p, g in zip(PROMPTS, greedy)}
    chain, trees = _oracle(known, right)
    monkeypatch.setattr(drafts, "propose_ngram", chain)
    for options in ({"spec_method": "ngram", "gamma": 4}, {"draft_model": tiny_model, "gamma": 3, "branch": 2}):
        llm = LLM(path, block_size=4, pool_blocks=96, batch_invariant=True, show_progress=False, **options)
        if llm.engine.runner.proposer is not None:
            llm.engine.runner.proposer.propose = trees
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert [o.token_ids for o in outs] == greedy
        stats = llm.engine.scheduler.stats
        assert stats.spec_draft_tokens > 0 and (stats.spec_accepted_tokens > 0) == (right > 0)


def test_tensor_parallel_ranks_split_the_recurrent_layers(hybrid, monkeypatch):
    """--tp 2: each rank holds half of the recurrent layers (Gated DeltaNet's key heads with the value heads they
    serve, a short convolution's channels) and their states; greedy text equals one rank's with prefix-cache hits
    from state snapshots and drafts verified on every rank, and logprobs are within 1e-3 of one rank's."""
    from justapi.core import drafts

    arch, path, _, greedy = hybrid
    prompts = PROMPTS + [IDS[:41] + [5 + i, 6, 7 + i] for i in range(3)]
    known = dict(zip(map(tuple, PROMPTS), greedy))
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)  # such requests never draft
    opts = dict(block_size=4, pool_blocks=128, show_progress=False)
    one = LLM(path, **opts)
    want, want_scored = one.generate(prompts, plain), one.generate(prompts[:2], scored)
    chain, _ = _oracle(known, 2)
    monkeypatch.setattr(drafts, "propose_ngram", lambda tokens, gamma: chain(tokens, gamma) if any(
        tuple(tokens[: len(p)]) == p for p in known) else [])
    llm = LLM(path, tp=2, spec_method="ngram", gamma=4, **opts)
    try:
        mixer = llm.engine.model.layers[0].attn
        if arch == "qwen35":
            assert (mixer.key_heads, mixer.value_heads) == (1, 2)
        else:
            assert mixer.conv.shape[0] == 32
        assert [g.token_ids for g in llm.generate(prompts, plain)] == [w.token_ids for w in want]
        sched = llm.engine.scheduler
        assert sched.cache.hits > 0 and sched.stats.spec_accepted_tokens > 0
        for g, w in zip(llm.generate(prompts[:2], scored), want_scored):
            assert g.token_ids == w.token_ids
            for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("fused", [False, True], ids=["gate-and-up", "gate_up_exps"])
def test_qwen35_moe_matches_transformers(tmp_path, fused):
    """qwen35moe: Qwen3.5's layers with a mixture of experts (top-2 of 4, renormalized, and a shared expert behind its
    sigmoid gate) through the engine's MoE path, the experts' gate and up as two tensors or as llama.cpp's fused
    ffn_gate_up_exps: logits within 1e-4 of transformers' Qwen3_5MoeForCausalLM over chunks, greedy text equal in a
    batch."""
    from justapi.model.blocks import MoeMlp

    path, hf = write_tiny_qwen35(str(tmp_path / "qwen35moe.gguf"), experts=4, fused_experts=fused)
    model = load_model(path)
    assert model.config.arch == "qwen35moe" and isinstance(model.layers[0].mlp, MoeMlp)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
        greedy = [hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):]
                  .tolist() for p in PROMPTS]
    assert (paged_prefill_logits(model, IDS, block_size=4, chunk=7) - ref).abs().max().item() < 1e-4
    llm = LLM(path, block_size=4, pool_blocks=64, dtype="float32", show_progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == greedy


def test_disaggregated_workers_ship_the_states_with_the_kv(hybrid):
    """--disaggregate: the prefill worker keeps a handed-off request's state slot until its KV is sent, the states
    travel beside the KV (a second tensor of the same transfer), the decode worker copies them into its slot; greedy
    text equals the colocated engine's, and no worker holds a request, hand-off, transfer or block afterwards."""
    from justapi.config import EngineConfig
    from justapi.engine.worker_pool import WorkerPoolEngine
    from test_pd import run_all, settled

    _, path, _, greedy = hybrid
    opts = dict(pool_blocks=128, block_size=4, batch_invariant=True, chunk_size=16, show_progress=False)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(PROMPTS)
    engine = WorkerPoolEngine(EngineConfig(path, disaggregate=True, num_threads=1, **opts))
    try:
        done, failed = run_all(engine, PROMPTS, params)
        assert not failed
        assert [done[f"r{i}"].token_ids for i in range(len(PROMPTS))] == greedy
        assert engine.pd.stats.kv_transfers == len(PROMPTS)
        for rank, (problem, held) in settled(engine).items():
            assert problem is None, (rank, problem)
            assert held["running"] == held["handoffs"] == held["transfers"] == held["blocks_held_by_requests"] == 0
    finally:
        engine.close()


def test_the_cpp_gated_delta_runs_update_the_slots_as_the_torch_path_does(cpp_kernels):
    """kernels.gated_delta_runs (a batch's runs in place on their state slots: a fresh prompt, a decode row, a
    continued chunk) against GatedDeltaNet's torch path run by run (the convolution from the slot's tail, SiLU, the
    normalized and repeated heads, the gates, the rule token by token, the gated norm): outputs and every slot's new
    tail and state within fp32 rounding, the slots not named untouched, and a fresh run's stale slot ignored."""
    g = torch.Generator().manual_seed(1)
    key_heads, value_heads, dk, dv, taps = 2, 4, 8, 12, 4
    channels = 2 * key_heads * dk + value_heads * dv
    net = GatedDeltaNet(None, torch.randn(channels, taps, generator=g), -torch.rand(value_heads, generator=g),
                        torch.randn(value_heads, generator=g), 1 + torch.randn(dv, generator=g) / 4, None, key_heads,
                        value_heads, dk, dv, 1e-6)
    runs = torch.tensor([[0, 9, 7, 1], [9, 1, 0, 0], [10, 5, 3, 0]])
    rows = 15
    inputs = tuple(torch.randn(rows, width, generator=g) for width in (channels, value_heads, value_heads,
                                                                        value_heads * dv))  # mixed, b, alpha, z
    tails = torch.randn(9, channels, taps - 1, generator=g)
    states = torch.randn(9, value_heads, dk, dv, generator=g)
    want_tails, want_states, want = tails.clone(), states.clone(), torch.empty(rows, value_heads * dv)
    for first, n, slot, fresh in runs.tolist():
        start = [torch.zeros_like(t[slot]) if fresh else t[slot] for t in (tails, states)]
        part = slice(first, first + n)
        want[part], (want_tails[slot], want_states[slot]) = net._seq(tuple(t[part] for t in inputs), start,
                                                                     delta_rule.per_token)
    out = torch.empty(rows, value_heads * dv)
    cpp_kernels.gated_delta_runs(*inputs, net.conv, net.a, net.dt_bias, net.norm, net.eps, tails, states, runs,
                                 key_heads, out)
    assert (out - want).abs().max() < 1e-5
    assert (tails - want_tails).abs().max() < 1e-6 and (states - want_states).abs().max() < 1e-5
    assert torch.equal(tails[[1, 2, 4, 5, 6, 8]], want_tails[[1, 2, 4, 5, 6, 8]])


def test_greedy_text_identical_with_and_without_the_delta_rule_kernel(hybrid):
    """The exact path (fp32) with the C++ Gated DeltaNet runs and with them off (--disable-kernels delta_rule): the same
    greedy text, which is transformers'."""
    arch, path, _, greedy = hybrid
    outs = {}
    for disabled in ((), ("delta_rule",)):
        llm = LLM(path, block_size=4, pool_blocks=64, dtype="float32", disabled_kernels=disabled, show_progress=False)
        assert llm.engine.model.policy.uses("delta_rule") == (not disabled)
        outs[disabled] = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                                                    ignore_eos=True))]
    assert outs[()] == outs[("delta_rule",)] == greedy


def test_a_sequence_starting_with_one_token_starts_from_a_zero_state(hybrid):
    """One state slot (--max-seqs 1), reused: a one-token prompt (its first step goes with the decode rows, which read
    their slot) after a long request gives the same text as on a fresh engine, not a continuation of the slot's
    previous holder."""
    _, path, _, _ = hybrid
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fresh = LLM(path, block_size=4, pool_blocks=64, max_seqs=1, show_progress=False).generate([[IDS[7]]], params)
    llm = LLM(path, block_size=4, pool_blocks=64, max_seqs=1, show_progress=False)
    llm.generate([IDS], params)
    assert llm.generate([[IDS[7]]], params)[0].token_ids == fresh[0].token_ids
