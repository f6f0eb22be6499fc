"""EngineConfig's checks of where its engine runs: worker processes (data-parallel replicas, disaggregated pools)
and the executor that places them (this host's processes or Ray). A mixin: the fields are EngineConfig's."""

from __future__ import annotations

from typing import TYPE_CHECKING

ROUTER_POLICIES = ("prefix", "round-robin")  # core.router.PrefixRouter
DISTRIBUTED_EXECUTORS = ("mp", "ray")  # distributed.launch
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement-group strategies


class WorkerChecks:
    """``_check_executor``, ``_check_data_parallel`` and ``_check_disaggregation``, called by EngineConfig's
    ``__post_init__``, and ``worker_processes``."""

    if TYPE_CHECKING:  # EngineConfig's fields these read
        tp: int
        gpu: bool
        static_batching: bool
        speculation: str | None
        disaggregate: bool
        data_parallel: int | None
        prefill_workers: int | None
        decode_workers: int | None
        prefill_tp: int | None
        decode_tp: int | None
        router: str
        router_prefix_slack: int
        distributed_executor: str
        placement_strategy: str
        max_replicas: int | None
        target_ongoing_requests: float
        upscale_delay: float

    def _check_executor(self) -> None:
        if self.distributed_executor not in DISTRIBUTED_EXECUTORS:
            raise ValueError(f"--distributed-executor must be one of {', '.join(DISTRIBUTED_EXECUTORS)}, not "
                             f"{self.distributed_executor!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"--placement-strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, not "
                             f"{self.placement_strategy!r}")
        if self.max_replicas is not None and (self.distributed_executor != "ray" or self.data_parallel is None
                                              or self.max_replicas < self.data_parallel):
            raise ValueError("--max-replicas autoscales Ray Serve replicas: it needs --data-parallel N (at most "
                             "--max-replicas) and --distributed-executor ray")
        if not self.target_ongoing_requests > 0:
            raise ValueError(f"--target-ongoing-requests must be positive, not {self.target_ongoing_requests!r}")
        if not self.upscale_delay >= 0:
            raise ValueError(f"--upscale-delay must be 0 or more seconds, not {self.upscale_delay!r}")
        if self.distributed_executor != "ray":
            return
        if not (self.worker_processes or self.tp > 1):
            raise ValueError("--distributed-executor ray places worker processes or tensor-parallel ranks: use it "
                             "with --data-parallel, --disaggregate or --tp above 1")
        if self.gpu:
            raise ValueError("--distributed-executor ray reserves CPUs only in this version: drop --gpu")
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError("--distributed-executor ray needs Ray: pip install 'justapi[ray]'") from None

    def _check_data_parallel(self) -> None:
        if self.router not in ROUTER_POLICIES:
            raise ValueError(f"--router must be one of {', '.join(ROUTER_POLICIES)}, not {self.router!r}")
        if not isinstance(self.router_prefix_slack, int) or self.router_prefix_slack < 0:
            raise ValueError(f"--router-prefix-slack must be a non-negative integer, not {self.router_prefix_slack!r}")
        if self.data_parallel is None:
            return
        if not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise ValueError(f"--data-parallel must be a positive integer, not {self.data_parallel!r}")
        if self.disaggregate:
            raise ValueError("--data-parallel and --disaggregate cannot be combined in this version: use "
                             "--prefill-workers / --decode-workers for several workers of each pool")
        if self.static_batching:
            raise ValueError("--data-parallel runs continuous batching on every replica: drop --static-batching")

    @property
    def worker_processes(self) -> bool:
        """Whether the server's engine is worker processes (WorkerPoolEngine): disaggregated pools or replicas."""
        return self.disaggregate or self.data_parallel is not None

    def _check_disaggregation(self) -> None:
        for name in ("prefill_workers", "decode_workers", "prefill_tp", "decode_tp"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if value is None:
                continue
            if not self.disaggregate:
                raise ValueError(f"{flag} needs --disaggregate")
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, not {value!r}")
        if not self.disaggregate:
            return
        if self.static_batching:
            raise ValueError("--disaggregate runs continuous batching on every worker: drop --static-batching")
        if self.speculation is not None:
            raise ValueError("--disaggregate cannot be combined with speculative decoding (--draft-model, "
                             "--spec-method) in this version")
        object.__setattr__(self, "prefill_workers", self.prefill_workers or 1)
        object.__setattr__(self, "decode_workers", self.decode_workers or 1)
        object.__setattr__(self, "prefill_tp", self.prefill_tp or self.tp)
        object.__setattr__(self, "decode_tp", self.decode_tp or self.tp)
