// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <string_view>

namespace seqpar {

/// The one 64-bit hash of the library: FNV-1a over bytes (offset basis 14695981039346656037, prime
/// 1099511628211, http://www.isthe.com/chongo/tech/comp/fnv/). Fingerprints of batches, masks, mask
/// mixes, chunk plans and strategy arguments are all made with it, so that two ranks (or a plan and the
/// call it is used for) compare values made the same way. Not cryptographic: it tells values made for
/// another call apart, it does not defend against an adversary. O(bytes), no allocation.
///
/// @code
/// Hash64 h;
/// h.add(batch.total_tokens()).add(mask.window);
/// const std::uint64_t fingerprint = h.value();
/// @endcode
class Hash64 {
 public:
  static constexpr std::uint64_t kOffsetBasis = 14695981039346656037ull;
  static constexpr std::uint64_t kPrime = 1099511628211ull;

  /// Mixes the 8 bytes of x, least significant first (the same on every platform this runs on).
  constexpr Hash64& add(std::int64_t x) noexcept { return add(static_cast<std::uint64_t>(x)); }
  constexpr Hash64& add(std::uint64_t x) noexcept {
    for (int i = 0; i < 8; ++i) h_ = (h_ ^ ((x >> (8 * i)) & 0xffu)) * kPrime;
    return *this;
  }
  constexpr Hash64& add(std::string_view s) noexcept {
    for (const char c : s) h_ = (h_ ^ static_cast<unsigned char>(c)) * kPrime;
    return add(static_cast<std::uint64_t>(s.size()));  // "ab" + "c" differs from "a" + "bc"
  }

  /// The hash so far; never 0, so that 0 can mean "not known" wherever a fingerprint is stored.
  [[nodiscard]] constexpr std::uint64_t value() const noexcept { return h_ == 0 ? 1 : h_; }

 private:
  std::uint64_t h_ = kOffsetBasis;
};

}  // namespace seqpar
