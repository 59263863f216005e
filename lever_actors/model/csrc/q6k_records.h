// GGUF's Q6_K values in records of 8 outputs (the q6kr packing, made in DRAM from a resident
// q6k matrix: model/quantized.py, `q6k_records`) times activations rounded to int8 per 256
// inputs (as llama.cpp's Q8_K), in integers, as q4k.h multiplies Q4_K's.
//
// w = d * sc * (q - 32): q in 0..63, an int8 scale sc per 16 inputs, a float16 d per 256. Each
// 8 outputs' 256 inputs are one record of 1664 bytes, read front to back: per group of 32
// inputs, 208 bytes: q's low nibbles (per 4 inputs t of its first 16, 32 bytes of 8 outputs' 4
// inputs, the second 16's t in the high nibbles), then q's high bit pairs (per 16 inputs, 32
// bytes likewise, input 4t + i's pair at bits 2t), then the two sub-blocks' scales, [sub-block]
// [output]; each record's 8 d are held apart ([n / 8, k / 256, 8] float16). Read out of order
// (planes apart), the reads stalled: one row took 0.45 ms for 1536x8960 against 0.29 so.
//
// One weight vector serves 8 outputs and every row of the tile, where Q6_K's rows (integer_
// rows.h) need an instruction per output: at 32 rows a product costs what q4k's does, not 2.4x.
// Per output and block two sums are exact integers: I = sum over sub-blocks of sc * (q . q_x)
// and F = sum over sub-blocks of sc * sum(q_x); the block adds (I - 32 F) * x_scale * d to the
// output, in one fixed sequence. A row of x takes part in no other row's sums, so its result is
// the same alone or as one of 64.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <immintrin.h>
#include <utility>
#include <vector>

#include "common.h"
#include "integer_rows.h"
#include "q4k.h"

namespace lever {

constexpr int64_t Q6KR_RECORD = 1664, Q6KR_GROUP = 208, Q6KR_HIGH = 128, Q6KR_SCALES = 192;
constexpr int64_t Q6KR_FETCH_AHEAD = 2 * Q6KR_RECORD;  // how far ahead the reads are fetched
#ifdef __AVX512VNNI__
constexpr int Q6KR_QUADS_PER_SUM = 4;  // a sub-block's 16 inputs in int32 lanes
#else
constexpr int Q6KR_QUADS_PER_SUM = 2;  // vpmaddubsw's int16 pairs: 2 * (2 * 63 * 127) at most
#endif

// Each row of x's sums per 16 inputs, sub-blocks 2i and 2i + 1 as int16 pairs in one 32-bit lane
// (a sum is at most 16 * 127 in size)
inline std::vector<int32_t> sub_block_sum_pairs(const RoundedRows& xq, int64_t rows, int64_t k) {
  std::vector<int32_t> pairs(rows * k / 32);
  for (int64_t p = 0; p < int64_t(pairs.size()); ++p) {
    const int8_t* at = xq.q.data() + p * 32;
    int32_t low = 0, high = 0;
    for (int i = 0; i < 16; ++i) low += at[i], high += at[16 + i];
    pairs[p] = int32_t(uint32_t(uint16_t(low)) | uint32_t(high) << 16);
  }
  return pairs;
}

inline __m256i eight_scales(const uint8_t* p) {  // 8 int8 as int32 lanes
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
}

// rows [m0, m0 + R) of x times one record's 8 outputs (their d at `ds`): y [R][8]. The record's
// q are unpacked once for the R rows.
template <int R>
inline void q6kr_tile(const RoundedRows& xq, const int32_t* sum_pairs, int64_t m0, const uint8_t* record0,
                      const uint16_t* ds, int64_t k, float* y) {
  int64_t blocks = k / K_INPUTS;
  const __m256i nibble = _mm256_set1_epi8(15), high_bits = _mm256_set1_epi8(0x30);
  __m256 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* record = record0 + b * Q6KR_RECORD;
    __m256i total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_si256();
    const int8_t* x[R];  // each row's block of inputs
    for (int r = 0; r < R; ++r) x[r] = xq.q.data() + (m0 + r) * k + b * K_INPUTS;
#pragma GCC unroll 8
    for (int G = 0; G < 8; ++G) {
      const uint8_t* group = record + G * Q6KR_GROUP;
      for (int line = 0; line < 4; ++line) _mm_prefetch((const char*)group + Q6KR_FETCH_AHEAD + line * 64, _MM_HINT_T0);
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // sub-block 2G + half: the low or high nibbles
        __m256i h = _mm256_loadu_si256((const __m256i*)(group + Q6KR_HIGH + half * 32));
        __m256i scales = eight_scales(group + Q6KR_SCALES + half * 8);
#pragma GCC unroll 2
        for (int part = 0; part < 4 / Q6KR_QUADS_PER_SUM; ++part) {
          ByteDots dots[R];  // the sub-block's products (or half of them, with AVX2)
#pragma GCC unroll 4
          for (int u = 0; u < Q6KR_QUADS_PER_SUM; ++u) {
            int t = part * Q6KR_QUADS_PER_SUM + u;
            __m256i v = _mm256_loadu_si256((const __m256i*)(group + t * 32));
            __m256i low = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, nibble);
            __m256i high = t < 2 ? _mm256_slli_epi16(h, 4 - 2 * t) : (t == 2 ? h : _mm256_srli_epi16(h, 2));
            __m256i q = _mm256_or_si256(low, _mm256_and_si256(high, high_bits));
            for (int r = 0; r < R; ++r) dots[r].add(q, quad_of(x[r] + G * GROUP + half * 16 + 4 * t));
          }
          for (int r = 0; r < R; ++r) total[r] = _mm256_add_epi32(total[r], dots[r].weighted(scales));
        }
      }
    }
    __m256i pairs_of_scales[8];  // group G's sub-blocks 2G | 2G + 1 << 16, as int16
    for (int G = 0; G < 8; ++G) {
      const uint8_t* scales = record + G * Q6KR_GROUP + Q6KR_SCALES;
      __m256i even = eight_scales(scales), odd = eight_scales(scales + 8);
      pairs_of_scales[G] = _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(odd, 16));
    }
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ds + b * 8)));
    for (int r = 0; r < R; ++r) {
      const int32_t* pairs = sum_pairs + (m0 + r) * (k / 32) + b * 8;
      __m256i floor = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) floor = add_pair_products(floor, pairs_of_scales[s], _mm256_set1_epi32(pairs[s]));
      __m256i sums = _mm256_sub_epi32(total[r], _mm256_slli_epi32(floor, 5));  // I - 32 F
      __m256 x_scale = _mm256_set1_ps(xq.scale[(m0 + r) * blocks + b]);
      out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(x_scale, d), out[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * 8, out[r]);
}

