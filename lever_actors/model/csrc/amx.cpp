// Weight-only quantized matrix products on AMX tiles, built by model/native.py.
//
// Every output is a fixed sequence of tile products and fused multiply-adds over the inputs
// in order; a row of x takes part in no other row's sums. So a row's result is the same
// whether it is alone in the call or one of 64: verifying a tree equals one-token decoding
// bit for bit, without measuring a row block.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

#include "aten.h"
#include "common.h"
#include "integer_rows.h"
#include "q4k.h"
#include "q4k_tiles.h"

namespace {

using namespace lever;

constexpr int64_t TILE = 16;     // rows of a full tile, 64 bytes each
constexpr int64_t DEPTH = 32;    // inputs per tile product: 16 rows of bf16 pairs
constexpr int64_t AHEAD = 8;     // int4: groups prefetched ahead of the one unpacked
constexpr int64_t CHUNK = 32;    // int8: depths converted at a time (128 KB of bf16 per block)

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: the sums, [sum_rows][sum_bytes]; 4: the left operand, [left_rows][32 bf16];
// 5 and 6: right operands, [16 pairs of inputs][right_bytes]
void configure(int64_t sum_rows, int64_t sum_bytes, int64_t left_rows, int64_t right_bytes) {
  TileConfig config;
  for (int t = 0; t < 4; ++t) {
    config.rows[t] = uint8_t(sum_rows);
    config.bytes_per_row[t] = uint16_t(sum_bytes);
  }
  config.rows[4] = uint8_t(left_rows);
  config.bytes_per_row[4] = 64;
  for (int t = 5; t < 7; ++t) {
    config.rows[t] = TILE;
    config.bytes_per_row[t] = uint16_t(right_bytes);
  }
  _tile_loadconfig(&config);
}

// ---- int4: y = sum over groups of scale * (x . (q - 8)) + zero * sum(x), per output ----

// bf16 of q - 8 for q = 0..15, twice: vpermw's 32-entry table
alignas(64) const uint16_t CENTRED[32] = {
    0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
    0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0};

// One group of torch's CPU int4 packing (byte j of an input's 32: output j low, j + 32 high)
// as four right-hand tiles [16 pairs of inputs][16 outputs] of bf16 (q - 8). vpermw reads a
// word's low 5 bits and the table repeats after 16, so a byte's high nibble needs no mask.
inline void unpack_group(const uint8_t* bytes, uint16_t* panel) {
  const __m512i table = _mm512_load_si512(CENTRED);
  for (int64_t r = 0; r < TILE; ++r) {
    __m256i even = _mm256_loadu_si256((const __m256i*)(bytes + 2 * r * 32));
    __m256i odd = _mm256_loadu_si256((const __m256i*)(bytes + (2 * r + 1) * 32));
    __m256i low = _mm256_unpacklo_epi8(even, odd);   // pairs of outputs 0-7 | 16-23
    __m256i high = _mm256_unpackhi_epi8(even, odd);  // pairs of outputs 8-15 | 24-31
    __m256i halves[2] = {_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31)};
    for (int h = 0; h < 2; ++h) {  // h = 0: outputs 0-15 (and 32-47), h = 1: 16-31 (48-63)
      __m512i words = _mm512_cvtepu8_epi16(halves[h]);
      _mm512_storeu_si512(panel + (h * TILE + r) * 32, _mm512_permutexvar_epi16(words, table));
      __m512i upper = _mm512_srli_epi16(words, 4);
      _mm512_storeu_si512(panel + ((2 + h) * TILE + r) * 32, _mm512_permutexvar_epi16(upper, table));
    }
  }
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& bias) {
  // x [m, k] bf16; packed [n, k / 2] uint8; scales [k / 32, n, 2] bf16 (scale, zero)
  check_int4(x, packed, scales);
  int64_t rows = x.size(0), k = x.size(1), n = packed.size(0), groups = k / GROUP;
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  // Past one tile, rows go in whole tiles, the last padded with zero rows: a short last tile
  // made the tiles be reshaped twice per group, dearer than the padding (the real target's
  // int4 matrices: 1.7 ms at 24 rows against 1.1 at 32). Each row's products stay its own.
  int64_t height = std::min(rows, TILE), padded = (rows + height - 1) / height * height;
  std::vector<uint16_t> tiled;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  if (padded != rows) {
    tiled.assign(padded * k, 0);
    std::memcpy(tiled.data(), xp, rows * k * sizeof(uint16_t));
    xp = tiled.data();
  }
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint32_t* sp = reinterpret_cast<const uint32_t*>(scales.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<float> sums(rows * groups);  // each row's inputs summed per group, in order
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < GROUP; ++i) s += from_bf16(xp[m * k + g * GROUP + i]);
      sums[m * groups + g] = s;
    }
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t panel[4 * TILE * 32];
    alignas(64) float products[TILE * BLOCK_N];
    std::vector<float> acc(rows * BLOCK_N);
    configure(height, 64, height, 64);
    for (int64_t block = begin; block < end; ++block) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const uint8_t* column = pp + block * k * 32;
      for (int64_t g = 0; g < groups; ++g) {
        // weights stream from DRAM: ask for the group AHEAD groups on, on into the next block
        // (a prefetch past the last never faults)
        const uint8_t* ahead = column + (g + AHEAD) * GROUP * 32;
        for (int64_t line = 0; line < GROUP * 32; line += 64) _mm_prefetch((const char*)(ahead + line), _MM_HINT_T0);
        if (g + AHEAD < groups) _mm_prefetch((const char*)(sp + (g + AHEAD) * n + block * BLOCK_N), _MM_HINT_T0);
        unpack_group(column + g * GROUP * 32, panel);
        __m512 scale[4], zero[4];
        for (int t = 0; t < 4; ++t) {
          __m512i sz = _mm512_loadu_si512(sp + g * n + block * BLOCK_N + t * TILE);
          scale[t] = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
          zero[t] = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(int(0xffff0000u))));
        }
        for (int64_t m = 0; m < padded; m += height) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          _tile_loadd(4, xp + m * k + g * GROUP, k * 2);
          _tile_loadd(5, panel, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, panel + TILE * 32, 64);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, panel + 2 * TILE * 32, 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(6, panel + 3 * TILE * 32, 64);
          _tile_dpbf16ps(3, 4, 6);
          _tile_stored(0, products, BLOCK_N * 4);
          _tile_stored(1, products + TILE, BLOCK_N * 4);
          _tile_stored(2, products + 2 * TILE, BLOCK_N * 4);
          _tile_stored(3, products + 3 * TILE, BLOCK_N * 4);
          for (int64_t r = 0; r < std::min(height, rows - m); ++r) {
            __m512 total = _mm512_set1_ps(sums[(m + r) * groups + g]);
            float* a = acc.data() + (m + r) * BLOCK_N;
            for (int t = 0; t < 4; ++t) {
              __m512 v = _mm512_fmadd_ps(scale[t], _mm512_load_ps(products + r * BLOCK_N + t * TILE), _mm512_loadu_ps(a + t * TILE));
              _mm512_storeu_ps(a + t * TILE, _mm512_fmadd_ps(zero[t], total, v));
            }
          }
        }
      }
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < BLOCK_N; ++j) op[m * n + block * BLOCK_N + j] = to_bf16(acc[m * BLOCK_N + j]);
    }
    _tile_release();
  });
  return biased(out, bias);
}

