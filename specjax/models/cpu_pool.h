// The helper threads and scratch buffers of specjax's CPU kernels (q8block.cc, attention.cc); each
// kernel library has its own pool. Header-only, included by the kernel sources (the build key of
// specjax/models/kernels.py hashes it with them).
#pragma once

#include <immintrin.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

namespace specjax_cpu {

inline int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : dflt;
}

// helpers spin this long for the next call before they sleep on a condition variable (0: sleep at
// once; the calls that split take milliseconds, a wake-up microseconds)
inline const int64_t g_spin_us = env_int("SPECJAX_Q8_SPIN_US", 0);

// ------------------------------------------------------------------ the helper threads
// One call at a time splits its columns over the calling thread (part 0) and helpers 1..n-1; a call
// that finds the pool busy (another XLA thread's kernel) runs on its own thread. Helpers are created
// on first use and never destroyed (the pool is leaked, so no static destructor races a sleeping
// helper at exit); a forked child (its pid differs) builds a pool of its own.
class Pool {
 public:
  // fn(i) for i in [0, n): i = 0 on the calling thread; false (nothing run) if the pool is busy
  bool run(int n, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> lk(busy_, std::try_to_lock);
    if (!lk.owns_lock()) return false;
    const uint64_t now = gen_.load(std::memory_order_relaxed);  // only this call changes it (busy_)
    while (helpers_ + 1 < n) {
      const int id = ++helpers_;
      std::thread([this, id, now] { work(id, now); }).detach();
    }
    job_ = &fn;
    parts_ = n;
    pending_.store(helpers_, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> g(m_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0);
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
    return true;
  }

 private:
  void work(int id, uint64_t seen) {  // seen: the generation before the call that created it
    for (;;) {
      uint64_t g = gen_.load(std::memory_order_acquire);
      if (g == seen) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(g_spin_us);
        int k = 0;
        while ((g = gen_.load(std::memory_order_acquire)) == seen) {
          _mm_pause();
          if (++k % 64 == 0 && std::chrono::steady_clock::now() > until) {
            std::unique_lock<std::mutex> lk(m_);
            cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
          }
        }
      }
      seen = g;
      if (id < parts_) (*job_)(id);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex busy_, m_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{1};
  std::atomic<int> pending_{0};
  int helpers_ = 0;
  int parts_ = 0;
  const std::function<void(int)>* job_ = nullptr;
};

inline Pool& pool() {
  static std::mutex guard;
  static Pool* p = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> g(guard);
  if (p == nullptr || owner != getpid()) p = new Pool(), owner = getpid();
  return *p;
}

template <typename T>
struct AlignedBuf {  // grows only; 64-byte aligned
  T* p = nullptr;
  size_t n = 0;
  T* get(size_t want) {
    if (want > n) {
      std::free(p);
      size_t bytes = ((want * sizeof(T)) + 63) & ~size_t(63);
      p = static_cast<T*>(std::aligned_alloc(64, bytes ? bytes : 64));
      n = want;
    }
    return p;
  }
  ~AlignedBuf() { std::free(p); }
};

}  // namespace specjax_cpu
