// The int4 packing's products with AVX2 (csrc/avx2.cpp's torch op, csrc/plain.cpp's function):
// y = sum over groups of x's scale * (scale * (q_x . q) + (zero - 8 * scale) * sum(q_x)).
#pragma once

#include <algorithm>
#include <cstdint>
#include <immintrin.h>
#include <vector>

#include "common.h"
#include "integer_rows.h"
#include "parallel.h"

namespace lever {

constexpr int64_t INT4_LANES = 8;  // floats per vector

// q_x . q is exact in integers: vpmaddubsw multiplies 32 pairs of bytes at once. A group's
// weights are regrouped so that each 32-bit lane holds one output's q for four consecutive
// inputs; 8 lanes of 8 such vectors cover the block's 64 outputs, in the order `output` gives.

// The block's output at position p of the regrouped order (vector p / 8, lane p % 8)
constexpr int64_t output(int64_t p) {
  int64_t vector = p / 8, lane = p % 8;
  return (vector / 4) * 32 + (lane < 4 ? 0 : 16) + (vector % 4) * 4 + (lane & 3);
}

// Inputs 4t..4t+3 of a group in the packing (32 bytes each) as 8 vectors of u8 quads
inline void regroup_quad(const uint8_t* bytes, __m256i* v) {
  const __m256i nibble = _mm256_set1_epi8(15);
  __m256i b[4];
  for (int i = 0; i < 4; ++i) b[i] = _mm256_loadu_si256((const __m256i*)(bytes + i * 32));
  for (int h = 0; h < 2; ++h) {  // low nibbles: outputs 0-31; high: 32-63
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_and_si256(h ? _mm256_srli_epi16(b[i], 4) : b[i], nibble);
    __m256i a = _mm256_unpacklo_epi8(q[0], q[1]), c = _mm256_unpacklo_epi8(q[2], q[3]);
    __m256i e = _mm256_unpackhi_epi8(q[0], q[1]), f = _mm256_unpackhi_epi8(q[2], q[3]);
    v[h * 4 + 0] = _mm256_unpacklo_epi16(a, c);
    v[h * 4 + 1] = _mm256_unpackhi_epi16(a, c);
    v[h * 4 + 2] = _mm256_unpacklo_epi16(e, f);
    v[h * 4 + 3] = _mm256_unpackhi_epi16(e, f);
  }
}

// A group's scales and zeros (zero - 8 * scale) for the block's 64 outputs, in the regrouped order
inline void group_scales(const uint32_t* sz, __m256* scale, __m256* zero) {
  __m256 s[8], z[8];
  for (int t = 0; t < 8; ++t) {
    __m256i v = _mm256_loadu_si256((const __m256i*)(sz + t * INT4_LANES));
    s[t] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    __m256 raw = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
    z[t] = _mm256_fmadd_ps(_mm256_set1_ps(-8.0f), s[t], raw);
  }
  for (int h = 0; h < 8; h += 4) {
    scale[h + 0] = _mm256_permute2f128_ps(s[h], s[h + 2], 0x20);
    scale[h + 1] = _mm256_permute2f128_ps(s[h], s[h + 2], 0x31);
    scale[h + 2] = _mm256_permute2f128_ps(s[h + 1], s[h + 3], 0x20);
    scale[h + 3] = _mm256_permute2f128_ps(s[h + 1], s[h + 3], 0x31);
    zero[h + 0] = _mm256_permute2f128_ps(z[h], z[h + 2], 0x20);
    zero[h + 1] = _mm256_permute2f128_ps(z[h], z[h + 2], 0x31);
    zero[h + 2] = _mm256_permute2f128_ps(z[h + 1], z[h + 3], 0x20);
    zero[h + 3] = _mm256_permute2f128_ps(z[h + 1], z[h + 3], 0x31);
  }
}

// acc [64] += x_scale * (scale * products + zero * x_sum): a group's sums folded in; products
// are int16 pairs of each output, at most 16 * 15 * 127 in size, so none overflowed
inline void fold_group(float* acc, const __m256i* products, const __m256* scale, const __m256* zero,
                       float x_scale, float x_sum) {
  __m256 xs = _mm256_set1_ps(x_scale), total = _mm256_set1_ps(x_sum);
  for (int t = 0; t < 8; ++t) {
    __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(products[t], _mm256_set1_epi16(1)));
    __m256 group = _mm256_fmadd_ps(scale[t], dot, _mm256_mul_ps(zero[t], total));
    _mm256_storeu_ps(acc + t * INT4_LANES, _mm256_fmadd_ps(xs, group, _mm256_loadu_ps(acc + t * INT4_LANES)));
  }
}

