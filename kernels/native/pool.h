// The thread pool the native kernels (qgemv.cpp, dense.cpp) split output rows over.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace chatml {

// The thread's floating-point mode where one matters: MXCSR on x86, whose FTZ and DAZ bits say
// whether subnormals are flushed to zero (kernels/subnormals.py sets them on the engine's
// threads). Workers run each job in its caller's mode, whichever thread started the pool.
inline unsigned fp_mode() {
#if defined(__x86_64__) || defined(_M_X64)
  return _mm_getcsr() & ~0x3Fu;  // less the exception flags, which the work itself sets
#else
  return 0;
#endif
}

inline void set_fp_mode(unsigned mode) {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_setcsr((_mm_getcsr() & 0x3Fu) | mode);
#else
  (void)mode;
#endif
}

// Workers spin briefly after each job (a decode step issues hundreds of small GEMVs back to
// back), then sleep on a condition variable so an idle engine costs no CPU.
//
// Parts are claimed, not assigned: the caller and every worker that is awake take the next
// unclaimed part until none is left. A worker the OS has parked (a busy machine, a sleeping
// worker slow to wake) then costs the caller one more part of work instead of a wait for
// that worker's next time slice. A claim names the job's generation, so a worker that wakes
// late for a finished job claims nothing from the next one.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this] { loop(); });
    }
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : workers_) {
      t.join();
    }
  }
  int size() const {
    return static_cast<int>(workers_.size()) + 1;
  }
  // Runs job(part, parts) for part in [0, parts) and returns when all are done. More parts
  // than threads balance the load: whoever is free claims the next. Callers
  // on different MLX streams (threads) take turns: there is one job slot.
  void run(const std::function<void(int, int)>& job, int parts) {
    if (parts <= 1 || workers_.empty()) {
      job(0, 1);
      return;
    }
    std::lock_guard<std::mutex> turn(run_mutex_);
    uint32_t generation;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation = static_cast<uint32_t>(generation_.load() + 1);
      job_ = &job;
      parts_ = parts;
      mode_ = fp_mode();
      done_.store(0);
      claim_.store(pack(generation, 0), std::memory_order_release);
      generation_.store(generation, std::memory_order_release);
    }
    wake_.notify_all();
    int finished = work(job, parts, generation);
    while (done_.load(std::memory_order_acquire) + finished != parts) {
      pause();
    }
  }

 private:
  static uint64_t pack(uint32_t generation, uint32_t next) {
    return (static_cast<uint64_t>(generation) << 32) | next;
  }
  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  // Claims and runs parts of job `generation` until none is left; returns how many it ran.
  int work(const std::function<void(int, int)>& job, int parts, uint32_t generation) {
    int ran = 0;
    uint64_t seen = claim_.load(std::memory_order_acquire);
    while (true) {
      const uint32_t next = static_cast<uint32_t>(seen);
      if (static_cast<uint32_t>(seen >> 32) != generation || next >= static_cast<uint32_t>(parts)) {
        return ran;
      }
      if (claim_.compare_exchange_weak(seen, pack(generation, next + 1), std::memory_order_acq_rel)) {
        job(static_cast<int>(next), parts);
        ++ran;
        seen = claim_.load(std::memory_order_acquire);
      }
    }
  }
  void loop() {
    uint32_t seen = 0;
    while (true) {
      uint32_t now = generation_.load(std::memory_order_acquire);
      for (int spin = 0; now == seen && spin < 4000; ++spin) {
        pause();
        now = generation_.load(std::memory_order_acquire);
      }
      const std::function<void(int, int)>* job;
      int parts;
      unsigned mode;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (now == seen) {
          wake_.wait(lock, [&] { return generation_.load() != seen; });
        }
        if (stop_) {
          return;
        }
        now = generation_.load();
        job = job_;
        parts = parts_;
        mode = mode_;
      }
      seen = now;
      if (mode != fp_mode()) {
        set_fp_mode(mode);  // the job's floating-point mode is its caller's
      }
      if (int ran = work(*job, parts, now)) {
        done_.fetch_add(ran, std::memory_order_acq_rel);
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;  // job_, parts_ and generation_'s changes
  std::condition_variable wake_;
  std::atomic<uint32_t> generation_{0};
  std::atomic<uint64_t> claim_{0};  // (generation, next unclaimed part)
  std::atomic<int> done_{0};        // parts the workers have finished
  const std::function<void(int, int)>* job_ = nullptr;
  int parts_ = 0;
  unsigned mode_ = 0;  // the caller's fp_mode() for job_
  bool stop_ = false;
};

inline int default_threads() {
  if (const char* env = std::getenv("CHATML_GEMV_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) {
      return n;
    }
  }
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

// One pool for every kernel of the module (inline: one instance across translation units).
inline Pool& pool() {
  static Pool p(default_threads());
  return p;
}

// How many parts to cut a job that streams `bytes` of weights into: one below 64 KiB (not
// worth a wake-up), one a thread below 1 MiB, and above that four a thread, so a thread that
// starts late (a wake-up, the OS) does not leave the others waiting at the end.
inline int parts_for(size_t bytes) {
  if (bytes < (64u << 10)) {
    return 1;
  }
  return pool().size() * (bytes < (1u << 20) ? 1 : 4);
}

}  // namespace chatml
