// The kernels as a plain C library, built without torch (model/plain.py loads it with ctypes):
// the same headers as the torch ops, so the same bits, on buffers the caller owns. Every
// pointer is to contiguous elements; bf16 and float16 values travel as their 16 bits; a bias
// may be null. The shapes are checked by the caller.
#include <cstdint>

#include "attention.h"
#include "common.h"
#include "activation.h"
#include "integer_rows.h"
#include "layer.h"
#include "norm.h"
#include "products.h"
#include "q4k.h"
#include "rope.h"

using namespace lever;

extern "C" {

// bumped when a signature below changes, so that a stale library is never called
int lever_plain_abi(void) { return 4; }

// x [rows, m.in] bf16 times the matrix m (+ bias [m.out] bf16, or null) -> out [rows, m.out]
// bf16 (products.h)
void lever_linear(const MatrixRef* m, const uint16_t* x, int64_t rows, const uint16_t* bias, uint16_t* out) {
  product(*m, x, rows, bias, out);
}

// x [rows, d] bf16, weight [d] bf16 -> out [rows, d] bf16 (norm.h)
void lever_rms_norm(const uint16_t* x, int64_t rows, int64_t d, const uint16_t* weight, double eps, uint16_t* out) {
  rms_norm_rows(x, rows, d, weight, eps, out);
}

// x [H, n, hd] bf16 (strides in elements), cos, sin [n, hd] bf16 -> out [H, n, hd] (rope.h)
void lever_rope(const uint16_t* x, int64_t heads, int64_t n, int64_t hd, int64_t head_stride, int64_t row_stride,
                const uint16_t* cos, const uint16_t* sin, uint16_t* out) {
  rope_heads(x, heads, n, hd, head_stride, row_stride, cos, sin, out);
}

// q [H, n, hd] bf16; keys, values [KV, T, hd] bf16, head h at h * stride; mask [n, T] or null
// -> out [n, H, hd] bf16 (attention.h)
void lever_attend(const uint16_t* q, int64_t heads, int64_t n, int64_t hd, const uint16_t* keys,
                  const uint16_t* values, int64_t kv_heads, int64_t length, int64_t stride, const bool* mask,
                  double scale, double softcap, uint16_t* out) {
  attend_rows(q, heads, n, hd, keys, values, kv_heads, length, stride, mask, scale, softcap, out);
}

// positions [n] int64, inv_freq [hd / 2] float32 -> cos, sin [n, hd] bf16 (rope.h)
void lever_rope_tables(const int64_t* positions, int64_t n, const float* inv_freq, int64_t half, uint16_t* cos,
                       uint16_t* sin) {
  rope_tables(positions, n, inv_freq, half, cos, sin);
}

// gate, up [count] bf16 -> out bf16(bf16(silu(gate)) * up) (activation.h)
void lever_swiglu(const uint16_t* gate, const uint16_t* up, int64_t count, uint16_t* out) {
  swiglu(gate, up, count, out);
}

// x [n, d] bf16 -> out [n, d] after one decoder layer (layer.h): the weights, cache, placement
// and shape as layer.h's structs
void lever_decoder_layer(const uint16_t* x, int64_t n, int64_t d, const LayerWeights* weights, const LayerCache* cache,
                         const LayerPlace* place, const LayerShape* shape, uint16_t* out) {
  decoder_layer_rows(x, n, d, *weights, *cache, *place, *shape, out);
}

}  // extern "C"
