// SPDX-License-Identifier: Apache-2.0
// Test helper: the message of the std::invalid_argument a call throws.
#pragma once

#include <stdexcept>
#include <string>

namespace seqpar::test {

/// Runs f and returns the std::invalid_argument message (empty if nothing was thrown).
template <class F>
std::string invalid_message(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return {};
}

}  // namespace seqpar::test
