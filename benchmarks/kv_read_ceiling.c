// What the decode-attention kernel could read at most here: GB/s of a plain AVX-512 sum over blocks of the paged KV
// cache's size taken in random order, as a decode step reads one (sequence, KV head)'s blocks, with the next blocks
// prefetched into L2 as the kernel does (kernels/paged_attention.cpp, `kAhead`), against one sequential stream.
// A bf16 block of 16 tokens at head size 64 is 2 KiB; 32 and 64 tokens a block would be 4 and 8 KiB; an 8-bit
// cache's block of 16 tokens would be 1 KiB (plus its scales).
//
//   gcc -O2 -march=native -fopenmp benchmarks/kv_read_ceiling.c -o /tmp/kv_read_ceiling
//   OMP_NUM_THREADS=$(nproc) /tmp/kv_read_ceiling
//
// Needs AVX-512 (the kernel's AVX2 path reads the same way; this probe has no AVX2 build). A 3 GiB buffer on
// transparent huge pages, 256 MiB read a pass (about a loaded SmolLM2 decode step's K/V), the best of 7 passes.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static const size_t kBuffer = (size_t)3 << 30;
static const size_t kReadPerPass = (size_t)256 << 20;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// GB/s over `count` blocks of `block` bytes at `order`, block i + `ahead` prefetched while block i is summed
static double random_blocks(const char* buf, const size_t* order, size_t count, size_t block, size_t ahead) {
  double best = 1e30;
  volatile float sink = 0.f;
  for (int pass = 0; pass < 7; ++pass) {
    const double t = now();
    float total = 0.f;
#pragma omp parallel reduction(+ : total)
    {
      __m512 acc = _mm512_setzero_ps();
#pragma omp for schedule(static)
      for (size_t i = 0; i < count; ++i) {
        const char* p = buf + order[i] * block;
        const char* next = ahead && i + ahead < count ? buf + order[i + ahead] * block : NULL;
        for (size_t off = 0; off < block; off += 64) {
          if (next) _mm_prefetch(next + off, _MM_HINT_T1);
          acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(p + off)));
        }
      }
      total += _mm512_reduce_add_ps(acc);
    }
    sink += total;
    const double dt = now() - t;
    if (dt < best) best = dt;
  }
  return count * block / best / 1e9;
}

int main(void) {
  char* buf = aligned_alloc((size_t)1 << 21, kBuffer);
  if (!buf) return perror("aligned_alloc"), 1;
  madvise(buf, kBuffer, MADV_HUGEPAGE);
  memset(buf, 1, kBuffer);
  printf("%d threads; GB/s reading %zu MiB a pass in random blocks (rows: block size; columns: blocks prefetched "
         "ahead)\n", omp_get_max_threads(), kReadPerPass >> 20);
  const size_t aheads[] = {0, 1, 2, 4, 8};
  printf("%10s", "block");
  for (size_t a = 0; a < 5; ++a) printf("%8zu", aheads[a]);
  printf("\n");
  srand(1);
  for (size_t block = 1024; block <= 65536; block *= 2) {
    const size_t count = kReadPerPass / block, blocks = kBuffer / block;
    size_t* order = malloc(count * sizeof(size_t));
    for (size_t i = 0; i < count; ++i) order[i] = ((size_t)rand() * RAND_MAX + rand()) % blocks;
    printf("%8zu B", block);
    for (size_t a = 0; a < 5; ++a) printf("%8.1f", random_blocks(buf, order, count, block, aheads[a]));
    printf("\n");
    free(order);
  }
  // in order: 64 KiB blocks one after another, each thread streaming its contiguous share
  const size_t count = kReadPerPass / 65536;
  size_t* order = malloc(count * sizeof(size_t));
  for (size_t i = 0; i < count; ++i) order[i] = i;
  printf("in order %.1f GB/s\n", random_blocks(buf, order, count, 65536, 0));
  free(order);
  return 0;
}
