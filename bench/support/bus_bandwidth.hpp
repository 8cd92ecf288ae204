// SPDX-License-Identifier: Apache-2.0
// Algorithm and bus bandwidth of a collective as nccl-tests report them (nccl-tests, PERFORMANCE.md),
// so that bench/transport_nccl's figures read against nccl-tests' and NCCL's published ones.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace seqpar::bench {

enum class Collective {
  kAllToAll,   ///< all_to_all(_v): every rank sends `bytes` in all (one block per rank, its own included)
  kAllGather,  ///< all_gather(_v): every rank receives `bytes` in all (its own block included)
  kSendRecv,   ///< one message of `bytes` per rank (a ring step: send to rank+1, receive from rank-1)
};

/// GB/s (1e9 bytes per second) of one operation of `bytes` per rank on `ranks` ranks taking `seconds`.
struct Bandwidth {
  double algbw = 0;  ///< bytes / seconds
  double busbw = 0;  ///< algbw * factor: what each link carries, comparable across rank counts
};

/// nccl-tests' bus factor: (n - 1) / n for all-to-all and all-gather (a rank's own block never
/// crosses a link), 1 for send/recv.
[[nodiscard]] inline double bus_factor(Collective c, int ranks) {
  if (ranks < 1) throw std::invalid_argument("bus_factor: ranks = " + std::to_string(ranks) + ": must be >= 1");
  return c == Collective::kSendRecv ? 1.0 : double(ranks - 1) / double(ranks);
}

/// algbw = bytes / seconds (nccl-tests' S / t, S the size of a rank's whole buffer), busbw = algbw *
/// bus_factor.
[[nodiscard]] inline Bandwidth bandwidth(Collective c, std::size_t bytes, int ranks, double seconds) {
  if (!(seconds > 0)) throw std::invalid_argument("bandwidth: seconds = " + std::to_string(seconds) + ": must be > 0");
  const double algbw = double(bytes) / seconds / 1e9;
  return {algbw, algbw * bus_factor(c, ranks)};
}

}  // namespace seqpar::bench
