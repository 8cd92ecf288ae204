// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <memory>

#include "seqpar/core/detail/thread_pool.hpp"
#include "seqpar/core/exec.hpp"

namespace seqpar {

/// The host execution context: a persistent fork-join thread pool (the caller is thread 0). Work
/// issued on it has finished when the call returns (`kHostSynchronous`), so `synchronize()` has
/// nothing to wait for. Copies share the pool: a kernel, the executor and the engine of one rank
/// hand one context around by value. Runs on one pool are serialised; one rank, one pool.
///
/// @code
/// seqpar::HostExec exec(2);                         // 2 threads, the caller included
/// attention::CpuFlash<float> flash;
/// flash.forward(exec, shape, q, k, v, slices, o, lse, workspace);
/// @endcode
class HostExec {
 public:
  using exec_category = exec_tag;
  static constexpr bool kHostSynchronous = true;

  /// `threads` workers including the caller (clamped to >= 1); 1 runs everything inline.
  explicit HostExec(int threads = 1) : pool_(std::make_shared<detail::ThreadPool>(threads)) {}

  [[nodiscard]] int threads() const noexcept { return pool_->size(); }

  /// Calls fn(t) once on each of threads() threads and returns when all have returned (fn must not
  /// throw; collect errors yourself).
  template <class F>
  void parallel(F& fn) const {
    pool_->run(fn);
  }

  void synchronize() const noexcept {}

 private:
  std::shared_ptr<detail::ThreadPool> pool_;
};

static_assert(ExecutionContext<HostExec>);

}  // namespace seqpar
