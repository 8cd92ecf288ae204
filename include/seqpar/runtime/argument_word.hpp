// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <bit>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace seqpar::runtime {

/// One policy argument that changes the program, as the ranks compare it before every call: its name
/// ("comm.sharding_aware", "partition.inner.capacity_factor") and its value as one word (integers,
/// bools and enums as is, floating point by the bits of its double, is_double set). The engine
/// compares the words of every rank so that a disagreement is an Errc::kMismatch naming the argument.
struct ArgumentWord {
  std::string name;
  std::uint64_t value = 0;
  bool is_double = false;
};

namespace detail {
template <class V>
inline constexpr bool kOptionalLike = requires(const V& v) {
  v.has_value();
  *v;
};
template <class>
inline constexpr bool kNoArgumentWord = false;
}  // namespace detail

/// `value` as the word ranks compare: an integer, bool or enum as is; a floating-point value by its
/// bits; an optional as its value or a marker when empty; anything else that converts to bool (a
/// std::function: its behaviour cannot be compared across ranks) by whether it is set.
template <class V>
[[nodiscard]] ArgumentWord argument_word(std::string name, const V& value) {
  if constexpr (std::is_integral_v<V> || std::is_enum_v<V>) {
    return {std::move(name), static_cast<std::uint64_t>(value), false};
  } else if constexpr (std::is_floating_point_v<V>) {
    return {std::move(name), std::bit_cast<std::uint64_t>(static_cast<double>(value)), true};
  } else if constexpr (detail::kOptionalLike<V>) {
    if (value.has_value()) return argument_word(std::move(name), *value);
    return {std::move(name), 0x8000000000000000ull, false};
  } else if constexpr (std::is_constructible_v<bool, const V&>) {
    return {std::move(name), static_cast<std::uint64_t>(static_cast<bool>(value)), false};
  } else {
    static_assert(detail::kNoArgumentWord<V>,
                  "argument_word: a policy argument compared across ranks must be an integer, bool, enum, floating "
                  "point value, optional of one, or convert to bool (a callable: whether it is set)");
    return {};
  }
}

}  // namespace seqpar::runtime
