// SPDX-License-Identifier: Apache-2.0
// The CUDA storage types' element codes (core/element_code.hpp, specialized in
// kernels/seqpar/gpu/detail/element.hpp): float16 and bfloat16 have the same size, and a rank running one
// while its peers run the other must be refused by the call's agreement, so their codes differ.
#include <doctest/doctest.h>

#include <set>

#include "seqpar/gpu/detail/element.hpp"

TEST_CASE("element code: float16, bfloat16, float and double storage have distinct codes") {
  using seqpar::element_code;
  CHECK(element_code<__half, float>() == 21104);  // 2 bytes, 11 significand bits, float accumulation
  CHECK(element_code<__nv_bfloat16, float>() == 20804);
  CHECK(element_code<float, float>() == 42404);
  const std::set<long long> codes{element_code<__half, float>(), element_code<__nv_bfloat16, float>(),
                                  element_code<float, float>(), element_code<double, double>()};
  CHECK(codes.size() == 4);
}
