// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL transport: barrier, a one-word ncclAllReduce on the transport's own stream,
// waited for on the host under the deadline.
#pragma once

#include <nccl.h>

#include <string>

#include "seqpar/backend/nccl/detail/point_to_point.hpp"
#include "seqpar/backend/nccl/detail/progress.hpp"
#include "seqpar/backend/nccl/detail/state.hpp"

namespace seqpar::backend::nccl::detail {

/// Returns once every rank of the communicator has entered it (NCCL orders the all-reduce after this
/// communicator's earlier operations, on any stream).
inline void barrier(State& st) {
  State& s = usable(st, "barrier");
  flush(s);
  const auto what = [] { return std::string("barrier with the ranks of the communicator"); };
  follow_tail(s, s.own.get(), "barrier");
  settle(s, ncclAllReduce(s.word, s.word, 1, ncclUint32, ncclMax, s.comm, s.own.get()), what);
  record_tail(s, s.own.get(), "barrier");
  host_wait(s, s.own.get(), what);
}

}  // namespace seqpar::backend::nccl::detail
