"""Long-lived CPU tensors (the KV cache, packed weights) on transparent huge pages where Linux offers them.

Decode attention reads each sequence's K/V blocks (2 KiB per head at SmolLM2's sizes) scattered through a pool of
hundreds of MB: on 4 KiB pages nearly every block read costs a TLB miss and a page walk. On 2 MiB pages the
decode-attention kernel took 0.93x the time, a whole decode step 2-4% less (docs/benchmarks-archive.md). Nothing else
changes: the values and the layouts are the same, only the pages under them.

How: one over-allocated uint8 tensor per group of tensors (torch owns the memory), its 2 MiB-aligned interior
advised ``MADV_HUGEPAGE`` before anything touches it, the tensors carved out of it as views. Where the kernel has
transparent huge pages off (or this is not Linux), the tensors are allocated as usual.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_ALIGN = 64  # each tensor in an arena starts on a cache line
_PAGE = 4096
_PREFAULT_CHUNK = 4 << 20


@functools.cache
def available() -> bool:
    """Linux with transparent huge pages on for ``madvise`` (or always)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def untouched_zeros(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` zeros that no one has written: anonymous memory, zero by definition and
    faulted in page by page on first use. A KV pool of gigabytes is then ready at once instead of after seconds of
    zero-filling (a quarter of 24 GiB took ~8 s), and costs memory only where blocks are used."""
    if nbytes < HUGE_PAGE:
        return torch.zeros(nbytes, dtype=torch.uint8)
    # private: Python's default for anonymous maps is MAP_SHARED, which Linux backs with shmem, where transparent
    # huge pages follow shmem_enabled (usually "never") and MADV_HUGEPAGE does nothing
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.uint8)  # the tensor keeps the mapping alive


def prefault(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Fault the memory under untouched ``tensors`` in now, in a thread of its own, so that serving never does.

    A page's first write costs a fault, zeroing and (with huge pages) finding 2 MiB of contiguous memory; on the
    VMs measured here also the host backing the guest's page: ~2 s per GB, against 0.2 s to write memory already
    there. A KV pool's blocks are first written while serving (the prefix cache keeps finished requests' blocks, so
    fresh ones keep being taken until the pool is full): W1 ran 9-17% slower than with the pool zero-filled up
    front. The kernel populates the range (MADV_POPULATE_WRITE) while the model loads and requests run; a page
    touched meanwhile just faults as before. Where the kernel lacks the call, nothing is done."""
    spans = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors})
    if not spans or not sys.platform.startswith("linux"):
        return None

    def populate() -> None:
        for start, nbytes in spans:
            lo = start - start % _PAGE
            # a chunk at a time: the call holds the process's memory-map lock, which loading the model's tensors
            # (mmap) needs too; one call over gigabytes made start-up wait for it (22 s instead of 6), 32 MiB
            # chunks still added ~2 s
            for at in range(lo, start + nbytes, _PREFAULT_CHUNK):
                if _madvise()(at, min(_PREFAULT_CHUNK, start + nbytes - at), _MADV_POPULATE_WRITE) != 0:
                    return  # an older kernel (EINVAL) or memory refused: pages fault in on first use instead

    thread = threading.Thread(target=populate, name="justapi-prefault", daemon=True)
    thread.start()
    return thread


def _arena(nbytes: int) -> torch.Tensor | None:
    """An untouched uint8 CPU tensor of ``nbytes`` zeros, 2 MiB-aligned and advised onto huge pages; None if
    refused."""
    raw = untouched_zeros(nbytes + HUGE_PAGE)
    start = -raw.data_ptr() % HUGE_PAGE
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    if start + length > raw.numel():  # the last huge page would run past the allocation: advise whole pages only
        length -= HUGE_PAGE
    if length > 0 and _madvise()(raw.data_ptr() + start, length, _MADV_HUGEPAGE) != 0:
        return None
    return raw[start : start + nbytes]


def _layout(sizes: list[int]) -> tuple[torch.Tensor | None, list[int]]:
    """An arena for tensors of ``sizes`` bytes (None where huge pages are unavailable or it would not fill one) and
    each tensor's offset in it."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    return (_arena(total) if available() and total >= HUGE_PAGE else None), offsets


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype, huge: bool = True) -> list[torch.Tensor]:
    """Zero-filled CPU tensors of ``shapes`` (untouched_zeros), all in one huge-page arena where available and
    ``huge``, else each in its own memory."""
    sizes = [torch.Size(s).numel() * dtype.itemsize for s in shapes]
    arena, offsets = _layout(sizes) if huge else (None, [])
    if arena is None:
        return [untouched_zeros(n).view(dtype).view(s) for s, n in zip(shapes, sizes)]
    return [arena[o : o + n].view(dtype).view(s) for s, o, n in zip(shapes, offsets, sizes)]


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors`` (same dtypes, shapes and values) in one huge-page arena; the tensors
    themselves where huge pages are unavailable."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    arena, offsets = _layout(sizes)
    if arena is None:
        return list(tensors)
    out = []
    for t, o, n in zip(tensors, offsets, sizes):
        view = arena[o : o + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out
