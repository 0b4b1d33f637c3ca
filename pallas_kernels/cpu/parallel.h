// Work split over the calling thread and helper threads, for the FFI handlers (ffi.cc, attention.cc).
//
// Why a pool of our own and not XLA's intra-op pool (xla::ffi::ThreadPool): a decode step calls the
// kernels ~150 times, 20-60 us apart, and a helper on XLA's pool is asleep by the next call. Waking it
// (futex, and on a VM an interrupt to the other vCPU) costs ~10 us a call, so two threads ran the
// SmolLM2 decode step's products only 1.4x faster than one. Here the helpers spin for a while after
// each job (llama.cpp's threads do the same between operations) and sleep only after kSpinNs without
// work, so within a step the next call finds them awake.
//
// No oversubscription: max_threads() - 1 helpers, the caller being the last thread; a spinning helper
// offers its core every few microseconds (sched_yield) and sleeps past its spin. Callers from several
// threads at once are safe: one caller holds the pool at a time, the others run their units alone (same
// bits: the split never changes a result). STRATA_CPU_POOL=xla uses XLA's intra-op pool instead (for comparison).
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace strata {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Threads a call may use: the CPUs this process may run on, or STRATA_CPU_THREADS if set. The caller
// + helpers = this many, never more.
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

inline bool use_xla_pool() {
  static const bool xla = [] {
    const char* env = std::getenv("STRATA_CPU_POOL");
    return env != nullptr && std::strcmp(env, "xla") == 0;
  }();
  return xla;
}

class SpinPool {
 public:
  // How long a helper looks for the next job before it sleeps: longer than the gap between two calls
  // of a decode step (the XLA operations between them), short enough to give the core back soon after.
  static constexpr int64_t kSpinNs = 300'000;

  static SpinPool& get() {
    static SpinPool* pool = new SpinPool(max_threads() - 1);   // never destroyed: helpers run until exit
    return *pool;
  }

  int helpers() const { return (int)threads_.size(); }

  // Runs work(u) for every u in [0, units) on the caller and up to `helpers` helpers; returns when all
  // are done. Units are taken from a counter, so a helper that joins late only takes what is left.
  template <class F>
  void run(int64_t units, int helpers, F& work) {
    std::unique_lock<std::mutex> mine(busy_, std::try_to_lock);
    if (!mine.owns_lock() || helpers <= 0 || threads_.empty()) {   // another caller has the pool
      for (int64_t u = 0; u < units; u++) work(u);
      return;
    }
    fn_ = [](void* ctx, int64_t u) { (*static_cast<F*>(ctx))(u); };
    ctx_ = &work;
    units_ = units;
    wanted_ = std::min<int>(helpers, (int)threads_.size());
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    seats_.store(0, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_seq_cst);                 // odd: a job is open
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(sleep_);
      wake_.notify_all();
    }
    int64_t mine_done = take_units();
    while (done_.load(std::memory_order_acquire) + mine_done < units_) cpu_relax();
    gen_.fetch_add(1, std::memory_order_seq_cst);                 // even: closed
    while (inside_.load(std::memory_order_seq_cst) > 0) cpu_relax();   // helpers still reading the job
  }

 private:
  explicit SpinPool(int n) {
    for (int i = 0; i < n; i++) threads_.emplace_back([this] { helper(); });
    for (auto& t : threads_) t.detach();
  }

  int64_t take_units() {
    int64_t n = 0;
    for (int64_t u; (u = next_.fetch_add(1, std::memory_order_relaxed)) < units_; n++) fn_(ctx_, u);
    return n;
  }

  void helper() {
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      wait_for_job(seen);
      inside_.fetch_add(1, std::memory_order_seq_cst);
      uint64_t g = gen_.load(std::memory_order_seq_cst);
      seen = g;
      // Only `wanted_` helpers join a job (a small call asks for fewer than the pool has).
      if ((g & 1) && seats_.fetch_add(1, std::memory_order_relaxed) < wanted_) {
        int64_t n = take_units();
        done_.fetch_add(n, std::memory_order_release);
      }
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void wait_for_job(uint64_t seen) {
    auto open = [&] {
      uint64_t g = gen_.load(std::memory_order_acquire);
      return g != seen && (g & 1);
    };
    auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; spins++) {
      if (open()) return;
      cpu_relax();
      // Every 64 spins (a few us) the core goes to any other thread that wants it: the engine's own
      // threads (XLA's operations between the calls, the engine thread planning the next window) would
      // otherwise wait for a spinning helper's time slice. SmolLM2 decode at one sequence, 2 cores:
      // 6.2 -> 5.35 ms a token (no cost at one call: the decode chain's products 3.99 -> 4.04 ms).
      if ((spins & 63) == 63) sched_yield();
      if ((spins & 255) == 255 && std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(kSpinNs))
        break;
    }
    std::unique_lock<std::mutex> lk(sleep_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    wake_.wait(lk, open);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  std::vector<std::thread> threads_;
  std::mutex busy_;                          // held by the one caller whose job is open
  std::atomic<uint64_t> gen_{0};             // odd while a job is open
  std::atomic<int> inside_{0}, sleepers_{0}, seats_{0};
  std::atomic<int64_t> next_{0}, done_{0};
  // The open job, written by its caller before gen_ turns odd, read by helpers after they see it odd.
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int64_t units_ = 0;
  int wanted_ = 0;
  std::mutex sleep_;
  std::condition_variable wake_;
};

// Runs work(u) for u in [0, units) over the caller and `helpers` helpers (SpinPool; XLA's pool with
// STRATA_CPU_POOL=xla, where helpers that start late, or never, find the counter spent and return).
template <class F>
inline void parallel_units(xla::ffi::ThreadPool& pool, int64_t units, int helpers, F&& work) {
  if (helpers <= 0 || units <= 1) {
    for (int64_t u = 0; u < units; u++) work(u);
    return;
  }
  if (!use_xla_pool()) {
    SpinPool::get().run(units, helpers, work);
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
  while (st->done.load(std::memory_order_acquire) < units) cpu_relax();
}

// Helpers a call may ask for: bounded by the threads this process may use (the pool has one fewer).
inline int helper_threads(xla::ffi::ThreadPool& pool) {
  return use_xla_pool() ? std::min<int>(max_threads() - 1, pool.num_threads()) : max_threads() - 1;
}

}  // namespace strata
