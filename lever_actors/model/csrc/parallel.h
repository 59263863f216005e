// The kernels' one parallel loop: torch's thread pool where they are built as torch ops (one
// OpenMP team for the whole process), OpenMP's own where they are built as a plain library
// (model/plain.py). Every loop here splits work whose parts never share a sum, so how it is
// split changes no bit.
#pragma once

#include <algorithm>
#include <cstdint>

#ifdef LEVER_ATEN
#include <ATen/Parallel.h>
#else
#include <omp.h>
#endif

namespace lever {

// f(first, last) over [begin, end) in contiguous shares of at least `grain`, on the calling
// thread alone where the range is no longer than one grain
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#ifdef LEVER_ATEN
  at::parallel_for(begin, end, grain, f);
#else
  int64_t size = end - begin;
  if (size <= 0) return;
  int64_t most = (size + grain - 1) / grain;
  int64_t team = std::min<int64_t>(omp_get_max_threads(), most);
  if (team <= 1 || omp_in_parallel()) {
    f(begin, end);
    return;
  }
#pragma omp parallel num_threads(team)
  {
    int64_t threads = omp_get_num_threads();  // the runtime may give fewer than asked
    int64_t share = (size + threads - 1) / threads, first = begin + omp_get_thread_num() * share;
    if (first < end) f(first, std::min(end, first + share));
  }
#endif
}

}  // namespace lever
