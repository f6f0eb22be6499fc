"""transformers' model of a GGUF file (its own conversion and dequantization, fp32): the tests' reference."""

from __future__ import annotations

import functools
import os
from unittest import mock


def hf_model(path: str, **overrides):
    """The reference model for ``path``. Two of gguf's slow spots are bypassed while transformers loads it, neither
    touching a value: the metadata parse over an ``np.memmap`` (the engine's reader subclass reads the same bytes
    through a plain ndarray view of the mapping; 2 × 6 s for SmolLM2), and the tensor-name map that transformers
    rebuilds for every tensor (cached: 7 s)."""
    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from justapi.model.gguf_loader import _plain_reader_class

    transformers.logging.set_verbosity_error()
    reader = _plain_reader_class()
    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "GGUFReader", reader), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, **overrides
        ).eval()