// ---- int8: y = scale * (x . q), per output; the weights are the left operand ----

// A block's 64 rows of int8 weights, inputs [32 d0, 32 d1), as bf16 (exact: |q| <= 127):
// per depth d, four left-hand tiles [64 rows][32 bf16]. Read row by row, each row's next chunk
// asked for into L2 meanwhile: 64 strided streams are more than the hardware prefetcher follows.
inline void int8_chunk(const int8_t* w, int64_t k, int64_t d0, int64_t d1, uint16_t* panel) {
  int64_t ahead = std::min(k, d1 * DEPTH + (d1 - d0) * DEPTH);  // end of the next chunk's bytes
  for (int64_t j = 0; j < BLOCK_N; ++j) {
    for (int64_t at = d1 * DEPTH; at < ahead; at += 64) _mm_prefetch((const char*)(w + j * k + at), _MM_HINT_T1);
    for (int64_t d = d0; d < d1; ++d) {
      __m256i q = _mm256_loadu_si256((const __m256i*)(w + j * k + d * DEPTH));
      __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
      __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
      _mm512_store_si512(panel + ((d - d0) * BLOCK_N + j) * DEPTH, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
  }
}

// sums 0-3 += the slab's four tiles times x's pairs at depth d, columns [m, m + height)
inline void int8_depth(const uint32_t* x, int64_t width, int64_t m, int64_t d, const uint16_t* slab) {
  _tile_loadd(5, x + d * TILE * width + m, width * 4);
  _tile_loadd(4, slab, 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(4, slab + TILE * DEPTH, 64);
  _tile_dpbf16ps(1, 4, 5);
  _tile_loadd(4, slab + 2 * TILE * DEPTH, 64);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(4, slab + 3 * TILE * DEPTH, 64);
  _tile_dpbf16ps(3, 4, 5);
}

at::Tensor int8_linear(const at::Tensor& pairs, int64_t rows, const at::Tensor& weight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  // pairs [k / 2, m] int32: x transposed by pairs of inputs; weight [n, k] int8; scales [n] bf16
  TORCH_CHECK(pairs.dim() == 2 && pairs.scalar_type() == at::kInt && pairs.is_contiguous(), "pairs: [k/2, m] int32");
  check_int8(weight, scales);
  int64_t k = weight.size(1), n = weight.size(0), width = pairs.size(1), depths = k / DEPTH;
  TORCH_CHECK(n % BLOCK_N == 0 && k % DEPTH == 0 && pairs.size(0) * 2 == k && rows <= width, "int8 shape");
  auto out = at::empty({rows, n}, weight.options().dtype(at::kBFloat16));
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(pairs.data_ptr());
  const int8_t* wp = weight.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  int64_t tiles = (rows + TILE - 1) / TILE;
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t, Aligned<uint16_t>> panel(CHUNK * BLOCK_N * DEPTH);
    std::vector<float, Aligned<float>> sums(tiles * BLOCK_N * TILE);  // [tile][64 outputs][16 rows]
    int64_t configured = -1;
    for (int64_t block = begin; block < end; ++block) {
      const int8_t* w = wp + block * BLOCK_N * k;
      for (int64_t d0 = 0; d0 < depths; d0 += CHUNK) {
        int64_t d1 = std::min(depths, d0 + CHUNK);
        int8_chunk(w, k, d0, d1, panel.data());
        for (int64_t m = 0; m < rows; m += TILE) {
          int64_t height = std::min(TILE, rows - m);
          if (height != configured) {  // left: 16 outputs; right and sums: `height` rows of x
            configure(TILE, height * 4, TILE, height * 4);
            configured = height;
          }
          float* s = sums.data() + m / TILE * BLOCK_N * TILE;
          if (d0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {  // float32 out and back: exact, so chunking never changes a sum
            _tile_loadd(0, s, TILE * 4);
            _tile_loadd(1, s + TILE * TILE, TILE * 4);
            _tile_loadd(2, s + 2 * TILE * TILE, TILE * 4);
            _tile_loadd(3, s + 3 * TILE * TILE, TILE * 4);
          }
          for (int64_t d = d0; d < d1; ++d) int8_depth(xp, width, m, d, panel.data() + (d - d0) * BLOCK_N * DEPTH);
          _tile_stored(0, s, TILE * 4);
          _tile_stored(1, s + TILE * TILE, TILE * 4);
          _tile_stored(2, s + 2 * TILE * TILE, TILE * 4);
          _tile_stored(3, s + 3 * TILE * TILE, TILE * 4);
        }
      }
      for (int64_t j = 0; j < BLOCK_N; ++j) {
        float scale = from_bf16(sp[block * BLOCK_N + j]);
        for (int64_t r = 0; r < rows; ++r)
          op[r * n + block * BLOCK_N + j] = to_bf16(scale * sums[(r / TILE * BLOCK_N + j) * TILE + r % TILE]);
      }
    }
    _tile_release();
  });
  return biased(out, bias);
}

bool enable_tiles() {  // Linux grants a process AMX state only on request
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

}  // namespace

TORCH_LIBRARY(lever_amx, m) {
  lever::define_ops(m, &int4_linear, &int8_linear, &lever::q4k_linear_amx);
  m.def("enable_tiles", &enable_tiles);
}