// x [rows, k] bf16; pp [n, k / 2] uint8, the packing; sp [k / 32, n] (scale, zero) bf16 pairs
// -> op [rows, n] bf16
inline void int4_product(const uint16_t* x, int64_t rows, int64_t k, const uint8_t* pp, const uint32_t* sp, int64_t n,
                         uint16_t* op) {
  if (rows == 0) return;
  int64_t groups = k / GROUP;
  RoundedRows xq = rounded_rows(x, rows, k);
  parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
    alignas(32) __m256i panel[8][8];  // a group regrouped: [quad][vector]
    std::vector<float> acc(rows * BLOCK_N);
    for (int64_t block = begin; block < end; ++block) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const uint8_t* column = pp + block * k * 32;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* bytes = column + g * GROUP * 32;
        __m256 scale[8], zero[8];
        group_scales(sp + g * n + block * BLOCK_N, scale, zero);
        if (rows == 1) {  // regrouped in registers, used once
          __m256i p[8], v[8];
          for (int t = 0; t < 8; ++t) p[t] = _mm256_setzero_si256();
          for (int t = 0; t < 8; ++t) {
            regroup_quad(bytes + t * 4 * 32, v);
            __m256i xb = quad_of(xq.q.data() + g * GROUP + t * 4);
            for (int j = 0; j < 8; ++j) p[j] = _mm256_add_epi16(p[j], _mm256_maddubs_epi16(v[j], xb));
          }
          fold_group(acc.data(), p, scale, zero, xq.scale[g], xq.sum[g]);
          continue;
        }
        for (int t = 0; t < 8; ++t) regroup_quad(bytes + t * 4 * 32, panel[t]);
        for (int64_t m = 0; m < rows; m += 2) {
          int64_t other = std::min(m + 1, rows - 1);  // an odd last row pairs with itself
          const int8_t* x0 = xq.q.data() + m * k + g * GROUP;
          const int8_t* x1 = xq.q.data() + other * k + g * GROUP;
          __m256i p0[8], p1[8];
          for (int h = 0; h < 8; h += 4) {  // half the outputs at a time: 8 sums in registers
            __m256i a[4], b[4];
            for (int j = 0; j < 4; ++j) a[j] = b[j] = _mm256_setzero_si256();
            for (int t = 0; t < 8; ++t) {
              __m256i xa = quad_of(x0 + t * 4), xb = quad_of(x1 + t * 4);
              for (int j = 0; j < 4; ++j) {
                a[j] = _mm256_add_epi16(a[j], _mm256_maddubs_epi16(panel[t][h + j], xa));
                b[j] = _mm256_add_epi16(b[j], _mm256_maddubs_epi16(panel[t][h + j], xb));
              }
            }
            for (int j = 0; j < 4; ++j) p0[h + j] = a[j], p1[h + j] = b[j];
          }
          int64_t at0 = m * groups + g, at1 = other * groups + g;
          fold_group(acc.data() + m * BLOCK_N, p0, scale, zero, xq.scale[at0], xq.sum[at0]);
          if (other != m) fold_group(acc.data() + other * BLOCK_N, p1, scale, zero, xq.scale[at1], xq.sum[at1]);
        }
      }
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t p = 0; p < BLOCK_N; ++p) op[m * n + block * BLOCK_N + output(p)] = to_bf16(acc[m * BLOCK_N + p]);
    }
  });
}

}  // namespace lever
