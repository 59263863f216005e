// The kernels as a plain C library, built without torch (model/plain.py loads it with ctypes):
// the same headers as the torch ops, so the same bits, on buffers the caller owns. Every
// pointer is to contiguous elements; bf16 and float16 values travel as their 16 bits; a bias
// may be null. The shapes are checked by the caller.
#include <cstdint>

#include "attention.h"
#include "common.h"
#include "integer_rows.h"
#include "norm.h"
#include "q4k.h"
#include "rope.h"

using namespace lever;

extern "C" {

// bumped when a signature below changes, so that a stale library is never called
int lever_plain_abi(void) { return 1; }

// x [rows, width] bf16 times a q4k matrix: records [tasks, k / 256 * 1152] uint8, ds [tasks,
// k / 256 * 16] float16 (q4k.h) -> out [rows, tasks * 8] bf16 (+ bias [tasks * 8])
void lever_q4k(const uint16_t* x, int64_t rows, int64_t width, const uint8_t* records, const uint16_t* ds,
               int64_t tasks, int64_t k, const uint16_t* bias, uint16_t* out) {
  q4k_product(x, rows, width, records, ds, tasks, k, out);
  if (bias) add_bias(out, rows, tasks * Q4K_OUTPUTS, bias);
}

// x [rows, k] bf16 times a q6k matrix: data [n, k / 256 * 208] uint8, d [n, k / 256] float16
// -> out [rows, n] bf16 (+ bias [n])
void lever_q6k(const uint16_t* x, int64_t rows, int64_t k, const uint8_t* data, const uint16_t* d, int64_t n,
               const uint16_t* bias, uint16_t* out) {
  integer_product(x, rows, Q6KRows{data, d, k}, n, out);
  if (bias) add_bias(out, rows, n, bias);
}

// x [rows, k] bf16 times an int8 matrix [n, k] with row scales [n] bf16 -> out [rows, n] bf16
void lever_int8(const uint16_t* x, int64_t rows, int64_t k, const int8_t* weight, const uint16_t* scales, int64_t n,
                const uint16_t* bias, uint16_t* out) {
  integer_product(x, rows, Int8Rows{weight, scales, k}, n, out);
  if (bias) add_bias(out, rows, n, bias);
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

}  // extern "C"
