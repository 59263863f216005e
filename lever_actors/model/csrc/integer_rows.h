// Row-major 8- and 6-bit matrices times activations rounded to int8, in integers, with AVX2:
// the int8 format's kernel on AVX2 CPUs and the q6k format's (GGUF's Q6_K blocks) on every CPU
// with our kernels.
//
// Each row of x is first rounded to int8 in groups of a block's inputs (one float32 scale per
// group: 32 for int8, as llama.cpp's Q8_0; 256 for q6k, as its Q8_K). A group's products with
// a weight row are summed exactly in integers, 32 pairs of bytes per instruction (vpmaddubsw
// takes one unsigned operand: int8's |w| with w's sign moved onto x, or q6k's q as stored),
// weighted by the weight's sub-block scales in vpmaddwd, and a block's sums are added to the
// output's eight float32 lanes in one fixed sequence. A row of x takes part in no other row's
// sums, so its result is the same alone or as one of 64.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "common.h"
#include "parallel.h"

namespace lever {

constexpr int64_t ROWS8 = 8;  // outputs per task
// how far ahead of each weight row's reads its bytes are fetched into the cache. With the
// hardware's prefetch alone, a one-row product of int8 rows of 1536 inputs read DRAM at
// 8.5 GB/s, about 14 with this.
constexpr int64_t FETCH_AHEAD = 2048;

// ---- activations: each row rounded to int8 in groups of inputs, as llama.cpp's Q8_0 and Q8_K ----

// Rows of x as int8 with one float32 scale per group of `group` inputs (32: int4 and int8;
// 256: q6k): x ~ scale * q, q in [-127, 127], q = round-to-even(x * (127 / max |x|)); and each
// 32 inputs' q summed. A row's rounding reads that row only, so it is the same alone or among
// any others. Rows shorter than `k` (q4k's last block) are read as if padded with zeros.
struct RoundedRows {
  std::vector<int8_t> q;        // [m, k]
  std::vector<float> scale;     // [m, k / group]
  std::vector<float> sum;       // [m, k / 32]: sum of the 32 inputs' q, exact
};

// x [rows, width] bf16
inline RoundedRows rounded_rows(const uint16_t* xp, int64_t rows, int64_t width, int64_t group = GROUP, int64_t k = 0) {
  constexpr int64_t LANES = 8;
  k = std::max(k, width);
  int64_t groups = k / group, parts = group / GROUP;
  RoundedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups), std::vector<float>(rows * k / GROUP)};
  std::vector<uint16_t> padded;  // zeros past each row's end (bf16 +0)
  if (k > width) {
    padded.assign(rows * k, 0);
    for (int64_t m = 0; m < rows; ++m) std::memcpy(padded.data() + m * k, xp + m * width, width * sizeof(uint16_t));
    xp = padded.data();
  }
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  // each group alone, so the threads' shares change nothing; a long prompt's rows took 15% of
  // a tiled product's time on one thread
  parallel_for(0, rows * groups, 256, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const uint16_t* values = xp + g * group;
      __m256 top = _mm256_setzero_ps();
      for (int64_t c = 0; c < group / LANES; ++c) top = _mm256_max_ps(top, _mm256_and_ps(bf16x8(values + c * LANES), magnitude));
      __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      half = _mm_max_ps(half, _mm_movehl_ps(half, half));
      float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
      __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      for (int64_t p = 0; p < parts; ++p) {
        __m256i q[4];
        for (int c = 0; c < 4; ++c) q[c] = _mm256_cvtps_epi32(_mm256_mul_ps(bf16x8(values + p * GROUP + c * LANES), inverse));
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        bytes = _mm256_permutevar8x32_epi32(bytes, order);
        _mm256_storeu_si256((__m256i*)(out.q.data() + g * group + p * GROUP), bytes);
        __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
        __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        out.sum[g * parts + p] = float(_mm_cvtsi128_si32(s));
      }
      out.scale[g] = amax / 127.0f;
    }
  });
  return out;
}

