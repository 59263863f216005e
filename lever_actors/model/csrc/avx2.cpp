// Weight-only quantized matrix products with AVX2 and FMA, built by model/native.py for CPUs
// without AMX.
//
// Each output is one fixed sequence of float32 fused multiply-adds over the inputs in order
// (int8: eight lanes of inputs, summed in a fixed order at the end); a row of x takes part in
// no other row's sums. So a row's result is the same alone or as one of 64, and the weights
// are unpacked once per call, however many rows share it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "common.h"

namespace {

using namespace lever;

constexpr int64_t LANES = 8;     // floats per vector
constexpr int64_t ROWS8 = 8;     // int8: outputs per task

// x [m, k] bf16 -> float32, exactly
std::vector<float> widened(const at::Tensor& x) {
  int64_t count = x.numel();
  std::vector<float> out(count);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  int64_t i = 0;
  for (; i + LANES <= count; i += LANES) {
    __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(xp + i)));
    _mm256_storeu_ps(out.data() + i, _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
  }
  for (; i < count; ++i) out[i] = from_bf16(xp[i]);
  return out;
}

// ---- int4: y = sum over groups of scale * (x . q) + (zero - 8 * scale) * sum(x), per output ----

// Eight bytes of an input's 32 in the int4 packing (byte j holds output j in its low nibble,
// output j + 32 in its high one) as float32 q: the low and the high nibbles
inline void unpack8(const uint8_t* bytes, __m256& low, __m256& high) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)bytes));
  low = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  high = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

// One group of the packing as float32 q, panel [32 inputs][64 outputs]
inline void unpack_group(const uint8_t* bytes, float* panel) {
  for (int64_t i = 0; i < GROUP; ++i)
    for (int64_t c = 0; c < 4; ++c) {
      __m256 low, high;
      unpack8(bytes + i * 32 + c * LANES, low, high);
      _mm256_store_ps(panel + i * BLOCK_N + c * LANES, low);
      _mm256_store_ps(panel + i * BLOCK_N + 32 + c * LANES, high);
    }
}

// A group's scales and zeros for the block's 64 outputs, as float32 vectors; the zero takes
// in the -8 of q - 8 (zero - 8 * scale), so the products multiply q as it is unpacked
inline void group_scales(const uint32_t* sz, __m256* scale, __m256* zero) {
  for (int t = 0; t < 8; ++t) {
    __m256i v = _mm256_loadu_si256((const __m256i*)(sz + t * LANES));
    scale[t] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    __m256 z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
    zero[t] = _mm256_fmadd_ps(_mm256_set1_ps(-8.0f), scale[t], z);
  }
}

// acc [64] += scale * p + zero * sum, per output: a group's products folded in
inline void fold_group(float* acc, const __m256* p, const __m256* scale, const __m256* zero, float sum) {
  __m256 total = _mm256_set1_ps(sum);
  for (int t = 0; t < 8; ++t) {
    __m256 v = _mm256_fmadd_ps(scale[t], p[t], _mm256_loadu_ps(acc + t * LANES));
    _mm256_storeu_ps(acc + t * LANES, _mm256_fmadd_ps(zero[t], total, v));
  }
}

// One row, one group: the panel's products with the weights unpacked in registers instead (the
// same fused multiply-adds in the same order, without the panel's stores and loads).
inline void int4_group_one_row(const float* x, const uint8_t* bytes, __m256* p) {
  for (int64_t i = 0; i < GROUP; ++i) {
    __m256 xi = _mm256_broadcast_ss(x + i);
    for (int64_t c = 0; c < 4; ++c) {
      __m256 low, high;
      unpack8(bytes + i * 32 + c * LANES, low, high);
      p[c] = _mm256_fmadd_ps(xi, low, p[c]);
      p[4 + c] = _mm256_fmadd_ps(xi, high, p[4 + c]);
    }
  }
}

