// The most multiply-adds a second this CPU's dot-product instructions allow, from registers (no memory): what
// bf16 products (`vdpbf16ps`, the dpbf16 route's) and 8-bit integer products (`vpdpbusd`, AVX-512 VNNI: the kind
// llama.cpp's quantized activations use) could reach at most, to size the integer-activation route before
// building it (issue 28). One multiply-add counts as 2 operations, as `w1_bound.py` counts FLOPs.
//
//   gcc -O2 -march=native -fopenmp benchmarks/dot_peak.c -o /tmp/dot_peak
//   OMP_NUM_THREADS=$(nproc) /tmp/dot_peak
//
// Needs AVX-512 BF16 and VNNI (Zen 4, Sapphire Rapids and later). Twelve independent accumulators per thread cover
// the instructions' latency; the best of 5 passes.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

static const long kIters = 50L * 1000 * 1000;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TWELVE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// 16 fp32 lanes x 2 bf16 pairs = 32 multiply-adds an instruction
static float bf16_loop(long iters) {
  __m512 acc[12];
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_setzero_ps();
  for (long it = 0; it < iters; ++it) {
#define STEP(i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    TWELVE(STEP)
#undef STEP
  }
  float s = 0.f;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

// 16 int32 lanes x 4 byte pairs = 64 multiply-adds an instruction
static int int8_loop(long iters) {
  __m512i acc[12];
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_setzero_si512();
  for (long it = 0; it < iters; ++it) {
#define STEP(i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    TWELVE(STEP)
#undef STEP
  }
  int s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_epi32(acc[i]);
  return s;
}

// operations a second (2 per multiply-add) over all threads, the best of 5 passes
static double rate(int int8, double macs_per_instr) {
  double best = 1e30;
  volatile double sink = 0;
  for (int pass = 0; pass < 5; ++pass) {
    const double t = now();
    double total = 0;
#pragma omp parallel reduction(+ : total)
    total += int8 ? int8_loop(kIters) : bf16_loop(kIters);
    sink += total;
    const double dt = now() - t;
    if (dt < best) best = dt;
  }
  return omp_get_max_threads() * kIters * 12 * macs_per_instr * 2 / best / 1e9;
}

int main(void) {
  printf("%d threads: vdpbf16ps %.0f GFLOP/s, vpdpbusd %.0f GOP/s\n", omp_get_max_threads(), rate(0, 32),
         rate(1, 64));
  return 0;
}
