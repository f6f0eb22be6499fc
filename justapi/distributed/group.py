"""Process groups: where tensor-parallel ranks and disaggregated workers meet, and how long a collective may wait.

One rendezvous for every kind of process group: MASTER_ADDR / MASTER_PORT when both are set (env://, as on several
hosts), otherwise a file store in a private directory and gloo's connections on the loopback interface, which no other
host can reach (torch's TCP store listens on every interface, whatever address it is given, and tensor parallelism
passes pickles through the store). One timeout for every group's collectives.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch.distributed as dist

# a collective waits this long for its slowest rank: the first ones run after every rank loaded its weights
GROUP_TIMEOUT_S = 300.0


def rendezvous() -> str | None:
    """The init method the group's processes are given: None for env://, else a file in a new directory only this
    user may read (processes on this host)."""
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return None
    return "file://" + os.path.join(tempfile.mkdtemp(prefix="justapi-group-"), "store")


def describe(init_method: str | None) -> str:
    return init_method or "env:// (MASTER_ADDR/MASTER_PORT)"


def init_process_group(rank: int, world_size: int, init_method: str | None, gpu: bool) -> None:
    """Join the group (gloo on CPU, NCCL on GPU) at ``init_method`` (None: env://); a group on this host alone
    (a file store) connects its ranks over the loopback interface."""
    if init_method is not None and init_method.startswith("file://"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "nccl" if gpu else "gloo", init_method=init_method or "env://", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
