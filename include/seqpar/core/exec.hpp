// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The execution-context concept: where and in what order a rank's work runs.
///
/// Every operation of the runtime (kernel calls, pack / unpack of messages, zeroing, merging partial
/// results, transport calls) is issued *on* an execution context, as CUTLASS's `run(stream)` and
/// kokkos-comm's execution spaces do. A context is either host-synchronous (`kHostSynchronous`: an
/// operation has finished when its call returns; `HostExec`, a thread pool) or stream-ordered (a CUDA
/// compute stream + comm stream + events: operations are enqueued, `synchronize()` waits for them).
/// The executor calls `synchronize()` before handing a buffer to a transport that works on host
/// order (in-process, MPI), so a stream-ordered context composes with a host transport; a
/// stream-ordered transport (NCCL) is enqueued on the context instead.

#include <concepts>

namespace seqpar {

/// Opt-in tag of execution contexts.
struct exec_tag {};

template <class E>
concept ExecutionContext = std::derived_from<typename E::exec_category, exec_tag> && std::copy_constructible<E> &&
    requires(E& e) {
  { E::kHostSynchronous } -> std::convertible_to<bool>;
  e.synchronize();
};

/// A stream-ordered context that can drive a stream-ordered transport: its comm queue (what the
/// transport enqueues on, a cudaStream_t behind void*) and event orderings between the two queues.
template <class E>
concept StreamOrderedExec = ExecutionContext<E> && !E::kHostSynchronous && requires(const E& e) {
  { e.comm_queue() } -> std::convertible_to<void*>;
  e.comm_after_compute();
  e.compute_after_comm();
};

}  // namespace seqpar
