// Attention for bf16 rows, each query row computed on its own in one fixed order: included by
// both kernels' sources (AVX2 and FMA, which every CPU with our kernels has).
//
// A row's scores, softmax and weighted sum read only that row's query and the keys its mask
// shows, in position order, in float32: masked keys are skipped, not added as zeros, so a
// token verified in a tree of any size gets the bits one-token decoding gets. torch's float64
// attention gives the same guarantee for three to seven times the time (docs/design.md, "Kernels").
#pragma once

#include <cmath>
#include <cstdint>
#include <immintrin.h>
#include <limits>
#include <vector>

#include "common.h"
#include "parallel.h"

namespace lever {

// below this many multiply-adds a call runs on the calling thread: waking the team costs more
constexpr int64_t ATTEND_ALONE = int64_t(1) << 21;

// out lanes [l, l + chunk) of the `group` heads: sum over visible keys of weight * value, over
// the total, in bf16
template <int64_t group, int64_t chunk>
void weigh_values(const uint16_t* values, const bool* visible, int64_t first, int64_t end, int64_t hd, int64_t l,
                  const float* weights, int64_t width, const float* total, uint16_t* out) {
  __m256 acc[group][chunk];
  for (int64_t h = 0; h < group; ++h)
    for (int64_t c = 0; c < chunk; ++c) acc[h][c] = _mm256_setzero_ps();
  for (int64_t j = first; j < end; ++j) {
    if (visible && !visible[j]) continue;
    for (int64_t c = 0; c < chunk; ++c) {
      __m256 v = bf16x8(values + j * hd + (l + c) * 8);
      for (int64_t h = 0; h < group; ++h) acc[h][c] = _mm256_fmadd_ps(_mm256_set1_ps(weights[h * width + j]), v, acc[h][c]);
    }
  }
  alignas(32) float row[8];
  for (int64_t h = 0; h < group; ++h)
    for (int64_t c = 0; c < chunk; ++c) {
      _mm256_store_ps(row, _mm256_div_ps(acc[h][c], _mm256_set1_ps(total[h])));
      for (int e = 0; e < 8; ++e) out[h * hd + (l + c) * 8 + e] = to_bf16(row[e]);
    }
}

// One query row of the `group` heads that share a kv head, against that head's visible keys:
// each key and value is widened once for all of them. out: the heads' [group, hd] bf16.
// q32: scratch [group, hd]; weights: [group, T rounded up to 8]; visible: the row's mask or null.
template <int64_t group>  // known when compiled, so each head's sums stay in registers
void attend_group(const uint16_t* q, int64_t q_stride, const uint16_t* keys, const uint16_t* values,
                  const bool* visible, int64_t T, int64_t hd, float scale, float softcap, float* q32,
                  float* weights, uint16_t* out) {
  const int64_t lanes = hd / 8, width = (T + 7) / 8 * 8;
  for (int64_t h = 0; h < group; ++h)
    for (int64_t l = 0; l < lanes; ++l) _mm256_storeu_ps(q32 + h * hd + l * 8, bf16x8(q + h * q_stride + l * 8));
  // only keys from the first visible to the last visible one: a prompt's causal rows see a
  // prefix, so the rest would be visited for nothing
  int64_t first = 0, end = T;
  if (visible) {
    while (first < T && !visible[first]) ++first;
    while (end > first && !visible[end - 1]) --end;
  }
  float top[group];
  for (int64_t h = 0; h < group; ++h) top[h] = -std::numeric_limits<float>::infinity();
  for (int64_t j = first; j < end; ++j) {
    if (visible && !visible[j]) continue;  // its weight's slot keeps a stale value, never read
    const uint16_t* key = keys + j * hd;
    __m256 dot[group];
    for (int64_t h = 0; h < group; ++h) dot[h] = _mm256_setzero_ps();
    for (int64_t l = 0; l < lanes; ++l) {
      __m256 k = bf16x8(key + l * 8);
      for (int64_t h = 0; h < group; ++h) dot[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q32 + h * hd + l * 8), k, dot[h]);
    }
    for (int64_t h = 0; h < group; ++h) {
      float s = summed_lanes(dot[h]) * scale;
      if (softcap > 0.0f) s = std::tanh(s / softcap) * softcap;
      weights[h * width + j] = s;
      top[h] = s > top[h] ? s : top[h];
    }
  }
  float total[group];
  for (int64_t h = 0; h < group; ++h) {
    float* w = weights + h * width;
    for (int64_t j = first / 8 * 8; j < end; j += 8)  // lanes by themselves: any 8 give the same
      _mm256_storeu_ps(w + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(w + j), _mm256_set1_ps(top[h]))));
    total[h] = 0.0f;
    for (int64_t j = first; j < end; ++j)
      if (!visible || visible[j]) total[h] += w[j];
  }
  // each output lane sums its keys in position order; a pass takes `chunk` lanes of 8 at once
  // (as many as registers hold), so that it reads whole pieces of each value row
  constexpr int64_t chunk = group <= 3 ? 4 : group <= 6 ? 2 : 1;
  int64_t l = 0;
  for (; l + chunk <= lanes; l += chunk) weigh_values<group, chunk>(values, visible, first, end, hd, l, weights, width, total, out);
  for (; l < lanes; ++l) weigh_values<group, 1>(values, visible, first, end, hd, l, weights, width, total, out);
}

template <typename... Args>
void attend_heads(int64_t group, Args... args) {
  switch (group) {
    case 1: return attend_group<1>(args...);
    case 2: return attend_group<2>(args...);
    case 3: return attend_group<3>(args...);
    case 4: return attend_group<4>(args...);
    case 5: return attend_group<5>(args...);
    case 6: return attend_group<6>(args...);
    case 7: return attend_group<7>(args...);
    default: return attend_group<8>(args...);
  }
}

// qp [H, n, hd] bf16 contiguous; kp, vp [KV, T, hd] bf16, head h's rows at h * stride, each
// head's [T, hd] contiguous; mp [n, T] (true: attend) or null -> op [n, H, hd] bf16
inline void attend_rows(const uint16_t* qp, int64_t H, int64_t n, int64_t hd, const uint16_t* kp, const uint16_t* vp,
                        int64_t KV, int64_t T, int64_t stride, const bool* mp, double scale, double softcap,
                        uint16_t* op) {
  int64_t group = H / KV, width = (T + 7) / 8 * 8;
  int64_t tasks = n * KV, grain = H * n * T * hd < ATTEND_ALONE ? tasks + 1 : 1;
  parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q32(group * hd), weights(group * width, 0.0f);
    for (int64_t task = begin; task < end; ++task) {
      int64_t i = task / KV, kv = task % KV, h = kv * group;
      attend_heads(group, qp + (h * n + i) * hd, n * hd, kp + kv * stride, vp + kv * stride, mp ? mp + i * T : nullptr,
                   T, hd, float(scale), float(softcap), q32.data(), weights.data(), op + (i * H + h) * hd);
    }
  });
}

}  // namespace lever
