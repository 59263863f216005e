// GGUF's Q4_K values in our q4k packing (q4k.h) times many rows of x on AMX's int8 tiles: the
// same integers as q4k.h's vector kernel, so the same bf16 results bit for bit, whichever
// kernel a row's call takes.
//
// q4k_tile sums I = sum over groups of sc * (q . x) per output and block. Here each weight is
// first multiplied by its group's scale, w = sc * q (at most 63 * 15 = 945), and split into
// bytes, w = lo + 256 * hi: then I = (lo . x) + 256 * (hi . x) over the block's 256 inputs,
// two exact int32 tile products of 16 rows of x (left, signed) by 16 outputs (right,
// unsigned). A record's 32-byte chunk of 8 outputs by 4 inputs is already the right
// operand's row layout, so two records side by side make the 16 outputs. The block's
// minimum term and its two float steps then follow as in q4k_tile, in the same order.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "aten.h"
#include "common.h"
#include "integer_rows.h"
#include "q4k.h"

namespace lever {

constexpr int64_t Q4K_TILE_OUTPUTS = 16;  // two records
constexpr int64_t Q4K_TILE_X_ROWS = 16;   // a full tile of x's rows
// from this many rows the tiles are the faster (1.3-1.55x at 16 rows: docs/benchmarks.md, "Kernels")
constexpr int64_t Q4K_FEWEST_TILED_ROWS = 16;

// tiles 0, 1: a block's sums of lo and hi [16 rows of x][16 outputs] int32; 2, 3: x [16 rows]
// [64 inputs]; 4-7: lo and hi [16 quads of inputs][16 outputs x 4]
inline void configure_q4k_tiles() {
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;  // palette
  for (int t = 0; t < 8; ++t) {
    config[16 + 2 * t] = 64;  // bytes per row
    config[48 + t] = 16;      // rows
  }
  _tile_loadconfig(config);
}

// the right tiles of two records (`first` and the next, `record_bytes` apart), scaled and split:
// lo, hi [k / 64][16 quads of inputs][64] bytes, tile c of a block its groups 2c and 2c + 1
inline void unpack_q4k_pair(const uint8_t* first, int64_t record_bytes, int64_t blocks, uint8_t* lo, uint8_t* hi) {
  const __m512i nibble = _mm512_set1_epi8(15), low_bytes = _mm512_set1_epi16(0xff);
  alignas(64) uint8_t order[64];
  for (int j = 0; j < 64; ++j) order[j] = uint8_t(j / 4);
  const __m512i spread = _mm512_load_si512(order);  // byte j <- byte j / 4 of its lane: output j / 4's scale
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* a = first + b * Q4K_RECORD;
    const uint8_t* z = a + record_bytes;
    for (int g = 0; g < 8; ++g) {
      __m128i sixteen = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(a + Q4K_SCALES + g * 8)),
                                           _mm_loadl_epi64((const __m128i*)(z + Q4K_SCALES + g * 8)));
      __m512i scale = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(sixteen), spread);
      for (int t = 0; t < 8; ++t) {
        int64_t at = (g / 2 * 8 + t) * 32;
        __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + at))),
                                       _mm256_loadu_si256((const __m256i*)(z + at)), 1);
        __m512i q = _mm512_and_si512(g % 2 ? _mm512_srli_epi16(v, 4) : v, nibble);
        __m512i even = _mm512_mullo_epi16(_mm512_and_si512(q, low_bytes), _mm512_and_si512(scale, low_bytes));
        __m512i odd = _mm512_mullo_epi16(_mm512_srli_epi16(q, 8), _mm512_srli_epi16(scale, 8));
        int64_t row = ((b * 8 + g) * 8 + t) * 64;
        _mm512_store_si512(lo + row, _mm512_or_si512(_mm512_and_si512(even, low_bytes), _mm512_slli_epi16(odd, 8)));
        _mm512_store_si512(hi + row, _mm512_or_si512(_mm512_srli_epi16(even, 8),
                                                     _mm512_slli_epi16(_mm512_srli_epi16(odd, 8), 8)));
      }
    }
  }
}

inline __m512i sixteen_bytes(const uint8_t* first, const uint8_t* second) {  // 8 + 8, as int32 lanes
  __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)first), _mm_loadl_epi64((const __m128i*)second));
  return _mm512_cvtepu8_epi32(both);
}