// ---- the weight formats: blocks of GROUPS groups of 32 signed values, each group's pairs
// weighted by its sub-block scales, each block's sums by its float scale ----

// int8: w = q * scale, one bf16 scale per output row; [n, k] int8, then [n] bf16
struct Int8Rows {
  static constexpr int GROUPS = 1;
  static constexpr int OFFSET = 0;  // the values are signed
  static constexpr int TILE_OUTPUTS = 2;  // weight rows a tile multiplies together
  const int8_t* data;
  const uint16_t* scales;
  int64_t k;

  struct Block {
    const int8_t* bytes;
    __m256 scale;  // 1: the row's scale comes last
  };
  Block block(int64_t j, int64_t b) const { return {data + j * k + b * GROUP, _mm256_set1_ps(1.0f)}; }
  __m256i group(const Block& block, int, __m256i*) const {  // no sub-block weights: all 1
    return _mm256_loadu_si256((const __m256i*)block.bytes);
  }
  float row_scale(int64_t j) const { return from_bf16(scales[j]); }
};

// q6k: GGUF's Q6_K. A block of 256 inputs is 128 bytes of low nibbles, 64 of two high bits
// each, 16 int8 sub-block scales (one per 16 inputs), 208 bytes in a row after row's blocks,
// and a float16 d held apart ([n, k / 256] after all rows): w = d * sc * (q - 32), q in 0..63.
constexpr int64_t K_INPUTS = 256, Q6K_BYTES = 208;  // a k-quant block's inputs; a Q6_K block's bytes less d

// q6k rows of one task's 8 outputs, unpacked once where many rows of x share them: each
// group's q (32 bytes) and weights (one vector), and each block's d
struct Q6KUnpacked {
  static constexpr int GROUPS = K_INPUTS / GROUP;
  static constexpr int OFFSET = 32;
  static constexpr int TILE_OUTPUTS = 2;
  const uint8_t* q;        // [8][k]
  const int16_t* weights;  // [8][k / 32][16]
  const float* d;          // [8][k / 256]
  int64_t j0, k;

  struct Block {
    const uint8_t* bytes;
    const int16_t* weights;
    __m256 scale;
  };
  Block block(int64_t j, int64_t b) const {
    int64_t row = j - j0;
    return {q + row * k + b * K_INPUTS, weights + (row * (k / GROUP) + b * GROUPS) * 16, _mm256_set1_ps(d[row * (k / K_INPUTS) + b])};
  }
  __m256i group(const Block& block, int gi, __m256i* weights) const {
    *weights = _mm256_loadu_si256((const __m256i*)(block.weights + gi * 16));
    return _mm256_loadu_si256((const __m256i*)(block.bytes + gi * GROUP));
  }
  float row_scale(int64_t) const { return 1.0f; }
};

struct Q6KRows {
  static constexpr int GROUPS = K_INPUTS / GROUP;
  static constexpr int OFFSET = 32;  // the values are q, unsigned: w is q - 32
  // one row unpacked at a time, read in one stream: at 2-4 rows of x 0.53-0.68 ms against
  // 0.62-0.78 two at a time (1536x8960, Zen 4); unpacked once (Q6KUnpacked), two
  static constexpr int TILE_OUTPUTS = 1;
  struct Panel {  // one task's unpacked rows (Q6KUnpacked), reused from block to block
    std::vector<uint8_t> q;
    std::vector<int16_t> weights;
    std::vector<float> d;
  };
  const uint8_t* data;
  const uint16_t* d;  // float16 bits, [n, k / 256]
  int64_t k;

