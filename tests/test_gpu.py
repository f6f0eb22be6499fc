"""CUDA: the same engine on a GPU gives the CPU's greedy text. Skipped where torch sees no GPU."""

from __future__ import annotations

import pytest
import torch

from justapi import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpu_greedy_matches_cpu(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["the cat sat", "hello world", "on the mat"]
    cpu = LLM(tiny_model, pool_blocks=64, show_progress=False).generate(prompts, params)
    gpu = LLM(tiny_model, pool_blocks=64, gpu=True, show_progress=False).generate(prompts, params)
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]
