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

#include "attention.h"
#include "common.h"
#include "norm.h"

namespace {

using namespace lever;

constexpr int64_t LANES = 8;     // floats per vector
constexpr int64_t ROWS8 = 8;     // int8: outputs per task
// int8: how far ahead of each weight row's reads its bytes are fetched into the cache. With the
// hardware's prefetch alone, a one-row product of rows of 1536 inputs read DRAM at 8.5 GB/s,
// about 14 with this.
constexpr int64_t FETCH_AHEAD = 2048;

// ---- activations: each row rounded to int8 in groups of 32 inputs, as llama.cpp's Q8_0 ----

// Rows of x as int8 with one float32 scale per group of 32 inputs: x ~ scale * q, q in
// [-127, 127], q = round-to-even(x * (127 / max |x|)); and each group's q summed. A row's
// rounding reads that row only, so it is the same alone or among any others.
struct RoundedRows {
  std::vector<int8_t> q;        // [m, k]
  std::vector<float> scale;     // [m, k / 32]
  std::vector<float> sum;       // [m, k / 32]: sum of the group's q, exact
};

RoundedRows rounded_rows(const at::Tensor& x) {
  int64_t rows = x.size(0), k = x.size(1), groups = k / GROUP;
  RoundedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups), std::vector<float>(rows * groups)};
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t g = 0; g < rows * groups; ++g) {
    __m256 v[4], top = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = bf16x8(xp + g * GROUP + c * LANES);
      top = _mm256_max_ps(top, _mm256_and_ps(v[c], magnitude));
    }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
    __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int c = 0; c < 4; ++c) q[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], inverse));
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, order);
    _mm256_storeu_si256((__m256i*)(out.q.data() + g * GROUP), bytes);
    __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
    __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    out.scale[g] = amax / 127.0f;
    out.sum[g] = float(_mm_cvtsi128_si32(s));
  }
  return out;
}

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

inline __m256i quad_of(const int8_t* q) {  // 4 int8 inputs, in every 32-bit lane
  int32_t four;
  std::memcpy(&four, q, 4);
  return _mm256_set1_epi32(four);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
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
  return out;
}

// ---- int8: y = scale * sum over groups of x's scale * (q_x . q), per output ----
//
// q_x . q in integers: vpmaddubsw takes one unsigned operand, so it multiplies |q| by q_x
// with q's sign moved onto it (a pair at most 2 * 128 * 127, within int16), and vpmaddwd
// sums the pairs into int32 lanes of four. Lane l holds the inputs 4l..4l+3 of each group;
// the lanes are summed in a fixed order at the end.

// R rows of x from row m0 times J rows of w [J][k]: sums [R][J] within rows of 8. Each
// weight is loaded once and used by all R rows; the registers hold R * J sums (at most 8).
template <int R, int J>
inline void int8_tile(const RoundedRows& xq, int64_t m0, const int8_t* w, int64_t k, float* sums) {
  int64_t groups = k / GROUP;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 s[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) s[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i q[J], magnitude[J];
    for (int j = 0; j < J; ++j) {
      if (g % 2 == 0) _mm_prefetch((const char*)(w + j * k + g * GROUP) + FETCH_AHEAD, _MM_HINT_T0);
      q[j] = _mm256_loadu_si256((const __m256i*)(w + j * k + g * GROUP));
      magnitude[j] = _mm256_abs_epi8(q[j]);  // -128 becomes 128, right as unsigned
    }
    for (int r = 0; r < R; ++r) {
      __m256i xr = _mm256_loadu_si256((const __m256i*)(xq.q.data() + (m0 + r) * k + g * GROUP));
      __m256 x_scale = _mm256_set1_ps(xq.scale[(m0 + r) * groups + g]);
      for (int j = 0; j < J; ++j) {
        __m256i pairs = _mm256_maddubs_epi16(magnitude[j], _mm256_sign_epi8(xr, q[j]));
        __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        s[r][j] = _mm256_fmadd_ps(dot, x_scale, s[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) sums[r * ROWS8 + j] = summed_lanes(s[r][j]);
}

// rows [m, m + 4) of x (fewer where fewer are left) times the 8 outputs at w: sums [rows][8]
inline void int8_rows(const RoundedRows& xq, int64_t m, int64_t rows_left, const int8_t* w, int64_t k, float* sums) {
  switch (std::min<int64_t>(rows_left, 4)) {
    case 1:  // one weight row after another: the reads run in one sequential stream
      for (int j = 0; j < ROWS8; ++j) int8_tile<1, 1>(xq, m, w + j * k, k, sums + j);
      break;
    case 2:
      for (int j = 0; j < ROWS8; j += 2) int8_tile<2, 2>(xq, m, w + j * k, k, sums + j);
      break;
    case 3:
      for (int j = 0; j < ROWS8; j += 2) int8_tile<3, 2>(xq, m, w + j * k, k, sums + j);
      break;
    default:
      for (int j = 0; j < ROWS8; j += 2) int8_tile<4, 2>(xq, m, w + j * k, k, sums + j);
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  // x [m, k] bf16; weight [n, k] int8; scales [n] bf16
  check_rows(x);
  check_int8(weight, scales);
  int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(n % ROWS8 == 0 && k % GROUP == 0 && weight.size(1) == k, "int8 shape");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  RoundedRows xq = rounded_rows(x);
  const int8_t* wp = weight.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, n / ROWS8, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(rows * ROWS8);  // the block's: [rows][8 outputs]
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t m = 0; m < rows; m += 4)  // the block's 8 weight rows stay in L1 meanwhile
        int8_rows(xq, m, rows - m, wp + block * ROWS8 * k, k, sums.data() + m * ROWS8);
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
  m.def("attend", &lever::attend);
  m.def("rms_norm", &lever::rms_norm);
  m.def("int4_linear", &int4_linear);
  m.def("int8_linear", &int8_linear);
}