  struct Block {
    const uint8_t* bytes;
    __m256 scale;      // d
    __m256i sc[2];     // sub-block scales 0-7 and 8-15, each twice in a 32-bit lane, as int16
  };
  Block block(int64_t j, int64_t b) const {
    int64_t at = j * (k / K_INPUTS) + b;
    const uint8_t* bytes = data + at * Q6K_BYTES;
    Block out{bytes, _mm256_set1_ps(_cvtsh_ss(d[at])), {}};
    for (int h = 0; h < 2; ++h) {
      __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(bytes + 192 + 8 * h)));
      out.sc[h] = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
    }
    return out;
  }
  // group gi (inputs 32gi..32gi+31 of the block) as q; weights: its two sub-blocks' scales,
  // each in the int16 lanes of the pairs it makes. A half block (128 inputs) is four groups:
  // the low and high nibbles of its two 32-byte runs, with two bits each of 32 more.
  __m256i group(const Block& block, int gi, __m256i* weights) const {
    int half = gi / 4, c = gi % 4, run = c % 2, nibble = c / 2;
    __m256i ql = _mm256_loadu_si256((const __m256i*)(block.bytes + half * 64 + run * 32));
    __m256i qh = _mm256_loadu_si256((const __m256i*)(block.bytes + 128 + half * 32));
    __m256i low = _mm256_and_si256(nibble ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(15));
    __m256i high = _mm256_and_si256(qh, _mm256_set1_epi8(char(3 << 2 * c)));  // bits 2c, 2c + 1
    high = c < 2 ? _mm256_slli_epi16(high, 4 - 2 * c) : _mm256_srli_epi16(high, 2 * c - 4);
    int first = 2 * gi % 8;  // sub-blocks 2gi and 2gi + 1, in sc[gi / 4]
    __m256i pick = _mm256_setr_epi32(first, first, first, first, first + 1, first + 1, first + 1, first + 1);
    *weights = _mm256_permutevar8x32_epi32(block.sc[half], pick);
    return _mm256_or_si256(low, high);
  }
  float row_scale(int64_t) const { return 1.0f; }
  // the 8 rows from j0 unpacked into `panel`: the same values, so the same sums
  Q6KUnpacked unpacked(int64_t j0, Panel& panel) const {
    int64_t groups = k / GROUP, blocks = k / K_INPUTS;
    panel.q.resize(ROWS8 * k);
    panel.weights.resize(ROWS8 * groups * 16);
    panel.d.resize(ROWS8 * blocks);
    for (int64_t j = 0; j < ROWS8; ++j)
      for (int64_t b = 0; b < blocks; ++b) {
        Block at = block(j0 + j, b);
        panel.d[j * blocks + b] = _mm256_cvtss_f32(at.scale);
        for (int gi = 0; gi < GROUPS; ++gi) {
          __m256i weights, q = group(at, gi, &weights);
          _mm256_storeu_si256((__m256i*)(panel.weights.data() + (j * groups + b * GROUPS + gi) * 16), weights);
          _mm256_storeu_si256((__m256i*)(panel.q.data() + j * k + b * K_INPUTS + gi * GROUP), q);
        }
      }
    return {panel.q.data(), panel.weights.data(), panel.d.data(), j0, k};
  }
};

// ---- y = row scale * sum over blocks of (x's scale * block scale) * (q_x . (w * weights)) ----
//
// x is rounded in groups of a block's inputs (W::GROUPS groups of 32), so a block's sums
// stay in integers until the block ends.

