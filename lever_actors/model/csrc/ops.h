// The ops every kernels' source defines, registered once: attention, RMS norm and rotary
// embedding as the headers have them, the q6k product, and the int4, int8 and q4k products
// each source passes in (its own, on tiles or on vectors). A source's TORCH_LIBRARY calls
// `define_ops`, then defines what only it has.
#pragma once

#include <torch/library.h>

#include "attention.h"
#include "integer_rows.h"
#include "norm.h"
#include "rope.h"

namespace lever {

template <typename Int4, typename Int8, typename Q4k>
void define_ops(torch::Library& m, Int4* int4, Int8* int8, Q4k* q4k) {
  m.def("attend", &attend);
  m.def("rms_norm", &rms_norm);
  m.def("rope", &rope);
  m.def("int4_linear", int4);
  m.def("int8_linear", int8);
  m.def("q6k_linear", &q6k_linear);
  m.def("q4k_linear", q4k);
}

}  // namespace lever
