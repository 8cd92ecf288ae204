// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <ostream>
#include <span>
#include <vector>

#include "seqpar/core/detail/saturating.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar {

enum class MaskKind : std::uint8_t {
  kFull,           ///< every key of k_range is visible to every query of q_range
  kCausal,         ///< key kj visible to query qi iff kj <= qi + causal_offset
  kSlidingWindow,  ///< causal, and additionally kj > qi + causal_offset - window
};

/// Mask of one slice, in slice-relative coordinates (qi = i - q_range.begin, kj = j - k_range.begin).
/// `causal_offset` is the explicit alignment of the diagonal: a query block that sits `a` tokens
/// after the start of its keys has causal_offset = a. Shifting both ranges by the same amount (global
/// indices -> local buffer rows) keeps the mask, which is why it is expressed relative to the ranges.
struct Mask {
  MaskKind kind = MaskKind::kCausal;
  std::int64_t causal_offset = 0;
  std::int64_t window = 0;  ///< only for kSlidingWindow: number of visible keys ending at the diagonal, >= 1

  [[nodiscard]] static constexpr Mask full() noexcept { return {MaskKind::kFull, 0, 0}; }
  [[nodiscard]] static constexpr Mask causal(std::int64_t offset = 0) noexcept {
    return {MaskKind::kCausal, offset, 0};
  }
  [[nodiscard]] static constexpr Mask sliding_window(std::int64_t window, std::int64_t offset = 0) noexcept {
    return {MaskKind::kSlidingWindow, offset, window};
  }
  friend constexpr bool operator==(const Mask&, const Mask&) = default;

  /// Visible keys of query row qi, as a slice-relative range clipped to [0, k_len).
  [[nodiscard]] constexpr Range visible_keys(std::int64_t qi, std::int64_t k_len) const noexcept {
    if (kind == MaskKind::kFull) return {0, k_len};
    const std::int64_t hi = std::clamp<std::int64_t>(qi + causal_offset + 1, 0, k_len);
    const std::int64_t lo = kind == MaskKind::kSlidingWindow
                                ? std::clamp<std::int64_t>(detail::sub_sat(qi + causal_offset + 1, window), 0, hi)
                                : 0;
    return {lo, hi};
  }
};

namespace detail {
/// n(n+1)/2 without the overflow of n * (n + 1) when the result itself fits (n <= 4.29e9).
[[nodiscard]] constexpr std::int64_t triangle(std::int64_t n) noexcept {
  return n % 2 == 0 ? (n / 2) * (n + 1) : n * ((n + 1) / 2);
}
/// Sum over x in [a, b) of clamp(x, 0, k).
[[nodiscard]] constexpr std::int64_t clamped_sum(std::int64_t a, std::int64_t b, std::int64_t k) noexcept {
  const auto prefix = [k](std::int64_t n) {  // sum over x in [0, n) of min(x, k), n >= 0
    return n <= k + 1 ? triangle(n - 1) : triangle(k) + (n - k - 1) * k;
  };
  return prefix(std::max<std::int64_t>(b, 0)) - prefix(std::max<std::int64_t>(a, 0));
}
}  // namespace detail

/// The unit of attention work: queries q_range attend to keys k_range under mask.
/// Within one kernel call the q_ranges of all slices are disjoint; a query row that needs keys from
/// several places is covered by several calls whose partial results are merged (attention/merge.hpp).
struct AttnSlice {
  Range q_range;
  Range k_range;
  Mask mask;

  /// Number of visible (query, key) pairs: the unit of compute (FLOPs = 4 * d * Hq * area).
  /// Closed form, O(1): planners and the simulator call it for every slice of every rank.
  [[nodiscard]] constexpr std::int64_t area() const noexcept {
    const std::int64_t q = q_range.size(), k = k_range.size();
    if (q <= 0 || k <= 0) return 0;
    if (mask.kind == MaskKind::kFull) return q * k;
    // Row qi sees clamp(x, 0, k) keys with x = qi + offset + 1, minus clamp(x - window, 0, k) with a
    // sliding window (visible_keys); both sums over a run of consecutive x have a closed form.
    const std::int64_t x0 = mask.causal_offset + 1;
    std::int64_t total = detail::clamped_sum(x0, x0 + q, k);
    if (mask.kind == MaskKind::kSlidingWindow)  // saturated: a window of INT64_MAX is causal, not a wrap
      total -= detail::clamped_sum(detail::sub_sat(x0, mask.window), detail::sub_sat(x0 + q, mask.window), k);
    return total;
  }
  friend constexpr bool operator==(const AttnSlice&, const AttnSlice&) = default;
};

