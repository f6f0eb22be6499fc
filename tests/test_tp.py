"""Tensor parallelism (--tp N): shard plans, greedy output identical to one rank, logits within fp32 tolerance,
start-up errors naming the dimension, and a dead worker failing the server clearly."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from justapi import LLM, SamplingParams
from justapi.model_config import ModelConfig
from justapi.distributed.tp import TpPlan, even_range
from justapi.structured.spec import StructuredOutput


def _config(heads, kv_heads, inter=1536, vocab=49152):
    return ModelConfig("x", "llama", vocab, 576, inter, 2, heads, kv_heads, 64, 1e-5, 1e4, 2048, True, False, False)


def test_plans_split_heads_replicate_kv_heads_and_cover_every_row():
    smol = _config(9, 3)
    three = [TpPlan.make(smol, r, 3) for r in range(3)]
    assert [p.q_heads for p in three] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)] and [p.kv_heads for p in three] == [
        (0,), (1,), (2,)]
    two = [TpPlan.make(smol, r, 2) for r in range(2)]  # 9 heads on 2 ranks: uneven, shared KV head 1 replicated
    assert [p.q_heads for p in two] == [(0, 1, 2, 3, 4), (5, 6, 7, 8)]
    assert [p.kv_heads for p in two] == [(0, 0, 0, 1, 1), (1, 2, 2, 2)]
    tiny = _config(4, 2, inter=128, vocab=271)
    four = [TpPlan.make(tiny, r, 4) for r in range(4)]  # more ranks than KV heads: each KV head on two ranks
    assert [p.kv_heads for p in four] == [(0,), (0,), (1,), (1,)]
    for plans, n in ((two, 49152), (four, 271)):
        assert [p.vocab for p in plans] == [even_range(n, len(plans), r) for r in range(len(plans))]
        assert plans[0].vocab[0] == 0 and plans[-1].vocab[1] == n
        assert all(a.vocab[1] == b.vocab[0] and a.ffn[1] == b.ffn[0] for a, b in zip(plans, plans[1:]))
    with pytest.raises(ValueError, match="--tp 10 exceeds the model's 9 attention heads"):
        TpPlan.make(smol, 0, 10)


def _prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 271) for _ in range(rng.randint(2, 60))] for _ in range(n)]


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_model_greedy_identical_and_logprobs_close(tiny_model, tp):
    opts = dict(pool_blocks=256, show_progress=False)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    want = LLM(tiny_model, **opts).generate(prompts, params)
    llm = LLM(tiny_model, tp=tp, **opts)
    try:
        got = llm.generate(prompts, params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want):
            for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
        comm = llm.engine.model.comm
        assert comm.calls > 0 and comm.seconds > 0  # the all-reduces ran (and were timed)
    finally:
        llm.engine.close()


def test_tp_with_prefix_cache_draft_tree_speculation_and_a_grammar(tiny_model):
    opts = dict(pool_blocks=256, show_progress=False)
    prompts = [list(range(10, 42)) + p for p in _prompts(6, seed=1)]  # a shared 32-token prefix: cache hits
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 6
    for i in (1, 4):  # constrained: every rank rebuilds the matcher and masks the same draft tree
        params[i] = SamplingParams(temperature=0, max_tokens=30,
                                   structured=StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}"))
    params[2] = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=16, ignore_eos=True)  # seeded: equal
    spec = dict(draft_model=tiny_model, gamma=3, branch=2, spec_max_batch=64)  # the sampled row: the same tree
    want = [r.token_ids for r in LLM(tiny_model, **spec, **opts).generate(prompts, params)]
    llm = LLM(tiny_model, tp=2, **spec, **opts)
    try:
        assert [r.token_ids for r in llm.generate(prompts, params)] == want
        sched = llm.engine.scheduler
        assert sched.stats.spec_accepted_tokens > 0 and sched.cache.hits > 0
    finally:
        llm.engine.close()


def test_each_rank_reads_only_its_shard_from_the_file(tmp_path):
    """The loader cuts each rank's rows or whole-block columns out of the stored bytes: the same values as slicing
    the whole tensor, 4-bit weights stay 4-bit, and columns off the block grid fall back to dequantized slices."""
    from tiny_gguf import write_tiny_model

    from justapi.model.gguf_loader import load_tensors, open_gguf, read_model_config
    from justapi.model.llama import shard_selection
    from justapi.model.quant import Q4Unpacked

    path = write_tiny_model(str(tmp_path / "q4.gguf"), "qwen2", qtype="Q4_1", tied=False)  # head_dim 16
    reader = open_gguf(path)
    cfg = read_model_config(reader, path)
    whole = load_tensors(reader, path, torch.float32, False)
    whole_q4 = load_tensors(reader, path, torch.float32, False, keep_packed=True)
    for size in (2, 4):
        plan = TpPlan.make(cfg, size - 1, size)
        select = lambda name: shard_selection(name, plan, cfg)  # noqa: E731
        mine = load_tensors(reader, path, torch.float32, False, select=select)
        mine_q4 = load_tensors(reader, path, torch.float32, False, keep_packed=True, select=select)
        for name, t in whole.items():
            sel = select(name)
            want = t if sel is None else t.index_select(sel[0], sel[1])
            assert torch.equal(mine[name], want), name
            q = mine_q4[name]
            if isinstance(whole_q4[name], Q4Unpacked) and sel is not None and sel[0] == 0:
                assert isinstance(q, Q4Unpacked) and torch.equal(q.q, whole_q4[name].q[sel[1]]), name
        down = mine_q4["blk.0.ffn_down.weight"]  # 128 / size intermediate columns: whole 32-blocks
        cols = select("blk.0.ffn_down.weight")[1]
        assert isinstance(down, Q4Unpacked)
        assert torch.equal(down.dequantize(), whole_q4["blk.0.ffn_down.weight"].dequantize()[:, cols])
        assert mine["blk.0.attn_q.bias"].shape == (len(plan.q_heads) * cfg.head_dim,)
        # the output projection's columns: 2 heads of 16 on 2 ranks (one block), 16 columns on 4 (half a block)
        assert isinstance(mine_q4["blk.0.attn_output.weight"], Q4Unpacked) == (size == 2)


def test_4bit_weights_stay_4bit_under_tp(tmp_path):
    """--dtype auto with --tp 2: every rank multiplies its 4-bit shard with the int4 kernel; the distributions match
    one rank's within bf16 rounding (partial sums are added in fp32 across ranks, in a different order)."""
    from tiny_gguf import write_tiny_model

    from justapi.model.quant import Int4Weight

    path = write_tiny_model(str(tmp_path / "q4.gguf"), hidden=128, intermediate=256, qtype="Q4_1", weight_scale=0.05)
    opts = dict(pool_blocks=128, dtype="auto", show_progress=False)
    prompts = _prompts(6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    want = LLM(path, **opts).generate(prompts, params)
    llm = LLM(path, tp=2, **opts)
    try:
        layer = llm.engine.model.layers[0]
        assert isinstance(layer.attn.qkv, Int4Weight) and isinstance(layer.mlp.down, Int4Weight)
        # heads 0-1, KV head 0
        assert layer.attn.qkv.shape == (2 * 32 + 2 * 32, 128) and layer.mlp.down.shape == (128, 128)
        got = llm.generate(prompts, params)
        for g, w in zip(got, want):
            a, b = dict(g.outputs[0].logprobs[0].top), dict(w.outputs[0].logprobs[0].top)
            for tok in a.keys() & b.keys():
                assert a[tok] == pytest.approx(b[tok], rel=0.01, abs=0.05)  # logits are bf16: 8 bits of mantissa
            assert len(a.keys() & b.keys()) >= 4
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def smollm2_one_rank(real_model_path, smollm2_copy_task):
    chats, params, _, _ = smollm2_copy_task
    opts = dict(pool_blocks=512, dtype="float32", show_progress=False)
    return chats[:4], params, [r.token_ids for r in LLM(real_model_path, **opts).generate(chats[:4], params)], opts


@pytest.mark.real_model
@pytest.mark.parametrize("tp", [3, 2], ids=["tp3-kv-split", "tp2-kv-replicated"])
def test_smollm2_greedy_identical_to_one_rank(real_model_path, smollm2_one_rank, tp):
    chats, params, want, opts = smollm2_one_rank
    llm = LLM(real_model_path, tp=tp, **opts)
    try:
        assert [r.token_ids for r in llm.generate(chats, params)] == want
    finally:
        llm.engine.close()


def test_a_dead_worker_fails_the_server_clearly(tiny_model, tmp_path):
    import httpx

    from server_helpers import ServerProcess, wait_until

    srv = ServerProcess(["--model", tiny_model, "--pool-blocks", "128", "--tp", "2"],
                        str(tmp_path / "tp.log"), timeout_s=300)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        worker = _child_pids(srv.proc.pid)
        assert len(worker) == 1
        os.kill(worker[0], signal.SIGKILL)
        # its sockets closed once it is gone: a step then finds the rank gone
        wait_until(lambda: _exited(worker[0]), 10, "the killed worker gone")
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "engine stopped" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 30  # an error, not a hang
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and "engine stopped" in health.text
    finally:
        srv.stop()


def _exited(pid: int) -> bool:
    """The process has ended: gone, or a zombie its parent has not reaped yet (its files already closed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _child_pids(pid: int) -> list[int]:
    """The server's spawned worker processes (multiprocessing's resource tracker excluded)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(entry))
    return out
