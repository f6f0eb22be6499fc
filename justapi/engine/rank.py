"""A rank: one rank's model (all of it, or a tensor-parallel shard), its draft model, its KV cache and its
runner. It executes what the engine scheduled and never decides; the executor (engine.executor) drives it, in this
process or in another."""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..config import EngineConfig
from ..model_config import ModelConfig
from ..core.outputs import RunnerOutput, SchedulerOutput
from ..kernels import decode_kernels
from ..model.gguf_loader import ModelLoadError, load_tensors, open_gguf, read_model_config
from ..model.kernel_policy import INT8_GROUP, KernelPolicy, kv_cache_dtype, resolve_dtype
from ..model.encoder import EncoderModel
from ..model.llama import LlamaModel, shard_selection
from ..model.runner import ModelRunner, kv_bytes_per_block
from ..model.state_cache import state_bytes_per_seq
from ..spec.draft import DraftProposer, check_same_vocabulary
from ..structured.grammars import for_model as grammars_for

log = logging.getLogger("justapi.engine")


class Rank:
    """One rank's weights, then (``allocate``) its KV pool and runner."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, plan=None, comm=None) -> None:
        """``plan``, ``comm``: this rank's distributed.tp TpPlan and TpComm, or None for the whole model."""
        self.config = config
        self.lead = plan is None or plan.rank == 0  # logs and shows progress for the engine
        # the context served, not the file's: the RoPE tables' length, and LongRoPE's choice of factors
        model_config = dataclasses.replace(model_config,
                                           context_length=config.max_model_len or model_config.context_length)
        self.draft_model = self._load_draft(config.draft_model, model_config) if config.draft_model else None
        select = None
        if plan is not None:
            select = lambda name: shard_selection(name, plan, model_config)  # noqa: E731
        self.model = self._load(open_gguf(config.model), config.model, model_config, self.lead, select, plan, comm)
        self.runner: ModelRunner | None = None

    def _load(self, reader, path: str, model_config: ModelConfig, lead: bool, select=None, plan=None,
              comm=None) -> LlamaModel | EncoderModel:
        """A model's weights in the dtype and kernel routes the flags and the CPU decide (logged by the lead)."""
        config = self.config
        kernels = decode_kernels() if config.cpu_kernels and not config.gpu else None
        dtype_name = "float32" if config.batch_invariant else config.dtype
        dtype, keep_packed = resolve_dtype(dtype_name, reader, config.gpu, kernels)
        keep_packed = keep_packed and not model_config.is_encoder  # an encoder's linears are dense (model.encoder)
        policy = KernelPolicy.make(dtype, kernels, config.disabled_kernels)
        if lead:
            for line in policy.describe():
                log.info(line)
        if config.kv_cache_dtype == "int8" and not model_config.is_encoder and model_config.head_dim % INT8_GROUP:
            raise ModelLoadError(f"--kv-cache-dtype int8 keeps a scale per {INT8_GROUP} values of a head: this "
                                 f"model's head size is {model_config.head_dim}; use bfloat16")
        tensors = load_tensors(reader, path, dtype, config.show_progress and self.lead, keep_packed, select)
        model_class = EncoderModel if model_config.is_encoder else LlamaModel
        return model_class(model_config, tensors, config.device, config.batch_invariant, plan, comm,
                          kv_dtype=kv_cache_dtype(config.kv_cache_dtype, dtype, keep_packed), policy=policy,
                          huge_pages=config.huge_pages)

    def _load_draft(self, path: str, target: ModelConfig) -> LlamaModel:
        """The --draft-model: same vocabulary as the target (checked first), weights under the same policy."""
        try:
            reader = open_gguf(path)
            draft_config = read_model_config(reader, path)
        except ModelLoadError as e:
            raise ModelLoadError(f"--draft-model: {e}") from None
        if draft_config.is_encoder:  # it would load as an EncoderModel, which has no KV cache and drafts nothing
            raise ModelLoadError(f"--draft-model {path}: an encoder ({draft_config.arch}) cannot draft tokens")
        if draft_config.is_hybrid:  # the proposer rolls back KV, not recurrent states
            raise ModelLoadError(f"--draft-model {path}: a hybrid model ({draft_config.arch}) cannot draft tokens yet")
        check_same_vocabulary(open_gguf(self.config.model), self.config.model, reader, path)
        if draft_config.vocab_size != target.vocab_size:
            raise ModelLoadError(f"--draft-model {path}: its embedding has {draft_config.vocab_size} rows, the "
                                 f"target's {target.vocab_size}")
        # the draft sees the target's positions: its rotary table serves the target's context (a draft trained on a
        # shorter one only drafts worse there; verification keeps the output exact)
        draft_config = dataclasses.replace(draft_config, context_length=target.context_length)
        log.info("draft model %s: %d layers, hidden %d", path, draft_config.num_layers, draft_config.hidden_size)
        draft = self._load(reader, path, draft_config, lead=False)
        assert isinstance(draft, LlamaModel)  # an encoder was refused above
        return draft

    def kv_bytes_per_block(self) -> int:
        """KV bytes of one block: the model's, plus the draft's own cache at the same block ids."""
        total = kv_bytes_per_block(self.model, self.config.block_size)
        if self.draft_model is not None:
            total += kv_bytes_per_block(self.draft_model, self.config.block_size)
        return total

    def state_bytes(self) -> int:
        """Bytes of a hybrid model's state cache: one slot per sequence the engine may run and its prefix cache's
        snapshots (0 for other models)."""
        return state_bytes_per_seq(self.model) * (self.config.max_seqs + self.state_snapshots())

    def state_snapshots(self) -> int:
        """A hybrid's prefix cache's snapshot slots (core.state_snapshots): as many as the sequences it runs."""
        hybrid = bool(state_bytes_per_seq(self.model))
        return self.config.max_seqs if hybrid and self.config.prefix_cache else 0

    def allocate(self, num_blocks: int, branch: int) -> None:
        """The KV pool of ``num_blocks`` blocks and the runner over it (``branch``: the draft tree's fan-out)."""
        proposer = None
        if self.draft_model is not None:
            proposer = DraftProposer(self.draft_model, num_blocks, self.config.block_size, self.config.device, branch)
        model_path = self.config.model
        self.runner = ModelRunner(self.model, num_blocks, self.config.block_size, self.config.device, proposer,
                                  grammars=lambda: grammars_for(model_path),
                                  state_slots=self.config.max_seqs if self.state_bytes() else 0,
                                  state_snapshots=self.state_snapshots())

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        assert self.runner is not None  # the executor allocates before the first step
        return self.runner.execute(sched)

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's K/V of ``block_ids`` (see ModelRunner.export_kv)."""
        assert self.runner is not None  # the executor allocates before the first step
        return self.runner.export_kv(block_ids)