// Two rows, one group, from the unpacked panel, a half's 32 outputs at a time: p0, p1 [8] each
inline void int4_group_two_rows(const float* x0, const float* x1, const float* panel, __m256* p0, __m256* p1) {
  for (int h = 0; h < 8; h += 4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t i = 0; i < GROUP; ++i) {
      __m256 a = _mm256_broadcast_ss(x0 + i), b = _mm256_broadcast_ss(x1 + i);
      const float* w = panel + i * BLOCK_N + h * LANES;
      __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8), w2 = _mm256_load_ps(w + 16), w3 = _mm256_load_ps(w + 24);
      a0 = _mm256_fmadd_ps(a, w0, a0);
      a1 = _mm256_fmadd_ps(a, w1, a1);
      a2 = _mm256_fmadd_ps(a, w2, a2);
      a3 = _mm256_fmadd_ps(a, w3, a3);
      b0 = _mm256_fmadd_ps(b, w0, b0);
      b1 = _mm256_fmadd_ps(b, w1, b1);
      b2 = _mm256_fmadd_ps(b, w2, b2);
      b3 = _mm256_fmadd_ps(b, w3, b3);
    }
    p0[h] = a0, p0[h + 1] = a1, p0[h + 2] = a2, p0[h + 3] = a3;
    p1[h] = b0, p1[h + 1] = b1, p1[h + 2] = b2, p1[h + 3] = b3;
  }
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  // x [m, k] bf16; packed [n, k / 2] uint8; scales [k / 32, n, 2] bf16 (scale, zero)
  check_int4(x, packed, scales);
  int64_t rows = x.size(0), k = x.size(1), n = packed.size(0), groups = k / GROUP;
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  std::vector<float> xf = widened(x), xg(rows * k);  // xg [groups][rows][32]: a group's rows together
  std::vector<float> sums(rows * groups);               // each row's inputs summed per group, in order
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < GROUP; ++i) s += xf[m * k + g * GROUP + i];
      sums[m * groups + g] = s;
      std::memcpy(&xg[(g * rows + m) * GROUP], &xf[m * k + g * GROUP], GROUP * sizeof(float));
    }
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint32_t* sp = reinterpret_cast<const uint32_t*>(scales.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float panel[GROUP * BLOCK_N];
    std::vector<float> acc(rows * BLOCK_N);
    for (int64_t block = begin; block < end; ++block) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const uint8_t* column = pp + block * k * 32;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* bytes = column + g * GROUP * 32;
        __m256 scale[8], zero[8], p[2][8];
        group_scales(sp + g * n + block * BLOCK_N, scale, zero);
        if (rows == 1) {
          for (int t = 0; t < 8; ++t) p[0][t] = _mm256_setzero_ps();
          int4_group_one_row(xf.data() + g * GROUP, bytes, p[0]);
          fold_group(acc.data(), p[0], scale, zero, sums[g]);
          continue;
        }
        unpack_group(bytes, panel);
        for (int64_t m = 0; m < rows; m += 2) {
          int64_t other = std::min(m + 1, rows - 1);  // an odd last row pairs with itself
          const float* group_rows = xg.data() + g * rows * GROUP;
          int4_group_two_rows(group_rows + m * GROUP, group_rows + other * GROUP, panel, p[0], p[1]);
          fold_group(acc.data() + m * BLOCK_N, p[0], scale, zero, sums[m * groups + g]);
          if (other != m) fold_group(acc.data() + other * BLOCK_N, p[1], scale, zero, sums[other * groups + g]);
        }
      }
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < BLOCK_N; ++j) op[m * n + block * BLOCK_N + j] = to_bf16(acc[m * BLOCK_N + j]);
    }
  });
  return out;
}

// ---- int8: y = scale * (x . q), per output; lane l sums the inputs l, l + 8, ... ----

inline float lanes_summed(__m256 v) {  // ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
  __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// R rows of x [R][k] times J rows of w [J][k]: sums [R][J] within rows of 8. Each weight is
// converted once and used by all R rows; the registers hold R * J sums (at most 8).
template <int R, int J>
inline void int8_tile(const float* x, const int8_t* w, int64_t k, float* sums) {
  __m256 s[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) s[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += LANES) {
    __m256 q[J];
    for (int j = 0; j < J; ++j)
      q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + j * k + i))));
    for (int r = 0; r < R; ++r) {
      __m256 xr = _mm256_loadu_ps(x + r * k + i);
      for (int j = 0; j < J; ++j) s[r][j] = _mm256_fmadd_ps(xr, q[j], s[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) sums[r * ROWS8 + j] = lanes_summed(s[r][j]);
}

// rows [m, m + 4) of x (fewer where fewer are left) times the 8 outputs at w: sums [rows][8]
inline void int8_rows(int64_t rows_left, const float* x, const int8_t* w, int64_t k, float* sums) {
  switch (std::min<int64_t>(rows_left, 4)) {
    case 1: int8_tile<1, 8>(x, w, k, sums); break;
    case 2:
      for (int j = 0; j < ROWS8; j += 4) int8_tile<2, 4>(x, w + j * k, k, sums + j);
      break;
    case 3:
      for (int j = 0; j < ROWS8; j += 2) int8_tile<3, 2>(x, w + j * k, k, sums + j);
      break;
    default:
      for (int j = 0; j < ROWS8; j += 2) int8_tile<4, 2>(x, w + j * k, k, sums + j);
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  // x [m, k] bf16; weight [n, k] int8; scales [n] bf16
  check_rows(x);
  check_int8(weight, scales);
  int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(n % ROWS8 == 0 && k % LANES == 0 && weight.size(1) == k, "int8 shape");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  std::vector<float> xf = widened(x);
  const int8_t* wp = weight.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, n / ROWS8, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(rows * ROWS8);  // the block's: [rows][8 outputs]
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t m = 0; m < rows; m += 4)  // the block's 8 weight rows stay in L1 meanwhile
        int8_rows(rows - m, xf.data() + m * k, wp + block * ROWS8 * k, k, sums.data() + m * ROWS8);
      for (int64_t j = 0; j < ROWS8; ++j) {
        float scale = from_bf16(sp[block * ROWS8 + j]);
        for (int64_t m = 0; m < rows; ++m) op[m * n + block * ROWS8 + j] = to_bf16(scale * sums[m * ROWS8 + j]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(lever_avx2, m) {
  m.def("int4_linear", &int4_linear);
  m.def("int8_linear", &int8_linear);
}
