"""How the C++ kernels are built, in one place for setup.py (at install) and the loader (on first use where the
installed build does not fit this CPU): the sources, the compiler flags, and the CPU flags a build records.

setup.py imports this file by path, so it depends on nothing but the standard library.
"""

from __future__ import annotations

SOURCES = ("bindings.cpp", "paged_attention.cpp", "layer_ops.cpp", "int4_matmul.cpp", "units_avx512.cpp",
           "q_matmul.cpp", "prefill_attention.cpp", "recurrent.cpp", "sampling.cpp",
           "decode_step.cpp")
# -fopenmp: at::parallel_for is inline OpenMP; without it every call runs on one thread. The module links libgomp by
# soname, so it shares the one torch has loaded (one thread pool). -ffp-contract=off: no fused multiply-adds where
# the source has none, so elementwise code rounds exactly as torch's separate ops do (layer_ops.cpp's rotary is
# bit-identical to the torch path). -march=native: compiled for this CPU, as llama.cpp builds.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
# another CPU's build on this one (e.g. znver3: a Zen 3's AVX2 paths, measured on a Zen 4), compiled on first use
MARCH_ENV = "JUSTAPI_KERNELS_MARCH"
FLAGS_FILE = "_C.cpu_flags"  # beside the built module: the instruction sets of the CPU it was compiled for
_ISA_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "popcnt", "vaes", "vpclmul", "gfni", "adx", "sha")


def cflags(march: str = "native") -> tuple[str, ...]:
    """The compiler flags for ``-march=march``."""
    return tuple(f"-march={march}" if flag == "-march=native" else flag for flag in CFLAGS)


def cpu_flags() -> set[str]:
    """Instruction-set flags of this CPU (from /proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return {flag for flag in line.partition(":")[2].split() if flag.startswith(_ISA_PREFIXES)}
