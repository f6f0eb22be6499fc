#!/usr/bin/env bash
# Run a benchmark as on an AVX2-only CPU (AMD Zen 3) on a bigger x86 one (Zen 4, Xeon): every server it starts
# takes the routes it takes on a Zen 3. The machine is still not a Zen 3 (clock, caches, memory differ), so its
# figures say where the AVX2 routes stand against the peers' AVX2 routes within one run, not what a Zen 3 measures.
#   benchmarks/as_avx2.sh benchmarks/peers_bench.sh [args]      (or bounds.py, kernels_bench.py, ...)
# - torch (JustAPI's and vLLM's): oneDNN without AVX-512 (so no bf16 matmul: JustAPI's --dtype auto computes in
#   fp32, as on a Zen 3), ATen's kernels and MKL's sgemm on AVX2.
# - JustAPI's C++ kernels compiled for -march=znver3 (JUSTAPI_KERNELS_MARCH; into torch's extension cache, once).
# - vLLM loads its AVX2 kernels (vllm._C_AVX2): as_avx2/sitecustomize.py tells its torch there is no AVX-512.
# - llama.cpp's server built for -march=znver3, into $PEERS/build/llama.cpp-znver3 (built here if missing, ~5 min).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STEER=${STEER:-$ROOT/../shared/peers}
source "$STEER/env.sh"
export AS_CPU="AVX2 only (Zen 3's routes)" JUSTAPI_KERNELS_MARCH=znver3 JUSTAPI_AS_AVX2=1
export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
export PYTHONPATH=$ROOT/benchmarks/as_avx2${PYTHONPATH:+:$PYTHONPATH}
B=$PEERS/build/llama.cpp-znver3
export LLAMA_SERVER=$B/bin/llama-server
if [ ! -x "$LLAMA_SERVER" ]; then
  SRC=$(ls -d "$PEERS"/src/llama_cpp_python-*/vendor/llama.cpp | tail -1)  # setup_llama_server.sh's source
  # GGML_NATIVE=OFF: ggml's x86 defaults (SSE4.2, F16C, FMA, BMI2, AVX, AVX2) instead of this CPU's AVX-512
  cmake -S "$SRC" -B "$B" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DCMAKE_C_FLAGS=-march=znver3 \
    -DCMAKE_CXX_FLAGS=-march=znver3 -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > /dev/null
  cmake --build "$B" --config Release -j "$(nproc)" --target llama-server llama-bench > /dev/null
fi
exec "$@"
