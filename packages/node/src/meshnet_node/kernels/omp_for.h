// meshnet::parallel_for: at::parallel_for's split of a range over the calling thread's
// OpenMP team, without its lazy thread-count initialisation (docs/adr/0036, amendment of
// 2026-12-05).
//
// at::parallel_for first calls at::internal::lazy_init_num_threads(), an inline function
// with a thread_local "done" flag. Built into this extension, that flag is this library's
// own copy, not libtorch's: the first product a node's compute thread ran here re-set that
// thread's count to torch's process-wide default, which the node sets to 1 for every other
// thread, so every kernel of this library (int4, int8, FP8, MXFP4, bf16 products) and every
// torch op after it computed on one thread (measured: SmolLM2 Q4_1 on one 2-core process,
// 30 instead of 44 tokens/s). Here the team is the calling thread's own count,
// omp_get_max_threads(), as set by torch.set_num_threads on that thread.
//
// Same chunks as at::parallel_for: at most one chunk per thread, ceil(range / threads)
// long, the last shorter; inline when the range is one grain or less, or already inside a
// parallel region. Every kernel here sums each output within one chunk, so the split never
// changes a value.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace meshnet {

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t range = end - begin;
  const int64_t grains = grain > 0 ? (range + grain - 1) / grain : range;
  const int64_t threads =
      omp_in_parallel() ? 1 : std::min<int64_t>(omp_get_max_threads(), grains);
  if (threads <= 1) {
    f(begin, end);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t team = omp_get_num_threads();
    const int64_t chunk = (range + team - 1) / team;
    const int64_t first = begin + omp_get_thread_num() * chunk;
    if (first < end) f(first, std::min(end, first + chunk));
  }
}

}  // namespace meshnet
