// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar::comm::detail {

/// [0, n) cut into k contiguous parts whose sizes differ by at most one (larger parts first).
[[nodiscard]] inline std::vector<Range> even_split(std::int64_t n, int k) {
  std::vector<Range> out(static_cast<std::size_t>(k));
  std::int64_t begin = 0;
  for (int i = 0; i < k; ++i) {
    const std::int64_t len = n / k + (i < n % k ? 1 : 0);
    out[static_cast<std::size_t>(i)] = {begin, begin + len};
    begin += len;
  }
  return out;
}

/// Which query and KV heads each of k ranks computes in a head-sharded (Ulysses) step.
/// With heads_kv >= k the KV heads are split (each moves to exactly one rank) and every query head
/// follows its KV head, so uneven counts are fine and nothing is replicated. With heads_kv < k the
/// query heads are split and each rank receives the KV heads its query heads read: a KV head is then
/// replicated on heads_q / heads_kv / ... ranks and its gradient is summed back at its owner.
struct HeadAssignment {
  std::vector<Range> q;
  std::vector<Range> kv;
  bool kv_replicated = false;
};

[[nodiscard]] inline HeadAssignment assign_heads(const AttentionShape& shape, int k) {
  HeadAssignment a;
  const int g = shape.group_size();
  if (shape.heads_kv >= k) {
    a.kv = even_split(shape.heads_kv, k);
    for (const Range& r : a.kv) a.q.push_back({r.begin * g, r.end * g});
  } else {
    a.kv_replicated = true;
    a.q = even_split(shape.heads_q, k);
    for (const Range& r : a.q) a.kv.push_back(r.empty() ? Range{0, 0} : Range{r.begin / g, (r.end - 1) / g + 1});
  }
  return a;
}

/// Kernel calls covering local query heads [0, |q|) over local KV heads [0, |kv|): one call when the
/// local heads keep the GQA structure, else one call per KV head.
[[nodiscard]] inline std::vector<HeadGroup> head_groups(Range q, Range kv, int group_size) {
  if (q.empty()) return {};
  if (q.begin == kv.begin * group_size && q.end == kv.end * group_size)
    return {HeadGroup{{0, q.size()}, {0, kv.size()}}};
  std::vector<HeadGroup> out;
  for (std::int64_t j = kv.begin; j < kv.end; ++j) {
    const Range qj = intersect(q, Range{j * group_size, (j + 1) * group_size});
    if (!qj.empty()) out.push_back({qj.shifted(-q.begin), Range{j - kv.begin, j - kv.begin + 1}});
  }
  return out;
}

}  // namespace seqpar::comm::detail
