"""transformers on a GGUF file (its own conversion, dequantization and tokenizer, fp32): the tests' reference."""

from __future__ import annotations

import contextlib
import functools
import os
from unittest import mock


@contextlib.contextmanager
def _fast_gguf_reads():
    """Two of gguf's slow spots bypassed while transformers reads a file, neither touching a value: the metadata
    parse (transformers parses a file up to three times per load, over an ``np.memmap``: 2 x 6 s for SmolLM2, 20 s
    for Gemma 3's vocabulary; here it gets the engine's parse of the file, gguf's own reader over a plain ndarray
    view of the same mapping, made once per process), and the tensor-name map that transformers rebuilds for every
    tensor (cached: 7 s)."""
    import gguf

    from justapi.model.gguf_loader import open_gguf
    from justapi.model.gguf_reader import reader_class

    reader_class()  # made (and kept) while gguf.GGUFReader is still the real class it derives from
    reader = lambda path, mode="r": open_gguf(str(path))  # noqa: E731  (read-only; transformers never writes)
    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "GGUFReader", reader), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        yield


def hf_model(path: str, **overrides):
    """The reference model for ``path``, in fp32."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    with _fast_gguf_reads():
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, **overrides
        ).eval()


def hf_tokenizer(path: str):
    """The reference tokenizer for ``path`` (AutoTokenizer, as a user of transformers would load it)."""
    from transformers import AutoTokenizer

    with _fast_gguf_reads():
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Plain argmax decoding with transformers' KV cache, never stopping early (like ignore_eos): the prompts as one
    left-padded batch (masked padding, positions counted from each prompt's start), one forward per token."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    out, past = [], None
    with torch.no_grad():
        for _ in range(n):
            res = hf(ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = res.logits[:, -1].argmax(-1)
            out.append(tok.tolist())
            ids = tok[:, None]
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
    return [list(seq) for seq in zip(*out)]
