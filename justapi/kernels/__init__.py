"""The engine's own CPU kernels, compiled from C++ on first use by torch's extension builder and cached.

One module: ``decode_attention`` (paged_attention.cpp), ``add_rms_norm`` and ``rope_write_kv`` (layer_ops.cpp),
``int4_amx_*`` (int4_matmul.cpp: 4-bit weights times batches of rows on AMX tiles, where the CPU has them),
``q_matmul`` (q_matmul.cpp: 4- and 8-bit weights times fp32 rows, rounded to 16 bits, with AVX2 integer products).
``decode_kernels()`` returns it, or None where it cannot be built (no compiler) or is turned off with
``JUSTAPI_KERNELS=0``; callers then take the pure-torch path, which computes the same thing more slowly.
The build runs once per machine (about a minute) and lands in torch's extension cache (``TORCH_EXTENSIONS_DIR``,
by default ~/.cache/torch_extensions).
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("justapi.kernels")

_lock = threading.Lock()
_loaded = False
_module = None


def decode_kernels():
    """The compiled paged decode-attention module, or None (see module docstring)."""
    global _loaded, _module
    with _lock:
        if _loaded:
            return _module
        _loaded = True
        if os.environ.get("JUSTAPI_KERNELS", "1") == "0":
            return None
        try:
            from torch.utils import cpp_extension

            here = os.path.dirname(__file__)
            names = ("paged_attention.cpp", "layer_ops.cpp", "int4_matmul.cpp", "q_matmul.cpp")
            sources = [os.path.join(here, name) for name in names]
            _clear_stale_lock(cpp_extension._get_build_directory("justapi_paged_attention", False))
            _module = cpp_extension.load(
                name="justapi_paged_attention",
                sources=sources,
                # -fopenmp: at::parallel_for is inline OpenMP; without it every call runs on one thread.
                # The module links libgomp by soname, so it shares the one torch has loaded (one thread pool).
                # -ffp-contract=off: no fused multiply-adds where the source has none, so elementwise code rounds
                # exactly as torch's separate ops do (layer_ops.cpp's rotary is bit-identical to the torch path).
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # no compiler, no headers: the torch path still works
            log.warning("C++ decode-attention kernel unavailable, using the torch path: %s", str(e).splitlines()[0])
            _module = None
        return _module


# torch's extension builder waits forever on a lock file that a process killed mid-build leaves behind; a build
# takes about 40 s here, so a lock this old has no builder left
STALE_LOCK_S = 600.0


def _clear_stale_lock(build_dir: str) -> None:
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock: nobody is building
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        try:
            os.remove(lock)
        except OSError:
            pass
