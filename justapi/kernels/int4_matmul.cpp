// x @ w.T for a 4-bit weight (GGUF Q4_0/Q4_1: groups of 32 along the input dimension, a scale and a zero each)
// and a batch of 6 or more bf16 rows (batched decode, prefill chunks), on the CPU's AMX tiles: each group of weights
// is read once, as 4 bits, expanded to bf16 in L1 and multiplied with every row of the batch, where torch's int4
// kernel expands it again for every row and the bf16 path reads a 16-bit copy of the weight (4x the bytes) from
// memory. Up to 64 rows (batched decode) go in one pass over each block of 16 outputs (four accumulator tiles, one
// per 16 rows). More rows (prefill chunks) go in passes of 32 over pairs of blocks (2 x 2 accumulator tiles): the
// pair's groups are expanded once into a buffer that every pass reads, and each tile of x loaded from L2 feeds two
// products instead of one (0.76-0.96x the time of 64-row passes over one block at 256-512 rows).
//
// Weight values are those of Q4Unpacked.dequantize(): w = (q - 8) * scale + zero in fp32 (scale and zero are
// bf16-exact), rounded to bf16 — the same values as the bf16 copy that oneDNN multiplies. Products accumulate in
// fp32 in the tiles, over the input dimension in order, and the result is rounded to bf16 once.
//
// The weights come in the units of q_units.h (4-bit, or 8-bit with Q8Unit's formats); the driver, matmul_amx, takes
// the unit format as a template parameter. The packers (any CPU) are here; units_avx512.cpp multiplies the same
// units on CPUs with AVX-512 BF16 but no AMX.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "q_units.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define JUSTAPI_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using justapi::bf16_bits;
using justapi::kUnitBytes;
using justapi::q8_unit_bytes;
using justapi::Q4Unit;
using justapi::Q8Unit;

constexpr int64_t kMaxRows = 64;  // rows per pass over the weight: four 16-row accumulator tiles
constexpr int64_t kPairRows = 32;  // rows per pass over a pair of blocks: 2 x 2 accumulator tiles

#ifdef JUSTAPI_AMX
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12 at -O3 may treat the ldtilecfg builtin as reading only part of its 64 bytes and drop the zeroing of the
// unused tiles' fields (seen after an unrelated change: garbage there, and a #GP at the load); a compiler barrier
// keeps every store to the config
inline void load_tile_config(TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Linux hands out the AMX tile state only to processes that ask for it (once per process)
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// accumulator tile t (tmm0..3) -> rows of out (bf16, round to nearest even)
inline void store_rows(const float* c, int64_t rows, uint16_t* out, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ld),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + 16 * r)));
}

// the tiles of one pass of `rows` rows: tmm0..3 accumulators [16 rows x 16 outputs] fp32 (the last one partial when
// rows % 16 > 0); tmm4: 16 rows of x, tmm5: the last rows % 16 rows of x (32 inputs, bf16); tmm6: the expanded
// weights [16 input pairs x 16 outputs x 2]
inline void configure_tiles(int64_t rows) {
  const int64_t full = rows / 16, rem = rows % 16, tiles = full + (rem > 0);
  TileConfig cfg;
  for (int64_t t = 0; t < tiles; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t < full ? 16 : rem);
    cfg.colsb[t] = 64;
  }
  if (full > 0) cfg.rows[4] = 16, cfg.colsb[4] = 64;
  if (rem > 0) cfg.rows[5] = static_cast<uint8_t>(rem), cfg.colsb[5] = 64;
  cfg.rows[6] = 16, cfg.colsb[6] = 64;
  load_tile_config(cfg);
}

