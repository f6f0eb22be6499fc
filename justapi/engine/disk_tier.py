"""The prefix cache's disk tier as an engine opens and feeds it (core.kv_store keeps the files; this knows torch).

The fingerprint that keys a directory's files names everything a block's K/V depends on besides its tokens: the
model file, the model's configuration as loaded, and how this engine computes and stores KV (KV dtype, block size,
compute dtype, batch invariance, tensor-parallel degree: each changes the last bits of what is stored).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy
import torch

from ..config import EngineConfig
from ..core.kv_store import KvStore, fingerprint
from ..model.gguf_loader import ModelLoadError
from ..model_config import ModelConfig
from ..sizes import parse_size

log = logging.getLogger("justapi.engine")


def open_disk_tier(config: EngineConfig, model_config: ModelConfig, model, runner) -> KvStore | None:
    """The store of ``--prefix-cache-dir`` for this model, or None without one (or for an encoder, which has no
    prefix cache). ``model``, ``runner``: rank 0's (its KV and compute dtypes; one block's K/V, every head)."""
    if config.prefix_cache_dir is None or model_config.is_encoder:
        return None
    block_shape = runner.block_shape()
    if model_config.is_hybrid:
        raise ModelLoadError("--prefix-cache-dir keeps attention KV only: a hybrid model's recurrent states are not "
                             "written to disk in this version; drop --prefix-cache-dir")
    layout = {"model": repr(dataclasses.replace(model_config, path="")), "kv_dtype": str(model.kv_dtype),
              "compute_dtype": str(model.dtype), "block_shape": block_shape, "batch_invariant": config.batch_invariant,
              "tp": config.tp}
    try:
        key = fingerprint(model_config.path, layout)
        block_bytes = int(torch.Size(block_shape).numel()) * model.kv_dtype.itemsize
        store = KvStore(config.prefix_cache_dir, parse_size(config.prefix_cache_dir_size, "--prefix-cache-dir-size"),
                        key, block_bytes, config.prefix_cache_dir_reads)
    except OSError as e:
        raise ModelLoadError(f"--prefix-cache-dir {config.prefix_cache_dir}: {e.strerror or e}") from None
    stats = store.snapshot()
    log.info("prefix cache disk tier: %s (this model's files under %s), %.2f of %.2f GiB used", store.root, key,
             stats.disk_bytes / 2**30, stats.max_bytes / 2**30)
    return store


def spill(store: KvStore, kv: torch.Tensor, spills: list[tuple[int, str, list[int]]]) -> None:
    """Queue the blocks ``spills`` names for writing: ``kv`` is their K/V as ``EngineCore.export_kv`` gives it
    ([layers, 2, kv_heads, blocks, block_size, dim], a copy). Each block is made contiguous on the writer's thread
    by numpy: a torch op there would start an OpenMP team of that thread's own, whose spinning threads took the
    engine's cores (a shared-prefix run lost its disk hits' gain)."""
    raw = kv.cpu().contiguous().view(torch.uint8).numpy()  # bytes as the last dimension: any KV dtype, any device
    for i, (_, key, tokens) in enumerate(spills):
        store.write(key, tokens, lambda i=i: numpy.ascontiguousarray(raw[:, :, :, i]))
