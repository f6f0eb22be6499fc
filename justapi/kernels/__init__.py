"""The engine's own CPU kernels, compiled from C++ when the package is installed (setup.py) and loaded here.

One module: ``decode_attention`` (paged_attention.cpp), ``add_rms_norm``, ``rope_write_kv``, ``silu_mul``,
``argmax_rows`` and ``mask_logits`` (layer_ops.cpp), ``int4_amx_*`` / ``q8_amx_*`` (int4_matmul.cpp: 4- and 8-bit
weights times batches of rows on AMX tiles, where the CPU has them), ``*_dpbf16_matmul`` and ``q8_small_matmul``
(units_avx512.cpp: the same weights on AVX-512 BF16 vectors), ``q_matmul`` (q_matmul.cpp: 4- and 8-bit weights
times fp32 rows, rounded to 16 bits, with AVX2 integer products).
``decode_kernels()`` returns it, or None where it cannot be built (no compiler) or is turned off with
``JUSTAPI_KERNELS=0``; callers then take the pure-torch path, which computes the same thing more slowly.

The installed build (``justapi.kernels._C``) is used where this CPU has every instruction set it was compiled for.
Otherwise (a wheel built elsewhere, an install without a compiler) the same sources are compiled on first use by
torch's extension builder (a few minutes on 2 cores, logged) into its cache (``TORCH_EXTENSIONS_DIR``, by default
~/.cache/torch_extensions), once per machine.

``JUSTAPI_KERNELS_MARCH=ARCH`` (e.g. znver3) compiles them for another CPU instead, into the same cache under a name
of its own: the kernels a Zen 3 runs (AVX2, no AVX-512), measured on a Zen 4 (benchmarks/as_avx2.sh).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time

from .build_spec import FLAGS_FILE, LDFLAGS, MARCH_ENV, SOURCES, cflags, cpu_flags

log = logging.getLogger("justapi.kernels")

_lock = threading.Lock()
_loaded = False
_module = None


def decode_kernels():
    """The compiled kernels module, or None (see module docstring)."""
    global _loaded, _module
    with _lock:
        if not _loaded:
            _loaded = True
            march = os.environ.get(MARCH_ENV, "native")
            if os.environ.get("JUSTAPI_KERNELS", "1") == "0":
                _module = None
            elif march != "native":
                _module = _compiled_here(march)
                if _module is not None:
                    log.warning("C++ kernels built for -march=%s (%s), not for this CPU", march, MARCH_ENV)
            else:
                _module = _installed() or _compiled_here("native")
        return _module


def _installed():
    """The kernels built at install time, where they fit this CPU; else None."""
    here = os.path.dirname(__file__)
    try:
        with open(os.path.join(here, FLAGS_FILE)) as f:
            built_for = set(f.read().split())
    except OSError:
        return None  # not built at install
    missing = built_for - cpu_flags()
    if missing:
        log.warning("the installed C++ kernels were built for a CPU with %s, which this one lacks: compiling them "
                    "for this CPU", " ".join(sorted(missing)[:6]))
        return None
    try:
        import torch  # noqa: F401  the module links torch's libraries, which torch's import loads

        module = importlib.import_module("._C", __name__)
    except ImportError as e:
        log.warning("the installed C++ kernels do not load (%s): compiling them for this CPU", e)
        return None
    log.info("C++ kernels: %s", module.__file__)
    return module


def _compiled_here(march: str):
    """The kernels compiled for ``-march=march`` by torch's extension builder into its cache (once per machine), or
    None."""
    name = "justapi_paged_attention" if march == "native" else "justapi_kernels_" + march.replace("-", "_")
    if not name.replace("_", "").isalnum():
        log.warning("C++ kernels unavailable, using the torch path: %s=%r is not a -march name", MARCH_ENV, march)
        return None
    try:
        from torch.utils import cpp_extension

        here = os.path.dirname(__file__)
        build_dir = cpp_extension._get_build_directory(name, False)
        _clear_stale_lock(build_dir)
        if not os.path.exists(os.path.join(build_dir, name + ".so")):
            log.info("compiling the C++ kernels for -march=%s into %s (once; a few minutes on 2 cores)", march,
                     build_dir)
        started = time.perf_counter()
        module = cpp_extension.load(
            name=name,
            sources=[os.path.join(here, source) for source in SOURCES],
            extra_cflags=list(cflags(march)),
            extra_ldflags=list(LDFLAGS),
            verbose=False,
        )
        if time.perf_counter() - started > 5:
            log.info("C++ kernels compiled in %.0f s", time.perf_counter() - started)
        return module
    except Exception as e:  # no compiler, no headers: the torch path still works
        log.warning("C++ kernels unavailable, using the torch path: %s", str(e).splitlines()[0])
        return None


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
