// Work split over the calling thread and helpers on XLA's intra-op pool (xla::ffi::ThreadPool), for the
// FFI handlers (ffi.cc, attention.cc).
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace strata {

// Threads a call may use: the CPUs this process may run on, or STRATA_CPU_THREADS if set. XLA:CPU
// calls a custom call from its executing thread, so caller + helpers = this many, never more.
inline int max_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("STRATA_CPU_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) return v;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
    return (int)std::max(1u, std::thread::hardware_concurrency());
  }();
  return n;
}

// Runs work(u) for u in [0, units). Helpers that start late (or never: the pool may run a task in
// the caller or not at all before the caller is done) find the counter spent and return without
// touching `work`; the caller waits only for units some thread has taken.
template <class F>
inline void parallel_units(xla::ffi::ThreadPool& pool, int64_t units, int helpers, F&& work) {
  if (helpers <= 0 || units <= 1) {
    for (int64_t u = 0; u < units; u++) work(u);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto st = std::make_shared<State>();
  auto* fn = &work;
  auto loop = [units](State& s, F* f) {
    for (int64_t u; (u = s.next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      (*f)(u);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int h = 0; h < helpers; h++) pool.Schedule([st, fn, loop] { loop(*st, fn); });
  loop(*st, fn);
  while (st->done.load(std::memory_order_acquire) < units) {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }
}

}  // namespace strata