// one pass of up to kMaxRows rows of x (from xm) over one block of 16 outputs, into o (row stride n); b_tile(g)
// gives group g's weights expanded (a B tile of 16 x 64 bytes). Tiles configured by configure_tiles(rows).
template <typename BTile>
inline void pass_block(const uint16_t* xm, int64_t rows, int64_t k, int64_t groups, BTile b_tile, uint16_t* o,
                       int64_t n, float* c_tile) {
  const int64_t full = rows / 16, rem = rows % 16, tiles = full + (rem > 0);
  const int64_t x_stride = k * 2;
  _tile_zero(0);
  if (tiles > 1) _tile_zero(1);
  if (tiles > 2) _tile_zero(2);
  if (tiles > 3) _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(6, b_tile(g), 64);
    const uint16_t* xg = xm + g * 32;
// tile t of x: rows 16t.. of this pass; the last one is partial when rem > 0
#define JUSTAPI_ROW_TILE(t)                                   \
  if (tiles > t) {                                            \
    if (t < full) {                                           \
      _tile_loadd(4, xg + 16 * t * k, x_stride);              \
      _tile_dpbf16ps(t, 4, 6);                                \
    } else {                                                  \
      _tile_loadd(5, xg + 16 * t * k, x_stride);              \
      _tile_dpbf16ps(t, 5, 6);                                \
    }                                                         \
  }
    JUSTAPI_ROW_TILE(0)
    JUSTAPI_ROW_TILE(1)
    JUSTAPI_ROW_TILE(2)
    JUSTAPI_ROW_TILE(3)
#undef JUSTAPI_ROW_TILE
  }
  for (int64_t t = 0; t < tiles; ++t) {
    switch (t) {
      case 0: _tile_stored(0, c_tile, 64); break;
      case 1: _tile_stored(1, c_tile, 64); break;
      case 2: _tile_stored(2, c_tile, 64); break;
      default: _tile_stored(3, c_tile, 64); break;
    }
    store_rows(c_tile, t < full ? 16 : rem, o + 16 * t * n, n);
  }
}

// the tiles of a pass over a pair of blocks, `rows` <= kPairRows rows: tmm0/tmm1 accumulate rows 0..15 for the
// first/second block, tmm2/tmm3 rows 16..31 (only when rows > 16); tmm4/tmm5 the two row tiles of x; tmm6/tmm7 the
// two blocks' expanded weights. Each x tile loaded feeds two products, and each weight tile two: per product 1 tile
// load, against 1.25 for pass_block's 4 x 1 (the loads of x, from L2, bound a pass over a prefill chunk).
inline void configure_pair_tiles(int64_t rows) {
  const int64_t top = std::min<int64_t>(rows, 16), bottom = rows - top;
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(top), cfg.colsb[t] = 64;
  if (bottom > 0)
    for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(bottom), cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}

