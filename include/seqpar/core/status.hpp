// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "seqpar/core/error.hpp"

namespace seqpar {

/// Result of a `can_implement` query: ok, or the reason a combination cannot work.
struct Status {
  bool ok = true;
  std::string reason;
  [[nodiscard]] static Status success() { return {}; }
  [[nodiscard]] static Status refuse(std::string why) { return {false, std::move(why)}; }
  explicit operator bool() const noexcept { return ok; }
};

namespace detail {

/// A refusal worded as the std::invalid_argument a call would throw for it
/// ("<where>: <argument> = <value>: <why>"), so that a `can_implement` and the call-time check built
/// on the same predicate say the same thing.
template <class Value>
[[nodiscard]] Status refuse_invalid(std::string_view where, std::string_view argument, const Value& value,
                                    std::string_view why) {
  return Status::refuse(invalid_message(where, argument, value, why));
}

/// Throws std::invalid_argument(status.reason) when `status` refuses.
inline void throw_if_refused(const Status& status) {
  if (!status) throw std::invalid_argument(status.reason);
}

}  // namespace detail
}  // namespace seqpar
