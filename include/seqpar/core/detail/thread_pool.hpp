// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace seqpar::detail {

/// Persistent fork-join pool: `run(fn)` calls fn(t) once on each of `size()` threads (the caller is
/// thread 0) and returns when all calls have returned. Workers sleep on a condition variable between
/// runs (no spinning: the CPU is often shared). Runs are serialised; fn must not throw.
class ThreadPool {
 public:
  explicit ThreadPool(int threads) : size_(threads < 1 ? 1 : threads) {
    workers_.reserve(static_cast<std::size_t>(size_ - 1));
    for (int t = 1; t < size_; ++t) workers_.emplace_back([this, t] { loop(t); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      ++generation_;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  [[nodiscard]] int size() const noexcept { return size_; }

  template <class F>
  void run(F& fn) {
    if (size_ == 1) {
      fn(0);
      return;
    }
    std::lock_guard serial(run_mutex_);
    {
      std::lock_guard lock(mutex_);
      job_ = &invoke<F>;
      context_ = &fn;
      pending_ = size_ - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(0);
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  template <class F>
  static void invoke(void* context, int thread) noexcept {
    (*static_cast<F*>(context))(thread);
  }

  void loop(int thread) {
    std::uint64_t seen = 0;
    for (;;) {
      void (*job)(void*, int) noexcept = nullptr;
      void* context = nullptr;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
        job = job_;
        context = context_;
      }
      job(context, thread);
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  int size_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  void (*job_)(void*, int) noexcept = nullptr;
  void* context_ = nullptr;
};

}  // namespace seqpar::detail