// one pass of up to kPairRows rows of x (from xm) over blocks blk and blk + 1 (expanded into e0 and e1), into o
// (row stride n). Each accumulator sums the groups in order, as pass_block's do: the same products, bit for bit.
inline void pass_block_pair(const uint16_t* xm, int64_t rows, int64_t k, int64_t groups, const uint16_t* e0,
                            const uint16_t* e1, uint16_t* o, int64_t n, float* c_tile) {
  const int64_t top = std::min<int64_t>(rows, 16), bottom = rows - top;
  const int64_t x_stride = k * 2;
  _tile_zero(0);
  _tile_zero(1);
  if (bottom > 0) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(6, e0 + g * 16 * 32, 64);
    _tile_loadd(7, e1 + g * 16 * 32, 64);
    _tile_loadd(4, xm + g * 32, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (bottom > 0) {
      _tile_loadd(5, xm + 16 * k + g * 32, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c_tile, 64);
  store_rows(c_tile, top, o, n);
  _tile_stored(1, c_tile, 64);
  store_rows(c_tile, top, o + 16, n);
  if (bottom > 0) {
    _tile_stored(2, c_tile, 64);
    store_rows(c_tile, bottom, o + 16 * n, n);
    _tile_stored(3, c_tile, 64);
    store_rows(c_tile, bottom, o + 16 * n + 16, n);
  }
}

template <typename Unit>
void matmul_amx(const uint16_t* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, uint16_t* out) {
  const int64_t groups = k / 32, blocks = n / 16;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float c_tile[16 * 16];
    if (m <= kMaxRows) {  // one pass (batched decode): each group expanded just before its tile load
      alignas(64) uint16_t b_tiles[2][16 * 32];  // alternated, so that expanding the next group need not wait
                                                  // for the tile load of the last one
      configure_tiles(m);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const uint8_t* units = packed + blk * groups * Unit::kBytes;
        pass_block(x, m, k, groups, [&](int64_t g) {
          uint16_t* b = b_tiles[g & 1];
          Unit::expand(units + g * Unit::kBytes, b);
          return b;
        }, out + blk * 16, n, c_tile);
      }
    } else {  // several passes (prefill chunks): blocks in pairs, each pair's groups expanded once
      std::vector<uint16_t> buffer(2 * groups * 16 * 32 + 32);  // 2 * k * 32 bytes: 36-96 KiB at SmolLM2's widths
      uint16_t* expanded = buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) / 2 % 32);  // 64-byte aligned
      int64_t configured = 0;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const uint8_t* units = packed + blk * groups * Unit::kBytes;
        const bool pair = blk + 1 < b1;  // this block and the next: 2 x 2 accumulator tiles
        for (int64_t g = 0; g < groups * (pair ? 2 : 1); ++g) Unit::expand(units + g * Unit::kBytes, expanded + g * 16 * 32);
        if (pair) {
          for (int64_t m0 = 0; m0 < m; m0 += kPairRows) {
            const int64_t rows = std::min(kPairRows, m - m0);
            if (-rows != configured) configure_pair_tiles(rows), configured = -rows;
            pass_block_pair(x + m0 * k, rows, k, groups, expanded, expanded + groups * 16 * 32,
                            out + m0 * n + blk * 16, n, c_tile);
          }
          ++blk;
          continue;
        }
        for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
          const int64_t rows = std::min(kMaxRows, m - m0);
          if (rows != configured) configure_tiles(rows), configured = rows;
          pass_block(x + m0 * k, rows, k, groups, [&](int64_t g) { return expanded + g * 16 * 32; },
                     out + m0 * n + blk * 16, n, c_tile);
        }
      }
    }
    _tile_release();
  });
}

#endif

}  // namespace

bool int4_amx_available() {
#ifdef JUSTAPI_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// q [n, k] uint8 in 0..15, scale/zero [n, k / 32] fp32 (bf16-exact) -> the packed layout above, uint8
torch::Tensor int4_amx_pack(torch::Tensor q, torch::Tensor scale, torch::Tensor zero) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kUInt8, "int4_amx_pack: q [out, in] uint8 expected");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0, "int4_amx_pack: out must be a multiple of 16 and in of 32");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && zero.scalar_type() == torch::kFloat32 &&
                  scale.size(0) == n && scale.size(1) == k / 32 && zero.sizes() == scale.sizes(),
              "int4_amx_pack: scale and zero [out, in / 32] fp32 expected");
  q = q.contiguous();
  scale = scale.contiguous();
  zero = zero.contiguous();
  const int64_t groups = k / 32, blocks = n / 16;
  auto packed = torch::empty({blocks * groups * kUnitBytes}, torch::kUInt8);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t blk = 0; blk < blocks; ++blk)
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* unit = dst + (blk * groups + g) * kUnitBytes;
      for (int r = 0; r < 16; ++r)
        for (int b = 0; b < 16; ++b) {
          const int64_t in = g * 32 + 2 * r + b % 2;
          const uint8_t lo = qp[(blk * 16 + b / 2) * k + in] & 0x0F;
          const uint8_t hi = qp[(blk * 16 + 8 + b / 2) * k + in] & 0x0F;
          unit[16 * r + b] = static_cast<uint8_t>(lo | (hi << 4));
        }
      uint16_t sz[32];
      for (int o = 0; o < 16; ++o) {
        sz[o] = bf16_bits(sp[(blk * 16 + o) * groups + g]);
        sz[16 + o] = bf16_bits(zp[(blk * 16 + o) * groups + g]);
      }
      std::memcpy(unit + 256, sz, sizeof(sz));
    }
  return packed;
}