// x [m, k] bf16; records [n / 8, k / 256 * 1664] uint8; ds [n / 8, k / 256 * 8] float16 -> [m, n] bf16
inline at::Tensor q6kr_linear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& ds) {
  check_rows(x);
  TORCH_CHECK(records.scalar_type() == at::kByte && records.is_contiguous(), "records: uint8");
  TORCH_CHECK(ds.scalar_type() == at::kHalf && ds.is_contiguous(), "ds: float16");
  int64_t rows = x.size(0), tasks = records.size(0), n = tasks * Q4K_OUTPUTS, k = x.size(1);
  TORCH_CHECK(k % K_INPUTS == 0 && records.size(1) == k / K_INPUTS * Q6KR_RECORD, "q6kr shape");
  TORCH_CHECK(ds.numel() == tasks * (k / K_INPUTS) * 8, "q6kr shape");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  RoundedRows xq = rounded_rows(x, K_INPUTS);
  std::vector<int32_t> sum_pairs = sub_block_sum_pairs(xq, rows, k);
  const uint8_t* rp = records.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(ds.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  int64_t record_bytes = k / K_INPUTS * Q6KR_RECORD, ds_count = k / K_INPUTS * 8;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    float y[Q4K_TILE_ROWS * Q4K_OUTPUTS];
    for (int64_t task = begin; task < end; ++task) {
      const uint8_t* record = rp + task * record_bytes;
      const uint16_t* ds_at = dp + task * ds_count;
      for (int64_t m = 0; m < rows; m += Q4K_TILE_ROWS) {  // the record stays in cache meanwhile
        int64_t count = std::min<int64_t>(rows - m, Q4K_TILE_ROWS);
        [&]<int... R>(std::integer_sequence<int, R...>) {  // the tile for `count` rows
          ((count == R + 1 ? q6kr_tile<R + 1>(xq, sum_pairs.data(), m, record, ds_at, k, y) : void()), ...);
        }(std::make_integer_sequence<int, Q4K_TILE_ROWS>());
        for (int64_t r = 0; r < count; ++r)
          for (int64_t o = 0; o < Q4K_OUTPUTS; ++o) op[(m + r) * n + task * Q4K_OUTPUTS + o] = to_bf16(y[r * Q4K_OUTPUTS + o]);
      }
    }
  });
  return out;
}

}  // namespace lever
