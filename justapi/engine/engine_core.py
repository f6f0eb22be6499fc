"""EngineCore: loads the model and wires scheduler, runner and output processing into one ``step()``."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..config import DEFAULT_BRANCH, DEFAULT_GAMMA, DEFAULT_MAX_POOL_TOKENS, EngineConfig, SchedulerConfig
from ..core.limits import RequestLimits
from ..core.outputs import EngineCoreOutput
from ..core.scheduler import Scheduler
from ..core.batching import StaticBatching
from ..core.stats import SchedulerSnapshot
from ..model.gguf_loader import ModelLoadError
from ..model.state_cache import state_bytes_per_seq
from ..request import RequestStatus
from ..sampling_params import SamplingParams
from .disk_tier import open_disk_tier, spill
from .executor import make_executor, set_threads
from .model_front import ModelFront
from .output_processor import OutputProcessor, RequestOutput
from .step_log import StepWork

log = logging.getLogger("justapi.engine")

ROLES = ("replica", "prefill", "decode")  # which steps an engine takes (EngineCore's role)
PREFILL_SAMPLE_TOKENS = 64  # a step with this many prompt tokens measures a prompt token's cost (the disk tier's)


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


def scheduler_config(config: EngineConfig, num_blocks: int, max_model_len: int, role: str = "replica",
                     encoder: bool = False, hybrid: bool = False, state_snapshots: int = 0) -> SchedulerConfig:
    """The scheduler's settings from the engine's flags and what the loaded model and its pool decided (also what
    the planner's simulation runs: plan.simulator)."""
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_seqs=config.max_seqs,
        max_prefill=config.max_prefill,
        max_decode=config.max_decode,
        chunk_size=config.chunk_size,
        max_model_len=max_model_len,
        # an encoder's states depend on the tokens after them: no prefix of one prompt is another's
        prefix_cache=config.prefix_cache and not encoder,
        state_snapshots=state_snapshots,
        whole_prompts=encoder,
        hand_off_after_prefill=role == "prefill",
        holds_states=hybrid,
        spec_method=config.speculation,
        gamma=config.gamma or DEFAULT_GAMMA,
        branch=config.branch or DEFAULT_BRANCH,
        spec_max_batch=config.spec_max_batch,
        policy=config.scheduling_policy,
        priority_aging_s=config.priority_aging,
        user_weights=tuple(config.weights_by_user().items()),
    )


