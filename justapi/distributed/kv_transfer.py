"""KV-cache transfer between worker processes over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

A request's KV leaves a prefill worker as one tensor, [layers, 2, kv_heads, blocks, block_size, head_dim] (every
block of its prompt, all layers: one message, not one per block), a hybrid model's recurrent states after it as a
second (fp32, flat), sent with ``isend`` and received with ``irecv`` under tags unique to the transfer. Both sides
poll their pending transfers between engine steps, so the copy overlaps with the batches the workers keep computing;
a prefill worker frees the blocks once its send completed. A transfer whose peer died fails with an error instead of
hanging: gloo closes the pair.
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

    def __init__(self, request_id: str, peer: int, works: list, tensors: list[torch.Tensor]) -> None:
        self.request_id = request_id
        self.peer = peer
        self.tensors = tensors
        self.tensor = tensors[0]  # the KV
        self.started = time.perf_counter()
        self.seconds = 0.0
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._wait, args=(works,), name=f"kv-{request_id}", daemon=True).start()

    def _wait(self, works: list) -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the worker's loop through done()
            self._error = e
        self.seconds = time.perf_counter() - self.started
        self._done.set()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def done(self) -> bool:
        """True once complete; raises RuntimeError if the transfer failed (the peer went away)."""
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise RuntimeError(str(self._error))
        return True


TAGS_PER_TRANSFER = 2  # the KV's tag, the states' (a transfer's tags are tag * 2 and tag * 2 + 1)


def send_kv(request_id: str, tensors: list[torch.Tensor], dst: int, tag: int) -> Transfer:
    """Send the KV (and a hybrid's states) of a request; ``tag`` numbers the transfer."""
    tensors = [t.contiguous() for t in tensors]
    works = [dist.isend(t, dst, tag=tag * TAGS_PER_TRANSFER + i) for i, t in enumerate(tensors)]
    return Transfer(request_id, dst, works, tensors)


def recv_kv(request_id: str, specs: list[tuple[tuple[int, ...], torch.dtype]], src: int, tag: int,
            device: str) -> Transfer:
    """Receive tensors of (shape, dtype) ``specs`` sent by ``send_kv`` under the same ``tag``."""
    bufs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    works = [dist.irecv(b, src, tag=tag * TAGS_PER_TRANSFER + i) for i, b in enumerate(bufs)]
    return Transfer(request_id, src, works, bufs)