// x [m, in] bf16 (m >= Q4K_FEWEST_TILED_ROWS) times a q4k matrix whose records pair up, as
// q4k_linear's arguments -> [m, n] bf16
inline at::Tensor q4k_tiled_linear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& ds,
                                   const std::optional<at::Tensor>& bias) {
  int64_t rows = x.size(0), tasks = records.size(0), n = tasks * Q4K_OUTPUTS;
  int64_t k = records.size(1) / Q4K_RECORD * K_INPUTS, blocks = k / K_INPUTS;
  auto out = at::empty({rows, n}, x.options());
  RoundedRows xq = rounded_rows(x, K_INPUTS, k);
  int64_t padded = (rows + Q4K_TILE_X_ROWS - 1) / Q4K_TILE_X_ROWS * Q4K_TILE_X_ROWS;
  xq.q.resize(padded * k, 0);  // zero rows fill the last tile; their results are dropped
  std::vector<int32_t> sum_pairs = group_sum_pairs(xq);
  const uint8_t* rp = records.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(ds.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  int64_t record_bytes = blocks * Q4K_RECORD, ds_count = blocks * 16;
  at::parallel_for(0, tasks / 2, 1, [&](int64_t begin, int64_t end) {
    configure_q4k_tiles();
    std::vector<uint8_t, Aligned<uint8_t>> lo(k * Q4K_TILE_OUTPUTS), hi(k * Q4K_TILE_OUTPUTS);
    alignas(64) int32_t sums[2][Q4K_TILE_X_ROWS][Q4K_TILE_OUTPUTS];
    alignas(64) float y[Q4K_TILE_X_ROWS][Q4K_TILE_OUTPUTS];
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint8_t* record = rp + 2 * pair * record_bytes;
      const uint16_t* ds0 = dp + 2 * pair * ds_count;
      const uint16_t* ds1 = ds0 + ds_count;
      unpack_q4k_pair(record, record_bytes, blocks, lo.data(), hi.data());
      for (int64_t m = 0; m < padded; m += Q4K_TILE_X_ROWS) {
        int64_t height = std::min(Q4K_TILE_X_ROWS, rows - m);
        std::memset(y, 0, sizeof(y));
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* a = record + b * Q4K_RECORD;
          const uint8_t* z = a + record_bytes;
          const int8_t* xb = xq.q.data() + m * k + b * K_INPUTS;
          int64_t wb = b * K_INPUTS * Q4K_TILE_OUTPUTS;
          _tile_zero(0);
          _tile_zero(1);
          for (int c = 0; c < 4; c += 2) {  // two tiles of 64 inputs at a time
            _tile_loadd(2, xb + c * 64, k);
            _tile_loadd(3, xb + (c + 1) * 64, k);
            _tile_loadd(4, lo.data() + wb + c * 1024, 64);
            _tile_loadd(5, hi.data() + wb + c * 1024, 64);
            _tile_loadd(6, lo.data() + wb + (c + 1) * 1024, 64);
            _tile_loadd(7, hi.data() + wb + (c + 1) * 1024, 64);
            _tile_dpbsud(0, 2, 4);
            _tile_dpbsud(1, 2, 5);
            _tile_dpbsud(0, 3, 6);
            _tile_dpbsud(1, 3, 7);
          }
          _tile_stored(0, sums[0], 64);
          _tile_stored(1, sums[1], 64);
          __m512i minimums[4];  // groups 2p | 2p + 1 << 16, as q4k_tile pairs them
          for (int p = 0; p < 4; ++p)
            minimums[p] = _mm512_or_si512(sixteen_bytes(a + Q4K_MINIMUMS + 2 * p * 8, z + Q4K_MINIMUMS + 2 * p * 8),
                                          _mm512_slli_epi32(sixteen_bytes(a + Q4K_MINIMUMS + (2 * p + 1) * 8,
                                                                          z + Q4K_MINIMUMS + (2 * p + 1) * 8),
                                                            16));
          __m512 d = _mm512_cvtph_ps(_mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(ds0 + b * 16))),
              _mm_loadu_si128((const __m128i*)(ds1 + b * 16)), 1));
          __m512 dmin = _mm512_cvtph_ps(_mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(ds0 + b * 16 + 8))),
              _mm_loadu_si128((const __m128i*)(ds1 + b * 16 + 8)), 1));
          for (int64_t r = 0; r < height; ++r) {
            __m512i total = _mm512_add_epi32(_mm512_load_si512(sums[0][r]), _mm512_slli_epi32(_mm512_load_si512(sums[1][r]), 8));
            const int32_t* pairs = sum_pairs.data() + (m + r) * (k / (2 * GROUP)) + b * 4;
            __m512i floor = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p) floor = _mm512_dpwssd_epi32(floor, minimums[p], _mm512_set1_epi32(pairs[p]));
            __m512 x_scale = _mm512_set1_ps(xq.scale[(m + r) * blocks + b]);
            __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(x_scale, d), _mm512_load_ps(y[r]));
            _mm512_store_ps(y[r], _mm512_fnmadd_ps(_mm512_cvtepi32_ps(floor), _mm512_mul_ps(x_scale, dmin), v));
          }
        }
        for (int64_t r = 0; r < height; ++r)
          for (int64_t o = 0; o < Q4K_TILE_OUTPUTS; ++o) op[(m + r) * n + pair * Q4K_TILE_OUTPUTS + o] = to_bf16(y[r][o]);
      }
    }
    _tile_release();
  });
  return biased(out, bias);
}

// q4k_linear on tiles where there are rows enough and the records pair up, else on vectors
inline at::Tensor q4k_linear_amx(const at::Tensor& x, const at::Tensor& records, const at::Tensor& ds,
                                 const std::optional<at::Tensor>& bias) {
  if (x.dim() == 2 && x.size(0) >= Q4K_FEWEST_TILED_ROWS && records.size(0) % 2 == 0) {
    check_q4k(x, records, ds);
    return q4k_tiled_linear(x, records, ds, bias);
  }
  return q4k_linear(x, records, ds, bias);
}

}  // namespace lever