class EngineCore(ModelFront):
    """A loaded model with its scheduler and executor; ``step()`` runs one iteration of continuous batching."""

    def __init__(self, config: EngineConfig, tp_group=None, role: str = "replica") -> None:
        """``tp_group``: with ``config.tp`` > 1, the sub-group this engine's ranks already form in a disaggregated
        engine's world; None: the executor starts the ranks itself (engine.executor). ``role`` (ROLES): a replica
        serves requests whole; a prefill worker hands each off after its first token, keeping its prompt's blocks
        until they are sent; a decode worker also admits requests whose prompt was computed elsewhere."""
        if role not in ROLES:
            raise ValueError(f"an engine's role is one of {', '.join(ROLES)}, not {role!r}")
        if config.gpu and not torch.cuda.is_available():
            raise ModelLoadError("--gpu was given but torch sees no CUDA device (torch.cuda.is_available() is False)")
        set_threads(config)
        super().__init__(config)
        self.executor = make_executor(config, self.model_config, tp_group)
        num_blocks = self.executor.size_pool(self._num_blocks(), config.branch or DEFAULT_BRANCH)
        self.role = role
        self.store = open_disk_tier(config, self.model_config, self.model, self.runner)
        mc = self.model_config
        self.scheduler = Scheduler(scheduler_config(config, num_blocks, self.max_model_len, role, mc.is_encoder,
                                                    mc.is_hybrid, self.executor.rank.state_snapshots()),
                                   StaticBatching() if config.static_batching else None, self.store)
        self.outputs = OutputProcessor(self.tokenizer)
        self.last_step: StepWork | None = None  # what the latest step() computed and where its time went
        self._core_times = (0.0, 0.0, 0.0)  # step_core's schedule, execute, update seconds
        log.info(
            "weights: %.1f MiB; KV cache pool: %d blocks of %d tokens = %d tokens (%.2f GiB); max model length %d",
            self.model.weight_bytes() / 2**20, num_blocks, config.block_size, num_blocks * config.block_size,
            num_blocks * self.executor.rank.kv_bytes_per_block() / 2**30, self.max_model_len,
        )
        if self.model_config.is_hybrid:
            rank = self.executor.rank
            log.info("state cache: %d slots and %d prefix-cache snapshots of %.2f MiB (%d recurrent layers), "
                     "%.2f GiB", config.max_seqs, rank.state_snapshots(), state_bytes_per_seq(self.model) / 2**20,
                     sum(self.model_config.recurrent_layers), rank.state_bytes() / 2**30)

    @property
    def model(self):
        """Rank 0's model (all of it, or its tensor-parallel shard)."""
        return self.executor.rank.model

    @property
    def runner(self):
        """Rank 0's runner (its KV cache)."""
        return self.executor.rank.runner

    def _num_blocks(self) -> int:
        if self.config.pool_blocks is not None:
            return self.config.pool_blocks
        per_block = self.executor.rank.kv_bytes_per_block()
        cap = DEFAULT_MAX_POOL_TOKENS // self.config.block_size
        if per_block == 0:  # an encoder: its blocks hold nothing, only count tokens
            return cap
        if self.config.gpu:
            free, _ = torch.cuda.mem_get_info()
            budget = int(free * 0.8)
        else:
            # tensor-parallel ranks on one host share its memory: each takes its part
            whole = self.config.kv_memory_bytes() or available_memory_bytes() * self.config.kv_memory_fraction
            budget = int(whole / self.config.tp)
        states = self.executor.rank.state_bytes()  # a hybrid's state cache comes out of the same budget
        if states and states >= budget:
            raise ModelLoadError(f"the state cache of --max-seqs {self.config.max_seqs} sequences takes "
                                 f"{states / 2**30:.2f} GiB, the KV memory budget is {budget / 2**30:.2f} GiB: "
                                 "lower --max-seqs")
        return max(1, min((budget - states) // per_block, cap))

    # --- requests ---------------------------------------------------------------------------------------------
    @property
    def request_limits(self) -> RequestLimits:
        return self.scheduler.limits

    def queue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue an admitted request (ModelFront.admit), its outputs detokenized by step()."""
        assert params.seed is not None, "queue() takes admitted params: ModelFront.admit sets the seed"
        req = self.scheduler.add_request(request_id, prompt_token_ids, params, self.tokenizer.eos_token_ids,
                                         params.seed)
        self.outputs.add_request(request_id, prompt_token_ids, req.sampling_params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once."""
        core_out = self.scheduler.abort_request(request_id)
        if core_out is None:
            return None
        report, _ = self.outputs.process(core_out)
        return report

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

    def shared_prefixes(self, limit: int) -> list[tuple[tuple[int, ...], int]]:
        cache = self.scheduler.cache
        return cache.shared_prefixes(limit) if cache is not None else []

    def health(self) -> tuple[bool, dict]:
        """One process: serving whenever the engine loop runs."""
        return True, {}

    def stats(self) -> SchedulerSnapshot:
        """A frozen copy of the scheduler's state (core.stats), taken on the engine thread."""
        snap = SchedulerSnapshot.of(self.scheduler)
        states = self.runner.state_cache
        if states is None:
            return snap
        # each running request holds a slot (the runner hears of finished ones with the next step)
        return dataclasses.replace(snap, state_slots_total=states.num_slots, state_slots_used=snap.num_running,
                                   state_cache_bytes=states.nbytes)

    def idle(self) -> None:
        """Called by the engine loop while nothing runs."""

    def take_failures(self) -> list[tuple[str, BaseException]]:
        """Requests that failed for a reason outside them (a dead worker); never any in one process."""
        return []

    # --- the loop -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update, detokenize: one iteration. Returns what each request produced."""
        core_outs = self.step_core()
        t0 = time.perf_counter()
        reports = []
        for core_out in core_outs:
            report, ended = self.outputs.process_safely(core_out)
            if ended:  # a stop string, or its text failed: the scheduler frees it
                self.scheduler.finish_request(core_out.request_id, RequestStatus.FINISHED_STOPPED)
            reports.append(report)
        self.last_step = self._step_work(time.perf_counter() - t0, reports)
        return reports

    def _step_work(self, detokenize_s: float, reports: list[RequestOutput]) -> StepWork:
        sched = self.scheduler
        stats, cache = sched.stats, sched.cache
        return StepWork(*self._core_times, detokenize_s, stats.last_step_tokens, stats.last_step_prefill_tokens,
                        stats.last_step_decodes, tuple(sched.record.cells), tuple(sched.record.preempted),
                        (*(r.request_id for r in reports if r.finished), *sched.record.aborted), sched.kv.occupancy(),
                        cache.hits if cache is not None else 0, cache.misses if cache is not None else 0)

    def step_core(self) -> list[EngineCoreOutput]:
        """One iteration without detokenizing: the new token ids of each request (what a worker process sends).
        Requests past their deadline end first, with what they have. Keeps the seconds its schedule, execute and
        update took for ``last_step``."""
        t0 = time.perf_counter()
        expired = self.scheduler.expire()
        sched = self.scheduler.schedule()
        self._spill()  # blocks a preemption cached, before this step may reuse them
        t1 = time.perf_counter()
        if sched.empty:
            if sched.finished_request_ids:
                self._execute(sched)  # let the runner drop finished state
            self._core_times = (t1 - t0, time.perf_counter() - t1, 0.0)
            return expired
        result = self._execute(sched)
        t2 = time.perf_counter()
        outs = self.scheduler.update(sched, result)
        self._spill()  # blocks computed prompts and finished requests cached
        self._core_times = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        stats = self.scheduler.stats
        if self.store is not None and stats.last_step_prefill_tokens >= PREFILL_SAMPLE_TOKENS:
            self.store.note_prefill(t2 - t1, stats.last_step_tokens)  # what a token costs, mostly prompt tokens
        return expired + outs

    def _spill(self) -> None:
        """Queue for the disk tier the blocks the prefix cache gained that it does not hold: their K/V copied now,
        while no step has written over them, and written by its own thread."""
        spills = self.scheduler.kv.take_spills()
        if not spills:
            return
        assert self.store is not None  # only a disk tier's KvBlocks records spills
        spills = spills[: self.store.room(len(spills))]  # what the writer's queue takes (the rest is counted)
        if spills:
            spill(self.store, self.export_kv([block for block, _, _ in spills]), spills)

    def _execute(self, sched):
        """Run the step on every rank (the executor sends other ranks the same small SchedulerOutput)."""
        return self.executor.execute(sched)

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The K/V of ``block_ids`` with every KV head of the model, [layers, 2, kv_heads, blocks, block_size, dim]:
        with --tp, each rank holds some heads, and rank 0 gathers them."""
        return self.executor.export_kv(block_ids)

    # --- a worker's steps (engine.worker_loop): requests the front already checked, hand-offs, KV in and out ---
    def queue_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int) -> None:
        """Queue a request its front already checked and defaulted; its outputs leave as token ids (step_core)."""
        self.scheduler.add_request(request_id, prompt_token_ids, params, self.tokenizer.eos_token_ids, seed)

    def drop_request(self, request_id: str) -> None:
        """Abort a queued request (or a hand-off not yet sent) and free its blocks at once."""
        self.scheduler.abort_request(request_id)

    @property
    def handed_off(self) -> set[str]:
        """A prefill worker's requests whose prompt is computed, waiting for their KV to be sent."""
        return set(self.scheduler.handoffs)

    def handoff_kv(self, request_id: str) -> torch.Tensor | None:
        """A handed-off request's prompt KV (export_kv), or None where it was aborted meanwhile or is not here."""
        req = self.scheduler.handoffs.get(request_id)
        if req is None:
            return None
        return self.export_kv(req.block_ids[: -(-req.num_prompt_tokens // self.scheduler.block_size)])

    def release_handoff(self, request_id: str) -> None:
        """Its KV was sent (or failed to be): the prompt's blocks go to the prefix cache."""
        self.scheduler.release_handoff(request_id)

    def admit_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
                        seed: int, kv: torch.Tensor, num_cached_tokens: int, state: torch.Tensor | None = None) -> None:
        """A decode worker's request computed elsewhere, straight into decoding with its prompt's KV (and a hybrid's
        recurrent states) copied in; ValueError where it can never fit."""
        self.scheduler.add_prefilled_request(request_id, prompt_token_ids, first_token, params,
                                             self.tokenizer.eos_token_ids, seed,
                                             kv if state is None else (kv, state), num_cached_tokens)

    def handoff_state(self, request_id: str) -> torch.Tensor | None:
        """A handed-off hybrid request's recurrent states (flat, fp32; its slot is held until its KV is sent), or
        None for a model without any."""
        states = self.runner.state_cache
        return None if states is None else states.export(request_id)

    def state_specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of a hybrid's states in a KV transfer (none for other models)."""
        per_seq = state_bytes_per_seq(self.model)
        return [((per_seq // 4,), torch.float32)] if per_seq else []

    def last_step_shape(self) -> tuple[int, int]:
        """The latest step's prefill tokens and decode rows (what its time is fitted by: core.admission)."""
        stats = self.scheduler.stats
        return stats.last_step_prefill_tokens, stats.last_step_decodes

    def load(self) -> dict:
        """What routing and admission read of this engine: free blocks (cached ones can be evicted), queues, the
        prefix cache's hits, the prompt tokens left to prefill, the requests decoding."""
        sched = self.scheduler
        cache = sched.cache
        return dict(
            free_blocks=sched.pool.num_free + sched.num_cached_blocks, running=len(sched.running),
            waiting=len(sched.waiting), cache_hits=cache.hits if cache is not None else 0,
            cache_misses=cache.misses if cache is not None else 0, cached_blocks=sched.num_cached_blocks,
            prefill_backlog=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                                for r in (*sched.waiting, *sched.running)),
            num_decoding=sum(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running),
            disk_hits=sched.kv.disk_hits, disk=self.store.snapshot() if self.store is not None else None)

    def integrity(self) -> tuple[str | None, dict]:
        """The scheduler's integrity check (its failure, or None) and the counts a test reads once idle."""
        sched = self.scheduler
        try:
            sched.check_integrity()
            problem = None
        except AssertionError as e:
            problem = f"integrity check failed: {e}"
        held = sum(len(r.block_ids) for r in (*sched.running, *sched.handoffs.values()))
        return problem, dict(
            running=len(sched.running), waiting=len(sched.waiting), handoffs=len(sched.handoffs),
            blocks_held_by_requests=held, free_blocks=sched.pool.num_free, cached_blocks=sched.num_cached_blocks,
            num_blocks=sched.pool.num_blocks)

    def close(self) -> None:
        """Write what the disk tier has queued; stop the executor's other ranks, if any."""
        if self.store is not None:
            self.store.close()
        self.executor.close()
