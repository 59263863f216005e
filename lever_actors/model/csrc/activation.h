// The gated MLP's activation for bf16 rows, element by element in one fixed sequence, so the
// torch ops (model/layers.py) and the plain library (plain.cpp) give the same bits.
#pragma once

#include <cstdint>
#include <immintrin.h>

#include "common.h"

namespace lever {

// silu(g) = g * sigmoid(g), sigmoid from e = e^-|g| (exp8): 1 / (1 + e) for g >= 0, else
// e / (1 + e); the empty asm keeps the compiler from fusing exp8's last product into the sum
inline __m256 silu8(__m256 g) {
  __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  __m256 e = exp8(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  // e^-|g|
  asm volatile("" : "+x"(e));
  __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(_mm256_set1_ps(1.0f), e, negative), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_mul_ps(g, sigmoid);
}

// out = bf16(bf16(silu(gate)) * up), count bf16 elements each, rounded as torch's bf16 ops round
inline void swiglu(const uint16_t* gate, const uint16_t* up, int64_t count, uint16_t* out) {
  alignas(32) float silu[8];
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_store_ps(silu, silu8(bf16x8(gate + i)));
    for (int64_t l = 0; l < 8; ++l) out[i + l] = to_bf16(from_bf16(to_bf16(silu[l])) * from_bf16(up[i + l]));
  }
  for (; i < count; ++i) {  // the tail, one lane at a time, the same per element
    _mm256_store_ps(silu, silu8(_mm256_set1_ps(from_bf16(gate[i]))));
    out[i] = to_bf16(from_bf16(to_bf16(silu[0])) * from_bf16(up[i]));
  }
}

}  // namespace lever
