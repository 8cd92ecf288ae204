// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL transport: all_to_all and all_to_all_v, one group of ncclSend/ncclRecv per
// call (one pair per peer with a block), the block to self a device copy.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <numeric>
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

/// all_to_all and all_to_all_v: one group of ncclSend/ncclRecv, the block to self a device copy.
inline void exchange(State& st, std::string_view where, const char* op, std::span<const std::byte> s,
                     std::span<const std::size_t> send_counts, std::span<std::byte> r,
                     std::span<const std::size_t> recv_counts) {
  const auto me = static_cast<std::size_t>(st.rank);
  seqpar::detail::require(send_counts[me] == recv_counts[me], where, "send_counts[rank()]", send_counts[me],
                          "must equal recv_counts[rank()] = " + std::to_string(recv_counts[me]));
  require_disjoint(where, s, r);
  usable(st, op);
  flush(st);
  const Placement pl = place(st, where, s, r);
  const auto what = [op] { return std::string(op) + " with the ranks of the communicator"; };
  if (send_counts[me] != 0) {
    const std::size_t from = std::accumulate(send_counts.begin(), send_counts.begin() + st.rank, std::size_t{0});
    const std::size_t to = std::accumulate(recv_counts.begin(), recv_counts.begin() + st.rank, std::size_t{0});
    cuda_check(st, cudaMemcpyAsync(pl.out + to, pl.in + from, send_counts[me], cudaMemcpyDeviceToDevice, pl.stream),
               "cudaMemcpyAsync", op);
  }
  std::size_t send_at = 0, recv_at = 0;
  bool grouped = false;
  for (std::size_t p = 0; p < send_counts.size(); ++p) {
    const std::size_t sc = send_counts[p], rc = recv_counts[p];
    if (p != me && (sc != 0 || rc != 0)) {
      if (!grouped) group_start(st, what), grouped = true;
      const int peer = static_cast<int>(p);
      ncclResult_t res = ncclSuccess;
      if (sc != 0) res = ncclSend(pl.in + send_at, sc, ncclUint8, peer, st.comm, pl.stream);
      if ((res == ncclSuccess || res == ncclInProgress) && rc != 0)
        res = ncclRecv(pl.out + recv_at, rc, ncclUint8, peer, st.comm, pl.stream);
      if (res != ncclSuccess && res != ncclInProgress) {
        (void)ncclGroupEnd();
        fail_nccl(st, res, op, peer, -1);
      }
    }
    send_at += sc, recv_at += rc;
  }
  if (grouped) {
    settle(st, ncclGroupEnd(), what);
    arm(st, pl.stream, op);
  }
  if (grouped || send_counts[me] != 0) record_tail(st, pl.stream, op);
  finish(st, pl, r, what);
  for (std::size_t dst = 0; dst < send_counts.size(); ++dst) count_block(st, static_cast<int>(dst), send_counts[dst]);
}

/// Equal blocks: block i of `s` (s.size() / size bytes) goes to rank i; block i of `r` comes from rank i.
inline void all_to_all(State& st, std::span<const std::byte> s, std::span<std::byte> r) {
  constexpr std::string_view where = "nccl::Transport::all_to_all";
  const auto n = static_cast<std::size_t>(st.size);
  seqpar::detail::require_equal_blocks(where, s.size(), r.size(), st.size);
  st.counts.assign(n, s.size() / n);
  exchange(st, where, "all_to_all", s, st.counts, r, st.counts);
}

/// Variable blocks: send_counts[i] bytes go to rank i, recv_counts[i] bytes come from rank i.
inline void all_to_all_v(State& st, std::span<const std::byte> s, std::span<const std::size_t> send_counts,
                         std::span<std::byte> r, std::span<const std::size_t> recv_counts) {
  constexpr std::string_view where = "nccl::Transport::all_to_all_v";
  require_counts(where, "send_counts", send_counts, "s.size()", s.size(), st.size);
  require_counts(where, "recv_counts", recv_counts, "r.size()", r.size(), st.size);
  exchange(st, where, "all_to_all_v", s, send_counts, r, recv_counts);
}

}  // namespace seqpar::backend::nccl::detail
