// One decoder layer in one call (model/layers.py's `layer_forward`, for the layers model/fused.py
// hands over): the same kernels and bf16 roundings in the same order, so the same bits, without
// a Python call per op (about 1.3 ms of a one-row draft forward's 10, Zen 4). On plain buffers:
// the AVX2 source's torch op and the plain library (plain.cpp) both call it.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "activation.h"
#include "attention.h"
#include "common.h"
#include "norm.h"
#include "products.h"
#include "rope.h"

namespace lever {

// the matrices in this order in LayerWeights
enum Matrix { WQ, WK, WV, WO, W_GATE, W_UP, W_DOWN, MATRICES };

struct LayerWeights {
  const uint16_t* attn_norm;  // [d] bf16
  const uint16_t* ffn_norm;   // [d] bf16
  MatrixRef matrices[MATRICES];
  const uint16_t *bq, *bk, *bv;  // [out] bf16 or null
};

// the KV cache: keys, values [L, KV, capacity, hd] bf16 and slot_positions [capacity]
struct LayerCache {
  uint16_t* keys;
  uint16_t* values;
  int64_t* slot_positions;
  int64_t kv_heads, capacity;
};

// where the n rows go: k and v written at `length` + offsets[i] (or + i where offsets is null),
// attention then seeing slots [0, length + span); positions [n], cos, sin [n, hd] bf16, mask
// [n, length + span] (true: attend) or null
struct LayerPlace {
  int64_t layer, length, span;
  const int64_t* offsets;
  const int64_t* positions;
  const uint16_t *cos, *sin;
  const bool* mask;
};

struct LayerShape {
  int64_t heads, hd;
  double eps, scale, softcap;
};

// bf16(a + b), element by element, as torch's bf16 add rounds it
inline void add_rows(const uint16_t* a, const uint16_t* b, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = to_bf16(from_bf16(a[i]) + from_bf16(b[i]));
}

// x [n, d] bf16 -> out [n, d] bf16, the rows after the layer; this layer's k and v into the cache
inline void decoder_layer_rows(const uint16_t* x, int64_t n, int64_t d, const LayerWeights& w, const LayerCache& cache,
                               const LayerPlace& at, const LayerShape& shape, uint16_t* out) {
  const MatrixRef* m = w.matrices;
  int64_t heads = shape.heads, hd = shape.hd, kv = cache.kv_heads, ffn = m[W_GATE].out;
  std::vector<uint16_t> h(n * d), q(n * heads * hd), k(n * kv * hd), v(n * kv * hd);
  // attention: q, k, v by head, rotated; k and v into the cache; each row's heads attend
  rms_norm_rows(x, n, d, w.attn_norm, shape.eps, h.data());
  product(m[WQ], h.data(), n, w.bq, q.data());
  product(m[WK], h.data(), n, w.bk, k.data());
  product(m[WV], h.data(), n, w.bv, v.data());
  std::vector<uint16_t> q_heads(heads * n * hd), k_heads(kv * n * hd);  // [H, n, hd]
  rope_heads(q.data(), heads, n, hd, hd, heads * hd, at.cos, at.sin, q_heads.data());
  rope_heads(k.data(), kv, n, hd, hd, kv * hd, at.cos, at.sin, k_heads.data());
  int64_t head_stride = cache.capacity * hd, layer_at = at.layer * kv * head_stride;
  uint16_t* keys = cache.keys + layer_at;
  uint16_t* values = cache.values + layer_at;
  for (int64_t i = 0; i < n; ++i) {
    int64_t slot = at.length + (at.offsets ? at.offsets[i] : i);
    for (int64_t head = 0; head < kv; ++head) {
      std::memcpy(keys + head * head_stride + slot * hd, k_heads.data() + (head * n + i) * hd, hd * sizeof(uint16_t));
      std::memcpy(values + head * head_stride + slot * hd, v.data() + (i * kv + head) * hd, hd * sizeof(uint16_t));
    }
    cache.slot_positions[slot] = at.positions[i];
  }
  std::vector<uint16_t> attended(n * heads * hd);  // [n, H, hd]
  attend_rows(q_heads.data(), heads, n, hd, keys, values, kv, at.length + at.span, head_stride, at.mask, shape.scale,
              shape.softcap, attended.data());
  std::vector<uint16_t> o(n * d), mid(n * d);
  product(m[WO], attended.data(), n, nullptr, o.data());
  add_rows(x, o.data(), n * d, mid.data());
  // the gated MLP
  rms_norm_rows(mid.data(), n, d, w.ffn_norm, shape.eps, h.data());
  std::vector<uint16_t> gate(n * ffn), up(n * ffn);
  product(m[W_GATE], h.data(), n, nullptr, gate.data());
  product(m[W_UP], h.data(), n, nullptr, up.data());
  swiglu(gate.data(), up.data(), n * ffn, gate.data());
  product(m[W_DOWN], gate.data(), n, nullptr, o.data());
  add_rows(mid.data(), o.data(), n * d, out);
}

}  // namespace lever
