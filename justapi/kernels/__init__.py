"""The engine's own CPU kernels, compiled from C++ on first use by torch's extension builder and cached.

``decode_kernels()`` returns the compiled module, or None where it cannot be built (no compiler) or is turned off
with ``JUSTAPI_KERNELS=0``; callers then take the pure-torch path, which computes the same thing more slowly.
The build runs once per machine (about a minute) and lands in torch's extension cache (``TORCH_EXTENSIONS_DIR``,
by default ~/.cache/torch_extensions).
"""

from __future__ import annotations

import logging
import os
import threading

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

            src = os.path.join(os.path.dirname(__file__), "paged_attention.cpp")
            _module = cpp_extension.load(
                name="justapi_paged_attention",
                sources=[src],
                extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
                verbose=False,
            )
        except Exception as e:  # no compiler, no headers: the torch path still works
            log.warning("C++ decode-attention kernel unavailable, using the torch path: %s", str(e).splitlines()[0])
            _module = None
        return _module
