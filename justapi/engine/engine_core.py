"""EngineCore: loads the model and wires scheduler, runner and output processing into one ``step()``."""

from __future__ import annotations

import dataclasses
import logging
import random

import torch

from ..config import (
    DEFAULT_BRANCH,
    DEFAULT_GAMMA,
    DEFAULT_MAX_POOL_TOKENS,
    EngineConfig,
    SchedulerConfig,
)
from ..core.outputs import EngineCoreOutput
from ..core.stats import SchedulerSnapshot
from ..core.scheduler import Scheduler, StaticScheduler
from ..kernels import decode_kernels
from ..model.chat_template import ChatTemplate
from ..model.kernel_policy import KernelPolicy, kv_cache_dtype, resolve_dtype
from ..model.gguf_loader import ModelLoadError, load_tensors, open_gguf, read_model_config
from ..model.llama import LlamaModel
from ..model.runner import ModelRunner, kv_bytes_per_block
from ..model.tokenizer import Tokenizer
from ..request import RequestStatus
from ..sampling_params import SamplingParams
from ..spec.draft import DraftProposer, check_same_vocabulary
from .output_processor import OutputProcessor, RequestOutput
from .protocol import EngineLimits

log = logging.getLogger("justapi.engine")

def check_token_ids(token_ids: list[int], vocab: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (host memory the KV pool may take a share of)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class EngineCore:
    """A loaded model with its scheduler and runner; ``step()`` runs one iteration of continuous batching."""

    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_init: str | None = None, tp_group=None) -> None:
        """``tp_rank`` > 0: a tensor-parallel worker (engine.tp_worker), which loads its shard and runs the runner
        only. With ``config.tp`` > 1, rank 0 starts those workers itself and they form the default group, unless
        ``tp_group`` is given: the sub-group its ranks already form in a disaggregated engine's world."""
        self.config = config
        if config.gpu and not torch.cuda.is_available():
            raise ModelLoadError("--gpu was given but torch sees no CUDA device (torch.cuda.is_available() is False)")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        elif config.tp > 1:  # ranks share the cores (measured: 2 threads per rank on 2 cores, 2.5-4x slower steps)
            import os

            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tp))
        reader = open_gguf(config.model)
        self.model_config = read_model_config(reader, config.model)
        self.tp_workers: list = []  # processes this engine started (--tp alone)
        self.tp_group = tp_group
        self.tp_leader = config.tp > 1 and tp_rank == 0  # broadcasts each step to the other ranks
        plan = comm = None
        if config.tp > 1:
            from ..distributed.tp import TpComm, TpPlan
            from .tp_worker import join_group, start_workers

            plan = TpPlan.make(self.model_config, tp_rank, config.tp)  # a bad --tp fails here, before any process
            if tp_group is None:
                if tp_rank == 0:
                    tp_init, self.tp_workers = start_workers(config)
                join_group(config, tp_rank, tp_init)
            comm = TpComm(plan, self.model_config, tp_group)
        if tp_rank == 0:
            self.tokenizer = Tokenizer(config.model, reader)
            self.chat_template = ChatTemplate(self.tokenizer.chat_template)
        dtype_name = "float32" if config.batch_invariant else config.dtype
        kernels = decode_kernels() if config.cpu_kernels and not config.gpu else None
        self.draft_model = (self._load_draft(reader, dtype_name, kernels) if config.draft_model is not None
                            else None)
        dtype, keep_q4 = resolve_dtype(dtype_name, reader, config.gpu, kernels)
        policy = KernelPolicy.make(dtype, kernels, config.disabled_kernels)
        if tp_rank == 0:
            for line in policy.describe():
                log.info(line)
        select = None
        if plan is not None:
            from ..model.llama import shard_selection

            select = lambda name: shard_selection(name, plan, self.model_config.head_dim)  # noqa: E731
        tensors = load_tensors(reader, config.model, dtype, config.show_progress and tp_rank == 0, keep_q4, select)
        del reader
        self.model = LlamaModel(self.model_config, tensors, config.device, config.batch_invariant, plan, comm,
                                kv_dtype=kv_cache_dtype(config.kv_cache_dtype, dtype, keep_q4), policy=policy,
                                huge_pages=config.huge_pages)
        self.max_model_len = self._max_model_len()
        num_blocks = self._num_blocks()
        if plan is not None:  # every rank's pool has rank 0's size (rank 0 holds the most KV heads)
            from ..distributed.tp import broadcast

            num_blocks = broadcast(num_blocks, tp_group)
        sched_config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_seqs=config.max_seqs,
            max_prefill=config.max_prefill,
            max_decode=config.max_decode,
            chunk_size=config.chunk_size,
            max_model_len=self.max_model_len,
            prefix_cache=config.prefix_cache,
            spec_method=config.speculation,
            gamma=config.gamma or DEFAULT_GAMMA,
            branch=config.branch or DEFAULT_BRANCH,
            spec_max_batch=config.spec_max_batch,
        )
        self.scheduler = (StaticScheduler if config.static_batching else Scheduler)(sched_config)
        proposer = None
        if self.draft_model is not None:
            proposer = DraftProposer(self.draft_model, num_blocks, config.block_size, config.device,
                                     sched_config.branch)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.device, proposer)
        if tp_rank > 0:
            return
        self.outputs = OutputProcessor(self.tokenizer)
        self._seeds = random.Random(config.seed)
        log.info(
            "weights: %.1f MiB; KV cache pool: %d blocks of %d tokens = %d tokens (%.2f GiB); max model length %d",
            self.model.weight_bytes() / 2**20, num_blocks, config.block_size, num_blocks * config.block_size,
            num_blocks * self._kv_bytes_per_block() / 2**30, self.max_model_len,
        )

    def _load_draft(self, target_reader, dtype_name: str, kernels) -> LlamaModel:
        """The --draft-model: same vocabulary as the target (checked first), weights in the target's dtype policy."""
        path = self.config.draft_model
        try:
            reader = open_gguf(path)
            draft_config = read_model_config(reader, path)
        except ModelLoadError as e:
            raise ModelLoadError(f"--draft-model: {e}") from None
        check_same_vocabulary(target_reader, self.config.model, reader, path)
        if draft_config.vocab_size != self.model_config.vocab_size:
            raise ModelLoadError(f"--draft-model {path}: its embedding has {draft_config.vocab_size} rows, the "
                                 f"target's {self.model_config.vocab_size}")
        # the draft sees the target's positions: give its rotary table room for them (a draft trained on a
        # shorter context only drafts worse there; verification keeps the output exact)
        draft_config = dataclasses.replace(
            draft_config, context_length=max(draft_config.context_length, self.model_config.context_length)
        )
        dtype, keep_q4 = resolve_dtype(dtype_name, reader, self.config.gpu, kernels)
        tensors = load_tensors(reader, path, dtype, self.config.show_progress, keep_q4)
        policy = KernelPolicy.make(dtype, kernels, self.config.disabled_kernels)
        log.info("draft model %s: %d layers, hidden %d", path, draft_config.num_layers, draft_config.hidden_size)
        return LlamaModel(draft_config, tensors, self.config.device, self.config.batch_invariant,
                          kv_dtype=kv_cache_dtype(self.config.kv_cache_dtype, dtype, keep_q4), policy=policy,
                          huge_pages=self.config.huge_pages)

    def _kv_bytes_per_block(self) -> int:
        """KV bytes of one block: the target's, plus the draft's own cache at the same block ids."""
        total = kv_bytes_per_block(self.model, self.config.block_size)
        if self.draft_model is not None:
            total += kv_bytes_per_block(self.draft_model, self.config.block_size)
        return total

    def _max_model_len(self) -> int:
        ctx = self.model_config.context_length
        if self.config.max_model_len is None:
            return ctx
        if self.config.max_model_len > ctx:
            raise ValueError(f"--max-model-len {self.config.max_model_len} exceeds the model's context length {ctx}")
        return self.config.max_model_len

    def _num_blocks(self) -> int:
        if self.config.pool_blocks is not None:
            return self.config.pool_blocks
        per_block = self._kv_bytes_per_block()
        if self.config.gpu:
            free, _ = torch.cuda.mem_get_info()
            budget = int(free * 0.8)
        else:
            # tensor-parallel ranks on one host share its memory: each takes its part of the fraction
            budget = int(available_memory_bytes() * self.config.kv_memory_fraction / self.config.tp)
        cap = DEFAULT_MAX_POOL_TOKENS // self.config.block_size
        return max(1, min(budget // per_block, cap))

    # --- requests ---------------------------------------------------------------------------------------------
    def new_seed(self) -> int:
        return self._seeds.getrandbits(62)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError (AdmissionError) for a request that can never be served; its max_tokens. Reads state only."""
        check_token_ids(prompt_token_ids, self.model_config.vocab_size)
        return self.scheduler.check_admissible(len(prompt_token_ids), params.max_tokens)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises AdmissionError (a ValueError) when it can never be served."""
        self.check_request(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self.new_seed()
        req = self.scheduler.add_request(request_id, prompt_token_ids, params, self.tokenizer.eos_token_ids, seed)
        self.outputs.add_request(request_id, prompt_token_ids, req.sampling_params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once."""
        core_out = self.scheduler.abort_request(request_id)
        if core_out is None:
            return None
        report, _ = self.outputs.process(core_out)
        return report

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(self.max_model_len, self.model_config.vocab_size)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """Token ids of a conversation in the model's chat template (ChatTemplateError for a bad one)."""
        return self.chat_template.encode(self.tokenizer, messages, add_generation_prompt)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats_line(self) -> str:
        sched = self.scheduler
        return (f"{len(sched.running)} running, {len(sched.waiting)} waiting, KV blocks {sched.pool.num_used}/"
                f"{sched.pool.num_blocks} used ({sched.num_cached_blocks} cached), {sched.stats.num_preemptions} "
                f"preemptions, {sched.stats.last_step_tokens} tokens last step")

    def health(self) -> tuple[bool, dict]:
        """One process: serving whenever the engine loop runs."""
        return True, {}

    def stats(self) -> SchedulerSnapshot:
        """A frozen copy of the scheduler's state (core.stats), taken on the engine thread."""
        return SchedulerSnapshot.of(self.scheduler)

    def idle(self) -> None:
        """Called by the engine loop while nothing runs."""

    def take_failures(self) -> list[tuple[str, BaseException]]:
        """Requests that failed for a reason outside them (a dead worker); never any in one process."""
        return []

    # --- the loop -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update: one iteration. Returns what each request produced."""
        reports = []
        for core_out in self.step_core():
            report, stopped = self.outputs.process(core_out)
            if stopped:
                self.scheduler.finish_request(core_out.request_id, RequestStatus.FINISHED_STOPPED)
            reports.append(report)
        return reports

    def step_core(self) -> list[EngineCoreOutput]:
        """One iteration without detokenizing: the new token ids of each request (what a worker process sends)."""
        sched = self.scheduler.schedule()
        if sched.empty:
            if sched.finished_request_ids:
                self._execute(sched)  # let the runner drop finished state
            return []
        result = self._execute(sched)
        return self.scheduler.update(sched, result)

    def _execute(self, sched):
        """Run the step here and, with --tp, on every worker: they receive the same (small) SchedulerOutput."""
        if self.tp_leader:
            from ..distributed.tp import broadcast

            broadcast(sched, self.tp_group)
        return self.runner.execute(sched)

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The K/V of ``block_ids`` with every KV head of the model, [layers, 2, kv_heads, blocks, block_size, dim]:
        with --tp, each rank holds some heads, and rank 0 gathers them."""
        if not self.tp_leader:
            return self.runner.export_kv(block_ids)
        from ..distributed.tp import broadcast

        broadcast(("export_kv", list(block_ids)), self.tp_group)
        return self.model.comm.gather_kv(self.runner.export_kv(block_ids))

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        if not self.tp_leader:
            return
        self.tp_leader = False
        if self.tp_workers:
            from .tp_worker import stop_workers

            stop_workers(self.tp_workers)
            self.tp_workers = []
        else:  # the disaggregated engine's sub-group: tell its ranks to leave; the engine owns the processes
            from ..distributed.tp import broadcast

            try:
                broadcast(None, self.tp_group)
            except RuntimeError:
                pass  # a rank is already gone
