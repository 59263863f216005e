// GGUF's Q4_K values in our q4k packing times activations rounded to int8 per 256 inputs (as
// llama.cpp's Q8_K), in integers, with AVX2 (or AVX512-VNNI's byte products, common.h).
//
// w = d * sc * q - dmin * m: q in 0..15, a 6-bit scale sc and minimum m per group of 32 inputs,
// a float16 d and dmin per 256. Each 8 outputs' 256 inputs are one record (model/quantized.py,
// `pack_q4k`): per pair of groups and per 4 inputs, 32 bytes of 8 outputs' q, two groups to a
// byte; then the groups' scales and minimums, [group][output]; each record's d and dmin are held
// apart ([n / 8, k / 256, 2, 8] float16).
//
// Per output and block of 256, two sums are exact integers: I = sum over groups of
// sc * (q . q_x) and M = sum over groups of m * sum(q_x). The block then adds to the output in
// one fixed sequence, y = fma(I, x_scale * d, y), then y = fnma(M, x_scale * dmin, y), each
// output in its own lane. A row of x takes part in no other row's sums, so its result is the
// same alone or as one of 64.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <utility>
#include <vector>

#include "common.h"
#include "integer_rows.h"
#include "parallel.h"

namespace lever {

constexpr int64_t Q4K_OUTPUTS = 8, Q4K_RECORD = 1152, Q4K_SCALES = 1024, Q4K_MINIMUMS = 1088;
// rows of x per pass over a record: 4 keeps the tile's sums in AVX2's 16 registers. Two records
// sharing each x quad, 2 rows at a time, ran 1.03-1.3x as long from 4 rows (bench/kernels.py's
// shapes, interleaved in one process), and 8 rows a pass 1.1-1.25x as long at 8 rows. With
// AVX-512's 32 registers 8 rows fit: 16 rows 0.82-0.91 ms against 1.06 at 4 (Zen 4).
#ifdef __AVX512VNNI__
constexpr int64_t Q4K_TILE_ROWS = 8;
#else
constexpr int64_t Q4K_TILE_ROWS = 4;
#endif

// Each row of x's group sums as int16 pairs, groups 2i and 2i + 1 in one 32-bit lane, from the
// exact float sums rounded_rows gives (a group's at most 32 * 127 in size: within int16)
inline std::vector<int32_t> group_sum_pairs(const RoundedRows& xq) {
  std::vector<int32_t> pairs(xq.sum.size() / 2);
  for (size_t i = 0; i < pairs.size(); ++i)
    pairs[i] = int32_t(uint32_t(uint16_t(int32_t(xq.sum[2 * i]))) | uint32_t(int32_t(xq.sum[2 * i + 1])) << 16);
  return pairs;
}

inline __m256i eight_bytes(const uint8_t* p) {  // as int32 lanes
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}

// rows [m0, m0 + R) of x times one record's 8 outputs (its d and dmin at `ds`): y [R][8]. The
// record's q are unpacked once for the R rows.
template <int R>
inline void q4k_tile(const RoundedRows& xq, const int32_t* sum_pairs, int64_t m0, const uint8_t* record0,
                     const uint16_t* ds, int64_t k, float* y) {
  int64_t blocks = k / K_INPUTS;
  const __m256i nibble = _mm256_set1_epi8(15);
  __m256 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* record = record0 + b * Q4K_RECORD;
    __m256i total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_si256();
    const int8_t* x[R];  // each row's block of inputs
    for (int r = 0; r < R; ++r) x[r] = xq.q.data() + (m0 + r) * k + b * K_INPUTS;
    // group 2c + H: the low (H = 0) or high nibbles of the record's pair c
    auto group = [&]<int H>(int c) {
      ByteDots dots[R];  // per output: 32 products of at most 15 * 127 each
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const uint8_t* at = record + (c * 8 + t) * 32;
        if (H == 0 && t % 2 == 0) _mm_prefetch((const char*)at + FETCH_AHEAD, _MM_HINT_T0);
        __m256i v = _mm256_loadu_si256((const __m256i*)at);
        __m256i q = _mm256_and_si256(H ? _mm256_srli_epi16(v, 4) : v, nibble);
        for (int r = 0; r < R; ++r) dots[r].add(q, quad_of(x[r] + (2 * c + H) * GROUP + 4 * t));
      }
      __m256i scales = eight_bytes(record + Q4K_SCALES + (2 * c + H) * 8);
      for (int r = 0; r < R; ++r) total[r] = _mm256_add_epi32(total[r], dots[r].weighted(scales));
    };
    for (int c = 0; c < 4; ++c) {
      group.template operator()<0>(c);
      group.template operator()<1>(c);
    }
    __m256i minimums[4];  // groups 2p | 2p + 1 << 16
    for (int p = 0; p < 4; ++p)
      minimums[p] = _mm256_or_si256(eight_bytes(record + Q4K_MINIMUMS + 2 * p * 8),
                                    _mm256_slli_epi32(eight_bytes(record + Q4K_MINIMUMS + (2 * p + 1) * 8), 16));
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ds + b * 16)));
    __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ds + b * 16 + 8)));
    for (int r = 0; r < R; ++r) {
      const int32_t* pairs = sum_pairs + (m0 + r) * (k / (2 * GROUP)) + b * 4;
      __m256i floor = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) floor = add_pair_products(floor, minimums[p], _mm256_set1_epi32(pairs[p]));
      __m256 x_scale = _mm256_set1_ps(xq.scale[(m0 + r) * blocks + b]);
      out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), _mm256_mul_ps(x_scale, d), out[r]);
      out[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(floor), _mm256_mul_ps(x_scale, dmin), out[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * 8, out[r]);
}

