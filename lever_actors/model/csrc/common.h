// What both kernels' sources share: bf16 conversions, a vector's sum in one fixed order, byte
// products summed in integers (AVX2 and FMA, which every CPU with our kernels has;
// AVX512-VNNI where the build has it). No torch: model/plain.py builds them without it.
#pragma once

#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <new>

namespace lever {

constexpr int64_t BLOCK_N = 64;  // outputs per block: the int4 packing's, and the kernels'
constexpr int64_t GROUP = 32;    // inputs per int4 scale and zero, and per activation scale (AVX2)

template <typename T>
struct Aligned {  // 64-byte aligned storage: whole tile rows or vectors per cache line
  using value_type = T;
  T* allocate(size_t count) { return static_cast<T*>(::operator new(count * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const Aligned&) const = default;
};

inline float from_bf16(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (f != f) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 as float32, exactly
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline __m256i quad_of(const int8_t* q) {  // 4 int8 inputs, in every 32-bit lane
  int32_t four;
  std::memcpy(&four, q, 4);
  return _mm256_set1_epi32(four);
}

inline float summed_lanes(__m256 v) {  // ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
  __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// One output lane's products of unsigned weight bytes with signed x bytes, summed exactly
// over a group of inputs. With AVX512-VNNI one instruction adds four products to an int32
// lane (vpdpbusd); with AVX2 two add pairs to int16 halves (vpmaddubsw), widened when the
// group ends. The sums are the same integers either way (no pair here reaches int16's limit).
struct ByteDots {
#ifdef __AVX512VNNI__
  __m256i sum = _mm256_setzero_si256();
  void add(__m256i u, __m256i s) { sum = _mm256_dpbusd_epi32(sum, u, s); }
  __m256i widened() const { return sum; }
  // each lane's sum times that lane's int32 weight (at most int16's limit)
  __m256i weighted(__m256i weight) const { return _mm256_mullo_epi32(sum, weight); }
#else
  __m256i pairs = _mm256_setzero_si256();
  void add(__m256i u, __m256i s) { pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u, s)); }
  __m256i widened() const { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
  __m256i weighted(__m256i weight) const {
    return _mm256_madd_epi16(pairs, _mm256_or_si256(weight, _mm256_slli_epi32(weight, 16)));
  }
#endif
};

// acc plus each 32-bit lane's two int16 products, summed exactly: one instruction with
// AVX512-VNNI (vpdpwssd), two with AVX2
inline __m256i add_pair_products(__m256i acc, __m256i a, __m256i b) {
#ifdef __AVX512VNNI__
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// e^x for x <= 0 to about 1 ulp, lane by lane (so a value's result never depends on its
// neighbours); x below -87 counts as -87, whose e^x no softmax sum can notice
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln 2, in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);  // Taylor's series to r^7: |r| <= ln 2 / 2
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// out [m, n] bf16 plus bias [n] bf16, each sum rounded as torch's bf16 add rounds it: in the
// product's call, where a separate add cost a small op per biased matrix
inline void add_bias(uint16_t* out, int64_t rows, int64_t n, const uint16_t* bias) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < n; ++j) out[m * n + j] = to_bf16(from_bf16(out[m * n + j]) + from_bf16(bias[j]));
}

}  // namespace lever
