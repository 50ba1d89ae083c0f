// The thread pool the native kernels (qgemv.cpp, dense.cpp) split output rows over.
#pragma once

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

// Workers spin briefly after each job (a decode step issues hundreds of small GEMVs back to
// back), then sleep on a condition variable so an idle engine costs no CPU.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this, i] { loop(i); });
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
  // Runs job(part, parts) for part in [0, parts) and returns when all are done. Callers
  // on different MLX streams (threads) take turns: there is one job slot.
  void run(const std::function<void(int, int)>& job, int parts) {
    if (parts <= 1 || workers_.empty()) {
      job(0, 1);
      return;
    }
    parts = std::min(parts, size());
    std::lock_guard<std::mutex> turn(run_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      parts_ = parts;
      pending_.store(parts - 1);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job(0, parts);
    while (pending_.load(std::memory_order_acquire) != 0) {
      pause();
    }
  }

 private:
  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  void loop(int index) {
    uint64_t seen = 0;
    while (true) {
      uint64_t now = generation_.load(std::memory_order_acquire);
      for (int spin = 0; now == seen && spin < 4000; ++spin) {
        pause();
        now = generation_.load(std::memory_order_acquire);
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        now = generation_.load();
      }
      seen = now;
      const std::function<void(int, int)>* job;
      int parts;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stop_) {
          return;
        }
        job = job_;
        parts = parts_;
      }
      if (index < parts) {
        (*job)(index, parts);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int, int)>* job_ = nullptr;
  int parts_ = 0;
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

}  // namespace chatml
