// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

namespace seqpar {

/// A visitor made of lambdas, one per alternative: `std::visit(Overloaded{[](const A&) {}, ...}, v)`.
/// A missing alternative is a compile error, so adding a step kind finds every dispatch site.
template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

}  // namespace seqpar