// x [rows, in] bf16 times a weight packed in units of `unit_bytes` (the format `Unit`), out_features -> [rows, out] bf16
template <typename Unit>
torch::Tensor amx_matmul(const char* name, int64_t unit_bytes, torch::Tensor x, torch::Tensor packed,
                         int64_t out_features) {
  x = justapi::checked_rows(name, x, packed, out_features, unit_bytes, torch::kBFloat16);
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  auto out = torch::empty({m, n}, x.options());
#ifdef JUSTAPI_AMX
  TORCH_CHECK(amx_permitted(), name, ": AMX is not available");
  if (m > 0)
    matmul_amx<Unit>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m, k,
                     packed.data_ptr<uint8_t>(), n, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
#else
  TORCH_CHECK(false, name, ": built without AMX");
#endif
  return out;
}

// x [rows, in] bf16, packed from int4_amx_pack, out_features -> [rows, out] bf16
torch::Tensor int4_amx_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  return amx_matmul<Q4Unit>("int4_amx_matmul", kUnitBytes, x, packed, out_features);
}

// q [n, k] int8, scale [n, k / group] fp32, zero (optional) like scale, group 32 or 16 -> the 8-bit units of
// Q8Unit<32 / group, zero>, uint8
torch::Tensor q8_amx_pack(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> zero, int64_t group) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8, "q8_amx_pack: q [out, in] int8 expected");
  TORCH_CHECK(group == 32 || group == 16, "q8_amx_pack: groups of 32 or 16 inputs expected");
  const int64_t n = q.size(0), k = q.size(1), sets = 32 / group;
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0, "q8_amx_pack: out must be a multiple of 16 and in of 32");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.dim() == 2 && scale.size(0) == n &&
                  scale.size(1) == k / group, "q8_amx_pack: scale [out, in / group] fp32 expected");
  const bool has_zero = zero.has_value();
  TORCH_CHECK(!has_zero || (zero->scalar_type() == torch::kFloat32 && zero->sizes() == scale.sizes()),
              "q8_amx_pack: zero shaped and typed as scale expected");
  q = q.contiguous();
  scale = scale.contiguous();
  const torch::Tensor z = has_zero ? zero->contiguous() : scale;
  const int64_t groups = k / 32, blocks = n / 16, unit_bytes = q8_unit_bytes(sets, has_zero);
  auto packed = torch::empty({blocks * groups * unit_bytes}, torch::kUInt8);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* unit = dst + (blk * groups + g) * unit_bytes;
        for (int r = 0; r < 16; ++r)
          for (int b = 0; b < 32; ++b)
            unit[32 * r + b] = static_cast<uint8_t>(qp[(blk * 16 + b / 2) * k + g * 32 + 2 * r + b % 2]);
        float* terms = reinterpret_cast<float*>(unit + 512);
        for (int64_t set = 0; set < sets; ++set)
          for (int o = 0; o < 16; ++o) {
            const int64_t at = (blk * 16 + o) * (k / group) + g * sets + set;
            terms[16 * set + o] = sp[at];
            if (has_zero) terms[16 * (sets + set) + o] = zp[at];
          }
      }
  });
  return packed;
}

// x [rows, in] bf16, packed from q8_amx_pack (with this group and zeros or not), out_features -> [rows, out] bf16
torch::Tensor q8_amx_matmul(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t group,
                            bool has_zero) {
  TORCH_CHECK(group == 32 || group == 16, "q8_amx_matmul: groups of 32 or 16 inputs expected");
  return justapi::with_q8_unit(group, has_zero, [&](auto unit) {
    using Unit = decltype(unit);
    return amx_matmul<Unit>("q8_amx_matmul", Unit::kBytes, x, packed, out_features);
  });
}
