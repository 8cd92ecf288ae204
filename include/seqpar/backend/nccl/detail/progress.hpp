// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL transport: the checks every call makes (not aborted, no asynchronous error, the
// oldest unfinished operation younger than the timeout), one order per transport across streams, and
// the waits under the deadline (an enqueue of a non-blocking communicator, a host wait).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <string>

#include "seqpar/backend/nccl/detail/failure.hpp"
#include "seqpar/backend/nccl/detail/nccl_support.hpp"
#include "seqpar/backend/nccl/detail/state.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::backend::nccl::detail {

/// The communicator is usable: not aborted, no asynchronous error, and the oldest operation not yet
/// seen complete was enqueued less than the timeout ago. Returns `s`.
inline State& usable(State& s, const char* op) {
  if (!s.aborted.empty())
    throw Error(Errc::kTransport, who(s) + ": " + op + ": the communicator was aborted earlier (" + s.aborted +
                                      "); bootstrap a new Transport");
  ncclResult_t async = ncclSuccess;
  if (ncclCommGetAsyncError(s.comm, &async) != ncclSuccess) async = ncclInternalError;
  if (async != ncclSuccess && async != ncclInProgress) fail_async(s, async, op);
  if (s.watching) {
    const cudaError_t q = cudaEventQuery(s.watch.get());
    if (q == cudaSuccess) {
      s.watching = false;
    } else if (q != cudaErrorNotReady) {
      fail_cuda(s, q, "cudaEventQuery", op);
    } else if (Clock::now() - s.watch_since >= s.timeout) {
      const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - s.watch_since).count();
      const std::string why = who(s) + ": " + op + ": an earlier " + s.watch_op + with_peer(s.watch_peer, -1) +
                              " enqueued " + std::to_string(ago) + " ms ago has not completed (timeout " +
                              std::to_string(s.timeout.count()) + " ms): a peer did not take part";
      abort_comm(s, why);
      throw Error(Errc::kTimeout, why + "; the communicator was aborted");
    }
  }
  return s;
}

/// Starts watching the operation just enqueued unless an older one is still watched.
inline void arm(State& s, cudaStream_t stream, const char* op, int peer = -1) {
  if (s.watching) return;
  if (cudaEventRecord(s.watch.get(), stream) != cudaSuccess) {
    (void)cudaGetLastError();
    return;  // progress is still checked by the next host wait
  }
  s.watching = true;
  s.watch_since = Clock::now();
  s.watch_op = op;
  s.watch_peer = peer;
}

/// One order per transport whatever stream each call uses: an operation on a stream other than the
/// last one's first waits for the last one (an event: no host wait; valid after that stream is gone).
inline void follow_tail(State& s, cudaStream_t stream, const char* op) {
  if (s.tail_on == nullptr || s.tail_on == stream) return;
  cuda_check(s, cudaStreamWaitEvent(stream, s.tail.get(), 0), "cudaStreamWaitEvent", op);
  s.tail_on = nullptr;  // `stream` now carries the order until the next record_tail
}
inline void record_tail(State& s, cudaStream_t stream, const char* op) {
  cuda_check(s, cudaEventRecord(s.tail.get(), stream), "cudaEventRecord", op);
  s.tail_on = stream;
}

/// Waits on the host for everything enqueued on `stream` so far, under the deadline.
template <class What>
void host_wait(State& s, cudaStream_t stream, What&& what) {
  cuda_check(s, cudaEventRecord(s.done.get(), stream), "cudaEventRecord", "host wait");
  ncclResult_t async = ncclSuccess;
  cudaError_t q = cudaErrorNotReady;
  const bool finished = poll_until(Clock::now() + s.timeout, [&] {
    q = cudaEventQuery(s.done.get());
    if (q != cudaErrorNotReady) return true;
    if (ncclCommGetAsyncError(s.comm, &async) != ncclSuccess) async = ncclInternalError;
    return async != ncclSuccess && async != ncclInProgress;
  });
  if (q == cudaSuccess) {
    if (s.watching && cudaEventQuery(s.watch.get()) == cudaSuccess) s.watching = false;  // maybe on another stream
    return;
  }
  if (!finished) {
    std::string why = who(s) + ": " + what() + " timed out after " + std::to_string(s.timeout.count()) +
                      " ms (a peer did not take part, or the queue is stalled; NCCL cannot tell which peer)";
    if (s.watching) {
      const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - s.watch_since).count();
      why += "; the oldest unfinished operation is " + std::string(s.watch_op) + with_peer(s.watch_peer, -1) +
             ", enqueued " + std::to_string(ago) + " ms ago";
    }
    abort_comm(s, why);
    throw Error(Errc::kTimeout, why + "; the communicator was aborted");
  }
  if (q != cudaErrorNotReady) fail_cuda(s, q, "cudaEventQuery", what().c_str());
  fail_async(s, async, what().c_str());
}

/// Polls an enqueue that returned ncclInProgress (non-blocking communicator) until it is done.
template <class What>
void settle(State& s, ncclResult_t rc, What&& what) {
  if (rc != ncclSuccess && rc != ncclInProgress) fail_nccl(s, rc, what(), -1, -1);
  ncclResult_t state = rc;
  if (state == ncclSuccess && ncclCommGetAsyncError(s.comm, &state) != ncclSuccess) state = ncclInternalError;
  if (state == ncclInProgress) {
    const bool done = poll_until(Clock::now() + s.timeout, [&] {
      if (ncclCommGetAsyncError(s.comm, &state) != ncclSuccess) state = ncclInternalError;
      return state != ncclInProgress;
    });
    if (!done) {
      const std::string why =
          who(s) + ": enqueueing " + what() + " timed out after " + std::to_string(s.timeout.count()) + " ms";
      abort_comm(s, why);
      throw Error(Errc::kTimeout, why + "; the communicator was aborted");
    }
  }
  if (state != ncclSuccess) fail_async(s, state, what().c_str());
}

/// ncclGroupStart, failing on `what()`.
template <class What>
void group_start(State& s, What&& what) {
  if (const ncclResult_t rc = ncclGroupStart(); rc != ncclSuccess) fail_nccl(s, rc, what(), -1, -1);
}

}  // namespace seqpar::backend::nccl::detail
