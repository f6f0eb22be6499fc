"""KV-cache transfer between worker processes over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

A request's KV leaves a prefill worker as one tensor, [layers, 2, kv_heads, blocks, block_size, head_dim] (every
block of its prompt, all layers: one message, not one per block), sent with ``isend`` and received with
``irecv`` under a tag unique to the transfer. Both sides poll their pending transfers between engine steps, so
the copy overlaps with the batches the workers keep computing; a prefill worker frees the blocks once its send
completed. A transfer whose peer died fails with an error instead of hanging: gloo closes the pair.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist


class Transfer:
    """One request's KV in flight. A helper thread waits on the transfer (gloo completes point-to-point work only
    inside ``wait()``; polling ``is_completed()`` alone never sees it finish), so the worker's loop keeps stepping
    its batch and polls ``done()`` between steps."""

    def __init__(self, request_id: str, peer: int, work, tensor: torch.Tensor) -> None:
        self.request_id = request_id
        self.peer = peer
        self.tensor = tensor
        self.started = time.perf_counter()
        self.seconds = 0.0
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._wait, args=(work,), name=f"kv-{request_id}", daemon=True).start()

    def _wait(self, work) -> None:
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the worker's loop through done()
            self._error = e
        self.seconds = time.perf_counter() - self.started
        self._done.set()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def done(self) -> bool:
        """True once complete; raises RuntimeError if the transfer failed (the peer went away)."""
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise RuntimeError(str(self._error))
        return True


def send_kv(request_id: str, kv: torch.Tensor, dst: int, tag: int) -> Transfer:
    return Transfer(request_id, dst, dist.isend(kv.contiguous(), dst, tag=tag), kv)


def recv_kv(request_id: str, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int, device: str) -> Transfer:
    buf = torch.empty(shape, dtype=dtype, device=device)
    return Transfer(request_id, src, dist.irecv(buf, src, tag=tag), buf)
