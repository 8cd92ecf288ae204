// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <seqpar/core/attention_shape.hpp>
#include <seqpar/core/attn_slice.hpp>
#include <seqpar/core/document_batch.hpp>
#include <seqpar/core/tensor.hpp>
#include <seqpar/core/timeout.hpp>
#include <seqpar/core/topology.hpp>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>

using namespace seqpar;

namespace {
using test::invalid_message;
}  // namespace

TEST_SUITE("core") {
  TEST_CASE("DocumentBatch lays documents out THD with cu_seqlens") {
    const DocumentBatch b({{3, 1, 4}, {7}});
    CHECK(b.num_sequences() == 2);
    CHECK(b.total_tokens() == 15);
    const std::vector<std::int64_t> cu(b.cu_seqlens().begin(), b.cu_seqlens().end());
    CHECK(cu == std::vector<std::int64_t>{0, 3, 4, 8, 15});
    CHECK(b.sequence(1) == Range{8, 15});
    CHECK(b.documents_of(0).size() == 3);
    CHECK(b.documents_of(1)[0].tokens == Range{8, 15});
    CHECK(b.causal_area() == 6 + 1 + 10 + 28);
    CHECK(total_area(b.document_causal_slices()) == b.causal_area());
  }

  TEST_CASE("DocumentBatch rejects bad lengths naming the argument and value") {
    CHECK(invalid_message([] { DocumentBatch({{3, 0, 4}}); }).find("sequences[0][1] = 0") != std::string::npos);
    CHECK(invalid_message([] { DocumentBatch({{3}, {-2}}); }).find("sequences[1][0] = -2") != std::string::npos);
    CHECK(invalid_message([] { DocumentBatch({{3}, {}}); }).find("sequences[1].size()") != std::string::npos);
    CHECK(invalid_message([] { DocumentBatch(std::vector<std::vector<std::int64_t>>{}); }).find("sequences") !=
          std::string::npos);
    const std::int64_t huge = DocumentBatch::kMaxTokens;
    CHECK(invalid_message([&] { DocumentBatch({{huge, huge}}); }).find("overflow") != std::string::npos);
  }

  TEST_CASE("AttentionShape validation") {
    CHECK_NOTHROW(AttentionShape{32, 8, 128}.validate());
    CHECK(invalid_message([] { AttentionShape{6, 4, 64}.validate(); }).find("heads_q = 6") != std::string::npos);
    CHECK(invalid_message([] { AttentionShape{0, 1, 64}.validate(); }).find("heads_q = 0") != std::string::npos);
    CHECK(invalid_message([] { AttentionShape{4, 4, -1}.validate(); }).find("head_dim = -1") != std::string::npos);
    CHECK(invalid_message([] { AttentionShape{4, 4, 8, -1.0}.validate(); }).find("softmax_scale") != std::string::npos);
    CHECK(AttentionShape{4, 2, 16}.scale() == doctest::Approx(0.25));
    CHECK(AttentionShape{4, 2, 16}.group_size() == 2);
  }

  TEST_CASE("Topology") {
    const Topology t{8, 4};
    CHECK(t.num_nodes() == 2);
    CHECK(t.same_node(0, 3));
    CHECK_FALSE(t.same_node(3, 4));
    CHECK(Topology{6, 4}.num_nodes() == 2);
    CHECK(invalid_message([] { Topology{0, 1}.validate(); }).find("world_size = 0") != std::string::npos);
    CHECK(invalid_message([] { Topology{4, -1}.validate(); }).find("ranks_per_node = -1") != std::string::npos);
  }

  TEST_CASE("Mask visible keys: causal with alignment, sliding window, full") {
    // A query block 5 tokens after the start of its keys: row 0 sees keys 0..5.
    const Mask causal = Mask::causal(5);
    CHECK(causal.visible_keys(0, 100) == Range{0, 6});
    CHECK(causal.visible_keys(2, 7) == Range{0, 7});
    CHECK(Mask::causal(-3).visible_keys(1, 10).empty());  // fully masked row
    CHECK(Mask::sliding_window(3).visible_keys(5, 10) == Range{3, 6});
    CHECK(Mask::full().visible_keys(0, 9) == Range{0, 9});
    const AttnSlice s{{0, 4}, {0, 4}, Mask::causal(0)};
    CHECK(s.area() == 10);
    CHECK(AttnSlice{{0, 4}, {0, 6}, Mask::full()}.area() == 24);
  }

  TEST_CASE("AttnSlice::area (closed form) equals the row-by-row count of visible keys") {
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> len(0, 40), off(-50, 50), win(1, 30), kind(0, 2);
    for (int trial = 0; trial < 20000; ++trial) {
      const Mask m = kind(rng) == 0   ? Mask::full()
                     : kind(rng) == 1 ? Mask::causal(off(rng))
                                      : Mask::sliding_window(win(rng), off(rng));
      const AttnSlice s{{3, 3 + len(rng)}, {5, 5 + len(rng)}, m};
      std::int64_t rows = 0;
      for (std::int64_t qi = 0; qi < s.q_range.size(); ++qi) rows += m.visible_keys(qi, s.k_range.size()).size();
      REQUIRE(s.area() == rows);
    }
    // Large slices stay exact (the simulator sums areas of 1M-token batches).
    CHECK(AttnSlice{{0, 1 << 20}, {0, 1 << 20}, Mask::causal()}.area() ==
          (std::int64_t{1} << 20) * ((1 << 20) + 1) / 2);
  }

  TEST_CASE("validate_slices rejects out-of-range and overlapping slices") {
    const std::vector<AttnSlice> overlap{{{0, 4}, {0, 4}, Mask::causal()}, {{3, 6}, {0, 6}, Mask::causal()}};
    CHECK(invalid_message([&] { validate_slices(overlap, 10, 10, "t"); }).find("disjoint") != std::string::npos);
    const std::vector<AttnSlice> oob{{{0, 4}, {0, 12}, Mask::full()}};
    CHECK(invalid_message([&] { validate_slices(oob, 10, 10, "t"); }).find("slices[0].k_range") != std::string::npos);
    const std::vector<AttnSlice> win{{{0, 4}, {0, 4}, Mask::sliding_window(0)}};
    CHECK(invalid_message([&] { validate_slices(win, 10, 10, "t"); }).find("window") != std::string::npos);
  }

  TEST_CASE("Tensor views: strides, head slices, extent checks") {
    ThdTensor<float> t(5, 4, 3);
    auto v = t.view();
    v(2, 3, 1) = 7.0f;
    CHECK(t.storage[static_cast<std::size_t>(2 * 12 + 3 * 3 + 1)] == 7.0f);
    auto h = v.heads_slice(2, 2);
    CHECK(h(2, 1, 1) == 7.0f);
    CHECK(h.heads == 2);
    CHECK(invalid_message([&] { detail::check_view(v, "t", "q", 5, 4, 4); }).find("q.head_dim = 3") !=
          std::string::npos);
    CHECK(invalid_message([&] { detail::check_view(v, "t", "k", 6, 4, 3); }).find("k.tokens = 5") != std::string::npos);
  }

  TEST_CASE("the transports' default wait bound: 10 minutes (a slow first step survives), SEQPAR_TIMEOUT_S overrides") {
    // The test presets set SEQPAR_TIMEOUT_S; restore whatever was there.
    const char* was = std::getenv("SEQPAR_TIMEOUT_S");
    const std::optional<std::string> saved = was ? std::optional<std::string>(was) : std::nullopt;
    ::unsetenv("SEQPAR_TIMEOUT_S");
    CHECK(detail::default_timeout() == std::chrono::minutes{10});
    ::setenv("SEQPAR_TIMEOUT_S", "0.25", 1);
    CHECK(detail::default_timeout() == std::chrono::milliseconds{250});
    for (const char* bad : {"0", "-3", "ten", "1e12", "inf"}) {
      ::setenv("SEQPAR_TIMEOUT_S", bad, 1);
      CHECK(invalid_message([] { (void)detail::default_timeout(); }).find("SEQPAR_TIMEOUT_S") != std::string::npos);
    }
    if (saved)
      ::setenv("SEQPAR_TIMEOUT_S", saved->c_str(), 1);
    else
      ::unsetenv("SEQPAR_TIMEOUT_S");
  }
}