/// Whether row i of s sees exactly key i of it and nothing else (q_range and k_range of one size): the
/// slice of a one-token document, or a run of them merged by append_slice. Any 1x1 slice with its pair
/// visible is one.
[[nodiscard]] constexpr bool is_diagonal(const AttnSlice& s) noexcept {
  const std::int64_t n = s.q_range.size();
  if (n <= 0 || s.k_range.size() != n) return false;
  if (n == 1) return s.area() == 1;
  return s.mask.kind == MaskKind::kSlidingWindow && s.mask.window == 1 && s.mask.causal_offset == 0;
}

/// Appends `s` to a slice list; when `s` and the last slice are both diagonal and `s` continues it in
/// queries and keys, the two become one diagonal slice (a sliding window of one key). Exact: every
/// query row sees the same single key as before, so a kernel computes the same row. A million
/// one-token documents are then a few slices instead of a million, in plans and kernel calls alike.
inline void append_slice(std::vector<AttnSlice>& list, const AttnSlice& s) {
  if (!list.empty()) {
    AttnSlice& last = list.back();
    if (last.q_range.end == s.q_range.begin && last.k_range.end == s.k_range.begin && is_diagonal(s) &&
        is_diagonal(last)) {
      last = {{last.q_range.begin, s.q_range.end}, {last.k_range.begin, s.k_range.end}, Mask::sliding_window(1)};
      return;
    }
  }
  list.push_back(s);
}

inline std::ostream& operator<<(std::ostream& os, const AttnSlice& s) {
  return os << "{q " << s.q_range << ", k " << s.k_range << ", mask " << static_cast<int>(s.mask.kind) << '/'
            << s.mask.causal_offset << '/' << s.mask.window << '}';
}

[[nodiscard]] inline std::int64_t total_area(std::span<const AttnSlice> slices) noexcept {
  std::int64_t total = 0;
  for (const auto& s : slices) total += s.area();
  return total;
}

/// Checks a slice list against buffers of q_rows and k_rows tokens: ranges in bounds, masks well
/// formed, q_ranges pairwise disjoint. Throws std::invalid_argument naming the slice.
inline void validate_slices(std::span<const AttnSlice> slices, std::int64_t q_rows, std::int64_t k_rows,
                            const char* where) {
  // Messages are built only on failure: kernels validate on every call.
  bool sorted = true;
  std::int64_t last_end = std::numeric_limits<std::int64_t>::min(), last_begin = last_end;
  for (std::size_t i = 0; i < slices.size(); ++i) {
    const AttnSlice& s = slices[i];
    const bool q_ok = s.q_range.begin >= 0 && s.q_range.end <= q_rows && s.q_range.begin <= s.q_range.end;
    const bool k_ok = s.k_range.begin >= 0 && s.k_range.end <= k_rows && s.k_range.begin <= s.k_range.end;
    const bool window_ok = s.mask.kind != MaskKind::kSlidingWindow || s.mask.window >= 1;
    if (!q_ok || !k_ok || !window_ok) {
      const auto name = "slices[" + std::to_string(i) + "]";
      detail::require(q_ok, where, name + ".q_range", s.q_range,
                      "out of the query buffer of " + std::to_string(q_rows) + " rows");
      detail::require(k_ok, where, name + ".k_range", s.k_range,
                      "out of the key buffer of " + std::to_string(k_rows) + " rows");
      detail::require(window_ok, where, name + ".mask.window", s.mask.window,
                      "a sliding window needs at least one key");
    }
    if (s.q_range.empty()) continue;
    if (s.q_range.begin < last_begin) sorted = false;
    if (sorted && s.q_range.begin < last_end)
      detail::require(false, where, "slices", s.q_range,
                      "query ranges of one call must be disjoint (merge partial results instead)");
    last_begin = s.q_range.begin;
    last_end = s.q_range.end;
  }
  if (sorted) return;  // the executor's waves come sorted by query row: no copy needed
  std::vector<Range> qs;
  qs.reserve(slices.size());
  for (const AttnSlice& s : slices)
    if (!s.q_range.empty()) qs.push_back(s.q_range);
  std::sort(qs.begin(), qs.end(), [](Range a, Range b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < qs.size(); ++i)
    detail::require(qs[i].begin >= qs[i - 1].end, where, "slices", qs[i],
                    "query ranges of one call must be disjoint (merge partial results instead)");
}

}  // namespace seqpar
