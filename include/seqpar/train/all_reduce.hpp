// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::train {

/// Replaces `values` on every rank of `transport` by their sum over the ranks (gradients of replicated
/// parameters, loss totals). Reduce-scatter (one all_to_all_v: rank r receives every rank's r-th
/// chunk) then all_gather_v: each rank sends and receives about 2 * values.size() elements, like a
/// ring all-reduce. Each chunk is summed in rank order, 0 first, by exactly one rank and then copied,
/// so every rank ends with the same bits whatever the transport: ranks holding replicated
/// parameters stay identical after an optimizer step. Call it on every rank with the same size.
template <Transport Tr, class T>
requires std::is_arithmetic_v<T>
void all_reduce_sum(Tr& transport, std::span<T> values) {
  const int p = transport.size(), me = transport.rank();
  const std::size_t n = values.size();
  // Sizes must agree: a rank with a different count would exchange misaligned chunks.
  std::vector<std::uint64_t> sizes(static_cast<std::size_t>(p));
  const std::uint64_t mine = n;
  transport.all_gather(as_bytes_of(std::span<const std::uint64_t>(&mine, 1)), as_writable_bytes_of(std::span(sizes)));
  if (std::any_of(sizes.begin(), sizes.end(), [&](std::uint64_t s) { return s != mine; })) {
    std::string all;  // the same message on every rank, whichever rank's error is reported
    for (const std::uint64_t s : sizes) all += (all.empty() ? "" : ", ") + std::to_string(s);
    throw Error(Errc::kMismatch,
                "train::all_reduce_sum: ranks disagree on the number of values: " + all + " (rank order)");
  }
  if (p == 1 || n == 0) return;
  const auto pu = static_cast<std::size_t>(p);
  const auto begin = [&](std::size_t r) { return n * r / pu; };  // chunk r: [begin(r), begin(r + 1))
  std::vector<std::size_t> send_counts(pu), recv_counts(pu), gather_counts(pu);
  const std::size_t my_len = begin(static_cast<std::size_t>(me) + 1) - begin(static_cast<std::size_t>(me));
  for (std::size_t r = 0; r < pu; ++r) {
    send_counts[r] = sizeof(T) * (begin(r + 1) - begin(r));
    recv_counts[r] = sizeof(T) * my_len;
    gather_counts[r] = send_counts[r];
  }
  std::vector<T> parts(pu * my_len);  // every rank's copy of my chunk, rank order
  transport.all_to_all_v(as_bytes_of(std::span<const T>(values)), send_counts, as_writable_bytes_of(std::span(parts)),
                         recv_counts);
  std::vector<T> sum(my_len, T{});
  for (std::size_t r = 0; r < pu; ++r)
    for (std::size_t i = 0; i < my_len; ++i) sum[i] += parts[r * my_len + i];
  transport.all_gather_v(as_bytes_of(std::span<const T>(sum)), as_writable_bytes_of(values), gather_counts);
}

}  // namespace seqpar::train