// R rows of x from row m0 times J weight rows from j0: sums [R][ROWS8]. Each weight group is
// unpacked once and used by all R rows; the registers hold R * J sums (at most 8).
template <int R, int J, typename W>
inline void integer_tile(const RoundedRows& xq, int64_t m0, const W& w, int64_t j0, float* sums) {
  int64_t k = w.k, blocks = k / (W::GROUPS * GROUP);
  __m256 s[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) s[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    typename W::Block block[J];
    for (int j = 0; j < J; ++j) block[j] = w.block(j0 + j, b);
    __m256i acc[R][J];  // int32 lanes: at most 8 groups * 2 * (2 * 128 * 127) * 128, within range
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int gi = 0; gi < W::GROUPS; ++gi) {  // unrolled: every offset and shift a constant
      int64_t g = b * W::GROUPS + gi;
      __m256i q[J], magnitude[J], weights[J];
      for (int j = 0; j < J; ++j) {
        if (g % 2 == 0) _mm_prefetch((const char*)block[j].bytes + gi * GROUP + FETCH_AHEAD, _MM_HINT_T0);
        q[j] = w.group(block[j], gi, &weights[j]);
        if constexpr (!W::OFFSET) magnitude[j] = _mm256_abs_epi8(q[j]);  // -128 becomes 128, right as unsigned
      }
      for (int r = 0; r < R; ++r) {
        __m256i xr = _mm256_loadu_si256((const __m256i*)(xq.q.data() + (m0 + r) * k + g * GROUP));
        __m256i offset;  // OFFSET * x's pairs, taken off each (q, x) pair's sum
        if constexpr (W::OFFSET) offset = _mm256_maddubs_epi16(_mm256_set1_epi8(W::OFFSET), xr);
        for (int j = 0; j < J; ++j) {
          if constexpr (W::OFFSET) {  // q unsigned as it is: a pair at most 2 * 63 * 127
            __m256i pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(q[j], xr), offset);
            acc[r][j] = add_pair_products(acc[r][j], pairs, weights[j]);
          } else {  // |w| times x with w's sign: a pair at most 2 * 128 * 127; weights are 1
            ByteDots dots;
            dots.add(magnitude[j], _mm256_sign_epi8(xr, q[j]));
            acc[r][j] = _mm256_add_epi32(acc[r][j], dots.widened());
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 x_scale = _mm256_set1_ps(xq.scale[(m0 + r) * blocks + b]);
      for (int j = 0; j < J; ++j)
        s[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][j]), _mm256_mul_ps(x_scale, block[j].scale), s[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) sums[r * ROWS8 + j] = summed_lanes(s[r][j]);
}

// rows [m, m + 4) of x (fewer where fewer are left) times the 8 weight rows from j0: sums [rows][8]
template <typename W>
inline void integer_rows(const RoundedRows& xq, int64_t m, int64_t rows_left, const W& w, int64_t j0, float* sums) {
  constexpr int J = W::TILE_OUTPUTS;
  switch (std::min<int64_t>(rows_left, 4)) {
    case 1:  // one weight row after another: the reads run in one sequential stream
      for (int j = 0; j < ROWS8; ++j) integer_tile<1, 1>(xq, m, w, j0 + j, sums + j);
      break;
    case 2:
      for (int j = 0; j < ROWS8; j += J) integer_tile<2, J>(xq, m, w, j0 + j, sums + j);
      break;
    case 3:
      for (int j = 0; j < ROWS8; j += J) integer_tile<3, J>(xq, m, w, j0 + j, sums + j);
      break;
    default:
      for (int j = 0; j < ROWS8; j += J) integer_tile<4, J>(xq, m, w, j0 + j, sums + j);
  }
}

// x [rows, w.k] bf16 times the n rows of w -> op [rows, n] bf16
template <typename W>
void integer_product(const uint16_t* x, int64_t rows, const W& w, int64_t n, uint16_t* op) {
  if (rows == 0) return;
  RoundedRows xq = rounded_rows(x, rows, w.k, W::GROUPS * GROUP);
  parallel_for(0, n / ROWS8, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(rows * ROWS8);  // the block's: [rows][8 outputs]
    auto all_rows = [&](const auto& weights, int64_t j0) {  // the block's weight rows stay in cache meanwhile
      for (int64_t m = 0; m < rows; m += 4) integer_rows(xq, m, rows - m, weights, j0, sums.data() + m * ROWS8);
    };
    for (int64_t block = begin; block < end; ++block) {
      if constexpr (requires { typename W::Panel; }) {
        thread_local typename W::Panel panel;
        if (rows > 8)  // unpacked once for all rows, not once per four
          all_rows(w.unpacked(block * ROWS8, panel), block * ROWS8);
        else
          all_rows(w, block * ROWS8);
      } else {
        all_rows(w, block * ROWS8);
      }
      for (int64_t j = 0; j < ROWS8; ++j) {
        float scale = w.row_scale(block * ROWS8 + j);
        for (int64_t m = 0; m < rows; ++m) op[m * n + block * ROWS8 + j] = to_bf16(scale * sums[m * ROWS8 + j]);
      }
    }
  });
}

}  // namespace lever
