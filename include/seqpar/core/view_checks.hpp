// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Aliasing checks for the views one attention call takes: an output must not share memory with an
/// input or with another output (the programs read inputs after writing outputs, and the kernels
/// accumulate into outputs, so aliasing gives wrong answers, not just slow ones). Inputs may share
/// memory with each other (q, k, v sliced from one packed QKV buffer).
///
/// Two views are disjoint when their address hulls are, or, for THD views with the same token
/// stride whose token rows fit inside that stride (the packed-QKV and heads_slice layouts), when
/// their rows sit at disjoint offsets within the stride. Anything else whose hulls meet is refused:
/// the check may refuse an exotic layout that happens not to overlap, never accept one that does.

#include <cstddef>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>

#include "seqpar/core/error.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::detail {

/// The memory a view touches: the byte hull [lo, hi), and for THD views the token stride and the
/// bytes one token row spans from its first element (period = 0: no row structure to use).
struct Footprint {
  std::uintptr_t lo = 0, hi = 0;
  std::int64_t period = 0, row_bytes = 0;
  [[nodiscard]] bool empty() const noexcept { return lo == hi; }
};

/// Footprint of a view whose layout check_view accepted (offsets fit in ptrdiff_t bytes).
template <class T>
[[nodiscard]] Footprint footprint(const ThdView<T>& v) noexcept {
  if (v.tokens <= 0 || v.heads <= 0 || v.head_dim <= 0 || v.data == nullptr) return {};
  const auto e = static_cast<std::int64_t>(sizeof(T));
  const std::int64_t row = ((v.heads - 1) * v.head_stride + v.head_dim) * e;
  const std::int64_t span = (v.tokens - 1) * v.token_stride * e + row;
  const auto lo = reinterpret_cast<std::uintptr_t>(v.data);
  Footprint f{lo, lo + static_cast<std::uintptr_t>(span), 0, row};
  if (v.tokens > 1 && row <= v.token_stride * e) f.period = v.token_stride * e;
  return f;
}
template <class T>
[[nodiscard]] Footprint footprint(const LseView<T>& v) noexcept {
  if (v.tokens <= 0 || v.heads <= 0 || v.data == nullptr) return {};
  const auto e = static_cast<std::int64_t>(sizeof(T));
  const std::int64_t span = ((v.heads - 1) * v.head_stride + v.tokens) * e;
  const auto lo = reinterpret_cast<std::uintptr_t>(v.data);
  return {lo, lo + static_cast<std::uintptr_t>(span), 0, 0};
}

/// Footprint of a caller's workspace.
[[nodiscard]] inline Footprint footprint(std::span<std::byte> bytes) noexcept {
  const auto lo = reinterpret_cast<std::uintptr_t>(bytes.data());
  return bytes.empty() ? Footprint{} : Footprint{lo, lo + bytes.size(), 0, 0};
}

/// Footprint of a span of values (attention sinks and their gradient: one value per query head).
template <class T>
[[nodiscard]] Footprint footprint(std::span<T> values) noexcept {
  const auto lo = reinterpret_cast<std::uintptr_t>(values.data());
  return values.empty() ? Footprint{} : Footprint{lo, lo + values.size_bytes(), 0, 0};
}

[[nodiscard]] inline bool overlap(const Footprint& a, const Footprint& b) noexcept {
  if (a.empty() || b.empty() || a.hi <= b.lo || b.hi <= a.lo) return false;
  if (a.period == 0 || a.period != b.period) return true;
  // Same token stride, rows inside it: compare the rows' offsets modulo the stride (circularly).
  const auto p = static_cast<std::uintptr_t>(a.period);
  const auto shift = static_cast<std::int64_t>(((b.lo % p) + p - (a.lo % p)) % p);  // b's row start, from a's
  return shift < a.row_bytes || shift + b.row_bytes > a.period;
}

/// Throws std::invalid_argument when output `out` shares memory with `other` (an input or another
/// output): "<where>: o = [0x..., 0x...) : overlaps q [...]".
template <class ViewA, class ViewB>
void check_disjoint(const char* where, const char* out_name, const ViewA& out, const char* other_name,
                    const ViewB& other) {
  const Footprint a = footprint(out), b = footprint(other);
  if (!overlap(a, b)) return;
  std::ostringstream value, why;
  value << "[0x" << std::hex << a.lo << ", 0x" << a.hi << ")";
  why << "overlaps " << other_name << " [0x" << std::hex << b.lo << ", 0x" << b.hi
      << "): an output may share memory with no input and no other output";
  throw_invalid(where, out_name, value.str(), why.str());
}

/// check_disjoint of output `out` against each (name, view) pair that follows.
template <class Out>
void check_disjoint_from(const char* /*where*/, const char* /*out_name*/, const Out& /*out*/) {}
template <class Out, class View, class... Rest>
void check_disjoint_from(const char* where, const char* out_name, const Out& out, const char* name, const View& view,
                         const Rest&... rest) {
  check_disjoint(where, out_name, out, name, view);
  check_disjoint_from(where, out_name, out, rest...);
}

}  // namespace seqpar::detail