// x [rows, width] bf16 times a q4k matrix: records [tasks, k / 256 * 1152] uint8, ds [tasks,
// k / 256 * 16] float16, where k is `width` rounded up to whole blocks (a last block's inputs
// past `width`, 128 of a matrix of 896 inputs, multiply zeros in x, so their weights never
// count) -> op [rows, tasks * 8] bf16
inline void q4k_product(const uint16_t* x, int64_t rows, int64_t width, const uint8_t* rp, const uint16_t* dp,
                        int64_t tasks, int64_t k, uint16_t* op) {
  if (rows == 0) return;
  int64_t n = tasks * Q4K_OUTPUTS;
  RoundedRows xq = rounded_rows(x, rows, width, K_INPUTS, k);
  std::vector<int32_t> sum_pairs = group_sum_pairs(xq);
  int64_t record_bytes = k / K_INPUTS * Q4K_RECORD, ds_count = k / K_INPUTS * 16;
  parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    float y[Q4K_TILE_ROWS * Q4K_OUTPUTS];
    for (int64_t task = begin; task < end; ++task) {
      const uint8_t* record = rp + task * record_bytes;
      const uint16_t* ds_at = dp + task * ds_count;
      for (int64_t m = 0; m < rows; m += Q4K_TILE_ROWS) {  // the record stays in cache meanwhile
        int64_t count = std::min<int64_t>(rows - m, Q4K_TILE_ROWS);
        [&]<int... R>(std::integer_sequence<int, R...>) {  // the tile for `count` rows
          ((count == R + 1 ? q4k_tile<R + 1>(xq, sum_pairs.data(), m, record, ds_at, k, y) : void()), ...);
        }(std::make_integer_sequence<int, Q4K_TILE_ROWS>());
        for (int64_t r = 0; r < count; ++r)
          for (int64_t o = 0; o < Q4K_OUTPUTS; ++o) op[(m + r) * n + task * Q4K_OUTPUTS + o] = to_bf16(y[r * Q4K_OUTPUTS + o]);
      }
    }
  });
}

}  // namespace lever
