"""Imported by every Python process that benchmarks/as_avx2.sh starts (it puts this folder on PYTHONPATH): torch's
CPU probes answer that there is no AVX-512 and no AMX, so vLLM's CPU build loads its AVX2 kernels
(``vllm._C_AVX2``) and picks its attention and linear paths as on a Zen 3. JustAPI reads none of these probes."""

import os

if os.environ.get("JUSTAPI_AS_AVX2") == "1":
    try:
        import torch.cpu
    except ImportError:  # a Python without torch (a client): nothing to tell
        pass
    else:
        for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                      "_is_amx_tile_supported", "_is_amx_fp16_supported"):
            if hasattr(torch.cpu, probe):
                setattr(torch.cpu, probe, lambda: False)
