// SPDX-License-Identifier: Apache-2.0
// The kernel protocol (attention/kernel.hpp): every kernel's can_implement refuses exactly what its
// calls refuse, with the same message (one predicate), and answers without touching memory.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/attention/kernel.hpp>
#include <seqpar/attention/reference.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/expect_error.hpp"

using namespace seqpar;

namespace {

// The part of a message after "<where>: ", which names the argument, its value and the rule.
std::string after_where(const std::string& message) {
  const auto at = message.find(": ");
  return at == std::string::npos ? message : message.substr(at + 2);
}

// A forward call of `kernel` on `shape` over 5 rows; returns its std::invalid_argument message.
template <class Kernel>
std::string forward_refusal(Kernel& kernel, const HostExec& exec, const AttentionShape& shape) {
  using T = typename Kernel::value_type;
  using A = typename Kernel::accum_type;
  const std::int64_t n = 5;
  ThdTensor<T> q(n, shape.heads_q, shape.head_dim), k(n, shape.heads_kv, shape.head_dim),
      v(n, shape.heads_kv, shape.head_dim), o(n, shape.heads_q, shape.head_dim);
  LseTensor<A> lse(shape.heads_q, n);
  const std::vector<AttnSlice> slices{{{0, n}, {0, n}, Mask::causal()}};
  std::vector<std::byte> ws(1 << 20);
  return test::invalid_message(
      [&] { kernel.forward(exec, shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), ws); });
}

}  // namespace

TEST_SUITE("attention") {
  TEST_CASE("Reference: can_implement refuses the malformed shapes its calls refuse, in the same words") {
    const attention::Reference<double> ref;
    CHECK(ref.can_implement({4, 2, 8}));
    for (const AttentionShape bad : {AttentionShape{4, 3, 8}, AttentionShape{4, 2, 0}, AttentionShape{4, 2, 8, -1.0}}) {
      const Status s = ref.can_implement(bad);
      REQUIRE_FALSE(s);
      const std::string thrown = forward_refusal(ref, ref.exec(), bad);
      CHECK(s.reason.rfind("Reference: ", 0) == 0);
      CHECK(after_where(s.reason) == after_where(thrown));
    }
  }

  TEST_CASE("CpuFlash: can_implement refuses an unrepresentable scale and an oversized context, as its calls do") {
    const AttentionShape tiny{4, 2, 8, 1e-60};  // 0 in float, fine in double
    attention::CpuFlash<float> flash({.threads = 2});
    const Status s = flash.can_implement(tiny);
    REQUIRE_FALSE(s);
    CHECK(s.reason == "CpuFlash: softmax_scale = 1e-60: is not representable in the accumulation type (float)");
    CHECK(after_where(forward_refusal(flash, flash.exec(), tiny)) == after_where(s.reason));
    CHECK(attention::CpuFlash<double>().can_implement(tiny));
    CHECK_FALSE(flash.can_implement({4, 2, 8, 1e300}));

    // A context with more threads than the workspace is sized for: refused for that context only.
    const AttentionShape shape{4, 2, 8};
    const HostExec wide(4);
    CHECK(flash.can_implement(shape));
    const Status on_wide = attention::can_implement(flash, wide, shape);
    REQUIRE_FALSE(on_wide);
    CHECK(on_wide.reason.find("exec.threads() = 4: exceeds args.threads = 2") != std::string::npos);
    CHECK(after_where(forward_refusal(flash, wide, shape)) == after_where(on_wide.reason));
    CHECK(attention::can_implement(attention::Reference<float>(), wide, shape));  // no context rule
  }
}
