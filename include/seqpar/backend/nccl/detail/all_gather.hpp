// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL transport: all_gather (ncclAllGather) and all_gather_v (one group of
// ncclBroadcast, one per rank with a block).
#pragma once

#include <nccl.h>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "seqpar/backend/nccl/detail/buffers.hpp"
#include "seqpar/backend/nccl/detail/failure.hpp"
#include "seqpar/backend/nccl/detail/point_to_point.hpp"
#include "seqpar/backend/nccl/detail/progress.hpp"
#include "seqpar/backend/nccl/detail/state.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::backend::nccl::detail {

/// Every rank contributes s.size() bytes; `r` (size * s.size() bytes) receives them in rank order.
inline void all_gather(State& st, std::span<const std::byte> s, std::span<std::byte> r) {
  constexpr std::string_view where = "nccl::Transport::all_gather";
  const auto n = static_cast<std::size_t>(st.size);
  seqpar::detail::require(r.size() == n * s.size(), where, "r.size()", r.size(),
                          "must equal size() * s.size() = " + std::to_string(n * s.size()));
  require_disjoint(where, s, r);
  usable(st, "all_gather");
  flush(st);
  if (s.empty()) return;
  const Placement p = place(st, where, s, r);
  const auto what = [] { return std::string("all_gather with the ranks of the communicator"); };
  settle(st, ncclAllGather(p.in, p.out, s.size(), ncclUint8, st.comm, p.stream), what);
  record_tail(st, p.stream, "all_gather");
  arm(st, p.stream, "all_gather");
  finish(st, p, r, what);
  for (int dst = 0; dst < st.size; ++dst) count_block(st, dst, s.size());
}

/// Rank i contributes recv_counts[i] bytes; `r` receives them contiguously in rank order.
inline void all_gather_v(State& st, std::span<const std::byte> s, std::span<std::byte> r,
                         std::span<const std::size_t> recv_counts) {
  constexpr std::string_view where = "nccl::Transport::all_gather_v";
  require_counts(where, "recv_counts", recv_counts, "r.size()", r.size(), st.size);
  seqpar::detail::require(
      recv_counts[static_cast<std::size_t>(st.rank)] == s.size(), where, "s.size()", s.size(),
      "must equal recv_counts[rank()] = " + std::to_string(recv_counts[static_cast<std::size_t>(st.rank)]));
  require_disjoint(where, s, r);
  usable(st, "all_gather_v");
  flush(st);
  if (r.empty()) return;
  const Placement p = place(st, where, s, r);
  const auto what = [] { return std::string("all_gather_v with the ranks of the communicator"); };
  group_start(st, what);
  std::size_t offset = 0;
  for (int root = 0; root < st.size; ++root) {
    const std::size_t count = recv_counts[static_cast<std::size_t>(root)];
    if (count != 0) {
      const void* from = root == st.rank ? static_cast<const void*>(p.in) : p.out + offset;
      const ncclResult_t rc = ncclBroadcast(from, p.out + offset, count, ncclUint8, root, st.comm, p.stream);
      if (rc != ncclSuccess && rc != ncclInProgress) {
        (void)ncclGroupEnd();
        fail_nccl(st, rc, "all_gather_v", root, -1);
      }
    }
    offset += count;
  }
  settle(st, ncclGroupEnd(), what);
  record_tail(st, p.stream, "all_gather_v");
  arm(st, p.stream, "all_gather_v");
  finish(st, p, r, what);
  for (int dst = 0; dst < st.size; ++dst) count_block(st, dst, s.size());
}

}  // namespace seqpar::backend::nccl::detail
