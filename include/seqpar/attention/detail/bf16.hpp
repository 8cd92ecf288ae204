// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// bfloat16 storage for the CPU path (seqpar::attention::bf16): the upper 16 bits of an IEEE binary32,
// converted from float with round-to-nearest-even (NaN stays a quiet NaN of the same sign). Arithmetic is
// done in float: the type only stores.
#pragma once

#include <bit>
#include <cstdint>

#include "seqpar/core/element_code.hpp"

namespace seqpar::attention {

struct bf16 {
  std::uint16_t bits = 0;

  constexpr bf16() noexcept = default;
  /// Round to nearest, ties to even.
  constexpr explicit bf16(float f) noexcept : bits(round(f)) {}
  [[nodiscard]] constexpr explicit operator float() const noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
  [[nodiscard]] constexpr explicit operator double() const noexcept { return double(float(*this)); }

  [[nodiscard]] static constexpr bf16 from_bits(std::uint16_t b) noexcept {
    bf16 x;
    x.bits = b;
    return x;
  }
  [[nodiscard]] static constexpr std::uint16_t round(float f) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
    return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  friend constexpr bool operator==(bf16 a, bf16 b) noexcept { return float(a) == float(b); }
};

}  // namespace seqpar::attention

/// bfloat16's 8 significand bits (the implicit one included), as numeric_limits would say.
template <>
struct seqpar::element_significand_bits<seqpar::attention::bf16> {
  static constexpr int value = 8;
};
