// Weight-only quantized matrix products with AVX2 and FMA, built by model/native.py for CPUs
// without AMX.
//
// Each row of x is first rounded to int8 in groups of 32 inputs (one float32 scale per group,
// as llama.cpp's Q8_0), and a group's products with the 4- or 8-bit weights are summed in
// integers, 32 pairs of bytes per instruction (vpmaddubsw), exactly; the group's sum is then
// scaled in one fixed sequence of float32 operations per output. A row of x takes part in no
// other row's sums, so a row's result is the same alone or as one of 64, and the weights are
// unpacked once per call, however many rows share it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "aten.h"
#include "common.h"
#include "integer_rows.h"
#include "layer.h"
#include "q4k.h"

namespace {

using namespace lever;

constexpr int64_t LANES = 8;     // floats per vector

// ---- int4: y = sum over groups of x's scale * (scale * (q_x . q) + (zero - 8 * scale) * sum(q_x)) ----
//
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
    __m256i v = _mm256_loadu_si256((const __m256i*)(sz + t * LANES));
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
    _mm256_storeu_ps(acc + t * LANES, _mm256_fmadd_ps(xs, group, _mm256_loadu_ps(acc + t * LANES)));
  }
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& bias) {
  // x [m, k] bf16; packed [n, k / 2] uint8; scales [k / 32, n, 2] bf16 (scale, zero)
  check_int4(x, packed, scales);
  int64_t rows = x.size(0), k = x.size(1), n = packed.size(0), groups = k / GROUP;
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  RoundedRows xq = rounded_rows(x);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint32_t* sp = reinterpret_cast<const uint32_t*>(scales.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
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
  return biased(out, bias);
}

// x [m, k] bf16; weight [n, k] int8; scales [n] bf16
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const std::optional<at::Tensor>& bias) {
  check_rows(x);
  check_int8(weight, scales);
  int64_t k = x.size(1), n = weight.size(0);
  TORCH_CHECK(n % ROWS8 == 0 && k % GROUP == 0 && weight.size(1) == k, "int8 shape");
  Int8Rows w{weight.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), k};
  return biased(integer_linear(x, w, n), bias);
}

// a matrix of model/fused.py's format code (0 int4, 1 int8, 2 q6k, 3 q4k) times x
at::Tensor product(int64_t fmt, const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                   const std::optional<at::Tensor>& bias) {
  switch (fmt) {
    case 0: return int4_linear(x, data, scales, bias);
    case 1: return int8_linear(x, data, scales, bias);
    case 2: return q6k_linear(x, data, scales, bias);
    case 3: return q4k_linear(x, data, scales, bias);
  }
  TORCH_CHECK(false, "unknown matrix format code ", fmt);
}

}  // namespace

TORCH_LIBRARY(lever_avx2, m) {
  lever::define_ops(m, &int4_linear, &int8_linear, &lever::q4k_linear);
  m.def("decoder_layer", &lever::decoder_layer<product>);
}
