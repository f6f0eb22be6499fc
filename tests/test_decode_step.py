"""A decode step's layers in one native call (kernels/decode_step.cpp through model/decode_plan.py) give the Python
layer loop's logits bit for bit: on every decode step of tiny models of each family part it has (QKV biases, QK
norms, Gemma 3's post-norms, windows and GELU, Granite's multipliers) over 4-bit, 8-bit and fp32 weights and each KV
cache dtype, and on SmolLM2 and Gemma 3; parts it lacks keep the loop."""

from __future__ import annotations

import pytest
import torch

from justapi import LLM, SamplingParams
from tiny_gguf import write_tiny_model

PROMPTS = [[5, 9, 14, 3], [7, 7, 21], [30, 2, 11, 8, 19, 4, 6], [12], [40, 41], [3, 3, 3, 8, 1], [9, 25, 17]]


def both_ways(llm: LLM, steps: list, max_tokens: int = 3) -> list:
    """Greedy outputs of PROMPTS; on each decode-only forward, the native layers' logits against the loop's (the
    loop run second on the same inputs: it writes the same K/V at the same slots)."""
    model = llm.engine.model
    native = model.decode_layers
    assert native is not None, "the model's parts all have a native form"
    cls = type(model)
    forward = cls.forward

    def spy(self, input_ids, positions, meta, caches, logits_rows, hidden_rows=None):
        if self is not model or meta.decode_rows is None or len(meta.decode_rows) != len(input_ids):
            return forward(self, input_ids, positions, meta, caches, logits_rows, hidden_rows)
        fast = forward(self, input_ids, positions, meta, caches, logits_rows, hidden_rows)
        self.decode_layers = None
        try:
            slow = forward(self, input_ids, positions, meta, caches, logits_rows, hidden_rows)
        finally:
            self.decode_layers = native
        steps.append((len(input_ids), torch.equal(fast, slow)))
        return fast

    cls.forward = spy
    try:
        # each prompt its own length, so that steps of 7 rows down to 1 come (the routes of small and larger batches)
        outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=max_tokens + 2 * i, temperature=0,
                                                     ignore_eos=True) for i in range(len(PROMPTS))])
    finally:
        cls.forward = forward
    return [o.outputs[0].token_ids for o in outs]


CASES = [("llama", "Q4_0", "bfloat16", {}), ("qwen2", "Q8_0", "bfloat16", {}), ("qwen3", "Q4_0", "int8", {}),
         ("gemma3", "Q8_0", "bfloat16", {}), ("granite", "F32", "float32", {}), ("llama", "F32", "bfloat16", {}),
         # other routes of this CPU's: the units on AVX-512 vectors (dpbf16), fp32 rows on AVX2 (q_matmul)
         ("qwen2", "Q8_0", "bfloat16", {"disabled_kernels": ("amx",)}), ("qwen3", "Q8_0", "float32",
                                                                           {"dtype": "float32"})]


@pytest.mark.parametrize("arch,qtype,kv,engine", CASES, ids=[f"{a}-{q}-{k}-{'-'.join(map(str, e.values()))}"
                                                             for a, q, k, e in CASES])
def test_native_decode_layers_give_the_loop_s_logits_bit_for_bit(tmp_path, arch, qtype, kv, engine):
    path = write_tiny_model(str(tmp_path / f"{arch}.gguf"), arch, qtype=qtype, hidden=64, intermediate=128,
                            num_layers=3, head_dim=32 if kv == "int8" else None)
    steps: list = []
    llm = LLM(path, pool_blocks=64, kv_cache_dtype=kv, show_progress=False, **engine)
    both_ways(llm, steps)
    assert len(steps) >= 10 and {n for n, _ in steps} == set(range(1, len(PROMPTS) + 1)), steps
    assert all(same for _, same in steps), steps


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_a_fused_weight_of_outputs_not_in_whole_units_decodes_natively_as_the_loop_does(tmp_path, qtype):
    """Q/K/V of 8 query heads and one K/V head of 20 (200 rows, 12.5 units of 16): the units hold it padded with
    zero rows, and the native step keeps its 200 outputs as the loop does."""
    path = write_tiny_model(str(tmp_path / "odd.gguf"), "qwen3", qtype=qtype, hidden=64, intermediate=128,
                            num_heads=8, num_kv_heads=1, head_dim=20)
    steps: list = []
    llm = LLM(path, pool_blocks=64, show_progress=False)
    qkv = llm.engine.model.layers[0].attn.qkv
    assert qkv.shape[0] == 200 and {r.kernel for r in qkv.routes} <= {"amx", "dpbf16", "q4_small", "q8_small"}
    both_ways(llm, steps)
    assert len(steps) >= 10 and all(same for _, same in steps), steps


def test_smollm2_and_gemma3_decode_natively_as_the_loop_does(real_model_path, gemma3_path):
    for path in (real_model_path, gemma3_path):
        steps: list = []
        llm = LLM(path, pool_blocks=128, show_progress=False)
        both_ways(llm, steps, max_tokens=1)
        assert steps and all(same for _, same in steps), (path, steps)
        llm.engine.close()


def test_parts_without_a_native_form_keep_the_loop(tmp_path):
    """A soft-capped model (Gemma 2), --batch-invariant, --disable-kernels decode_step: the loop serves them."""
    gemma2 = write_tiny_model(str(tmp_path / "g2.gguf"), "gemma2", hidden=64, intermediate=128)
    assert LLM(gemma2, pool_blocks=16, show_progress=False).engine.model.decode_layers is None
    llama = write_tiny_model(str(tmp_path / "l.gguf"), "llama", qtype="Q4_0", hidden=64, intermediate=128)
    assert LLM(llama, pool_blocks=16, batch_invariant=True, show_progress=False).engine.model.decode_layers is None
    off = LLM(llama, pool_blocks=16, disabled_kernels=("decode_step",), show_progress=False)
    assert off.engine.model.decode_layers is None
    assert LLM(llama, pool_blocks=16, show_progress=False).engine.model.decode_layers is not None
